"""Settings of the whole test session."""

# The kernels' own tests run first: they compile every numba kernel once, in one process, into
# the on-disk cache (``hvd_compress.kernels`` compiles with ``cache=True``) that every later
# Horovod worker loads. In file order the first multi-process tests compiled the kernels in
# each of their 2-4 workers at once: on a fresh clone, a fifth of those tests' time.
_FIRST = ("test_kernels.py", "test_tf_kernels.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in _FIRST)
