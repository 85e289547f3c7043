"""The README's two complete examples run as written: each ```python block is taken from
README.md, written to a file and run with the command the README gives,
``horovodrun -np 2 -H localhost:2 --gloo python train.py``, so the README cannot rot.

The blocks are found by what makes them complete examples, not by their position: the
PyTorch one imports torch and wraps an optimizer in ``DistributedOptimizer``, the Keras one
calls ``model.fit``.
"""

import os
import re
import sys

import pytest

from .harness import BIN, REPO, run_job

pytestmark = pytest.mark.multiprocess


def readme_example(*markers):
    """The one ```python block of README.md that contains every marker."""
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"^```python\n(.*?)^```$", f.read(), re.DOTALL | re.MULTILINE)
    found = [block for block in blocks if all(marker in block for marker in markers)]
    assert len(found) == 1, f"{len(found)} README blocks contain {markers}"
    return found[0]


@pytest.mark.parametrize(
    "markers",
    [("import torch", "DistributedOptimizer("), ("import keras", "model.fit(")],
    ids=["pytorch", "keras"],
)
def test_readme_example_runs_on_two_workers(tmp_path, markers):
    script = tmp_path / "train.py"
    script.write_text(readme_example(*markers))
    output = run_job(
        [
            os.path.join(BIN, "horovodrun"),
            "-np",
            "2",
            "-H",
            "localhost:2",
            "--gloo",
            sys.executable,
            str(script),
        ],
        f"the README's {markers[0]} example",
        300,
        cwd=tmp_path,
    )
    # Both ranks reach the example's last line, which reports the compression.
    assert len(re.findall(r"rank [01]: .*x fewer bytes", output)) == 2, output
