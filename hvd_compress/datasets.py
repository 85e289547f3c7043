"""MNIST-1D (Greydanus, 2020), generated locally with ``mnist1d.data.make_dataset``: the
embedded real dataset of the examples and tests (4,000 training and 1,000 test signals of
length 40, ten classes). Generation is deterministic in the seed and takes a second, so
nothing is downloaded or cached."""
import numpy as np


def load_mnist1d(seed=42):
    """Returns ``(x_train, y_train, x_test, y_test)`` as float32 ``(n, 40)`` and int64."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as error:
        raise ImportError("MNIST-1D needs the mnist1d package: pip install mnist1d") from error
    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    return (data["x"].astype(np.float32), data["y"].astype(np.int64),
            data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))
