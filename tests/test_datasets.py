"""MNIST-1D is generated once per seed and read back from the cache afterwards."""

import numpy as np

from hvd_compress.examples import datasets


def test_cached_arrays_equal_generated_ones_and_a_damaged_file_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path))
    generated = datasets.load_mnist1d(seed=3)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.endswith("-seed3.npz")
    assert [a.shape for a in generated] == [(4000, 40), (4000,), (1000, 40), (1000,)]
    assert [a.dtype for a in generated] == [np.float32, np.int64, np.float32, np.int64]
    for cached, fresh in zip(datasets.load_mnist1d(seed=3), generated):
        np.testing.assert_array_equal(cached, fresh)
    files[0].write_bytes(b"not an npz file")
    for again, fresh in zip(datasets.load_mnist1d(seed=3), generated):
        np.testing.assert_array_equal(again, fresh)
    assert [f.name for f in tmp_path.iterdir()] == [files[0].name]
    # Another seed is another dataset, in its own file.
    assert not np.array_equal(datasets.load_mnist1d(seed=4)[0], generated[0])
    assert len(list(tmp_path.iterdir())) == 2
