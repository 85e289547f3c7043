"""MNIST-1D (Greydanus, 2020), generated locally with ``mnist1d.data.make_dataset``: the
embedded real dataset of the examples and tests (4,000 training and 1,000 test signals of
length 40, ten classes). Nothing is downloaded.

Generation is deterministic in the seed but takes 3 s of a CPU core, and every worker
of every run generates it: the 42 workers of the MNIST-1D runs of ``make demo-full`` would
spend two minutes of a core on it. The arrays (1 MB) are therefore kept in
``~/.cache/hvd_compress`` (``HVD_COMPRESS_CACHE`` overrides it), keyed by the seed and the
mnist1d version.
"""

import importlib.metadata
import os
import pathlib

import numpy as np

_NAMES = ("x_train", "y_train", "x_test", "y_test")


def cache_dir():
    return pathlib.Path(
        os.environ.get("HVD_COMPRESS_CACHE", pathlib.Path.home() / ".cache" / "hvd_compress")
    )


def load_mnist1d(seed=42):
    """Returns ``(x_train, y_train, x_test, y_test)`` as float32 ``(n, 40)`` and int64."""
    try:
        version = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError as error:
        raise ImportError("MNIST-1D needs the mnist1d package: pip install mnist1d") from error
    path = cache_dir() / f"mnist1d-{version}-seed{seed}.npz"
    try:
        with np.load(path) as cached:
            return tuple(cached[name] for name in _NAMES)
    except (OSError, KeyError, ValueError):
        pass  # absent or unreadable: generated again, and the file replaced
    # Imported only to generate: mnist1d.data loads matplotlib and takes 1.5 s, half of
    # what the cache saves.
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    arrays = (
        data["x"].astype(np.float32),
        data["y"].astype(np.int64),
        data["x_test"].astype(np.float32),
        data["y_test"].astype(np.int64),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Workers of one run generate it at the same time: each writes its own file and
        # renames it into place, which is atomic, so no reader sees half a file.
        partial = path.with_suffix(f".{os.getpid()}.npz")
        np.savez(partial, **dict(zip(_NAMES, arrays)))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home still trains, only slower to start
    return arrays
