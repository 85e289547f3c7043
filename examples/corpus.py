"""A real text corpus that every machine has without a download: the Python source files of
the standard library of the running interpreter, as bytes, for byte-level language models
(``examples/lm_torch.py``, ``examples/lm_keras.py``).

The files are the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, without the
test suites (``test/``, ``tests/``, ``idle_test/``: generated and repetitive) and without
``site-packages``, in sorted order of their relative paths. Every ``VALIDATION_EVERY``-th file
of that order (the 0th, 10th, ...) is the validation set, the others the training set, each
file's bytes followed by a newline. The split is by file, so no validation text is seen in
training, and it is the same on every rank and every run; it differs between Python versions
as their libraries do (``describe`` names the version, and the demo prints it).
"""

import pathlib
import sys
import sysconfig

import numpy as np

VALIDATION_EVERY = 10
# Validation: this many windows of the context length, evenly spaced over the held-out files.
VALIDATION_WINDOWS = 256
_SKIPPED = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def source_files():
    """The corpus's files, in the order the split counts them."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not _SKIPPED.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_stdlib_text():
    """(training bytes, validation bytes) as uint8 arrays."""
    parts = ([], [])
    for index, path in enumerate(source_files()):
        parts[index % VALIDATION_EVERY == 0].append(path.read_bytes() + b"\n")
    return tuple(np.frombuffer(b"".join(part), dtype=np.uint8) for part in parts)


def windows(data, starts, context):
    """Inputs and next-byte targets (int64 rows of ``context`` bytes) of the windows of
    ``data`` starting at ``starts``."""
    rows = np.stack([data[s : s + context + 1] for s in starts]).astype(np.int64)
    return rows[:, :-1], rows[:, 1:]


def validation_windows(data, context):
    """``windows`` of ``VALIDATION_WINDOWS`` starts evenly spaced over ``data`` (the
    validation bytes): the same on every rank and run."""
    starts = np.linspace(0, data.size - context - 1, VALIDATION_WINDOWS).astype(int)
    return windows(data, starts, context)


def describe():
    """What the corpus is, for a results table."""
    version = ".".join(map(str, sys.version_info[:3]))
    return (
        f"the Python {version} standard library's source (every {VALIDATION_EVERY}th file held out)"
    )
