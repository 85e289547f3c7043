"""Settings of the whole test session."""

import os

import pytest
import torch

from . import harness

# Without a GPU, the Triton kernels run on CPU tensors under Triton's interpreter, which
# must be on before ``triton.jit`` wraps them (``tests/test_triton_kernels.py``).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The kernels' own tests run first: they compile every numba kernel once, in one process, into
# the on-disk cache (``hvd_compress.kernels`` compiles with ``cache=True``) that every later
# Horovod worker loads. In file order the first multi-process tests compiled the kernels in
# each of their 2-4 workers at once: on a fresh clone, a fifth of those tests' time.
_FIRST = ("test_kernels.py", "test_tf_kernels.py")


def pytest_collection_modifyitems(items):
    """The kernels' tests first, then every module in order; inside a module, tests
    parametrised by world size grouped by it, so that a shared Horovod job of each size
    (``tests.harness``) starts once rather than at every change of size."""
    modules = {}
    for item in items:
        modules.setdefault(item.path, len(modules))

    def order(item):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        world = params.get("world", params.get("world_size", 0))
        return item.path.name not in _FIRST, modules[item.path], world

    items.sort(key=order)


@pytest.fixture(autouse=True, scope="module")
def _shared_jobs_end_with_their_module():
    """A module's shared Horovod jobs (``tests.harness``) end with it."""
    yield
    harness.close_shared_jobs()
