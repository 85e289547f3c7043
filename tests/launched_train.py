"""The training that the launcher tests start through a real launcher or engine
(``test_launchers``: ``horovodrun -H`` and ``mpirun -H`` over ssh, Slurm's ``sbatch``,
``horovod.spark.run``, ``horovod.ray.RayExecutor``): a few steps per codec and exchange, each
rank reporting where Horovod placed it, a digest of its parameters after every step, and
the bytes every step handed to Horovod beside what the cost model predicts.

    python -m tests.launched_train OUT STEPS CODEC:EXCHANGE [CODEC:EXCHANGE ...]

writes ``OUT/rank<r>.json`` on every rank; the engines call ``train`` (PyTorch) or
``train_keras`` and collect what it returns. The exchange ``two-level`` needs Horovod's
dynamic process sets, which ``train`` initialises.
"""

import hashlib
import json
import os
import sys


def _split(runs):
    """(codec, exchange) of each ``"codec[:hyperparameters]:exchange"`` of ``runs``."""
    return [run.rsplit(":", 1) for run in runs]


def train(runs, steps):
    """Trains ``Net`` for ``steps`` steps on this rank's random data with each
    ``"codec:exchange"`` of ``runs``; returns this rank's placement and, per run, a digest of its
    parameters after every step and the bytes each step handed to Horovod with what the
    cost model predicts."""
    import horovod.torch as hvd
    import torch

    import hvd_compress.pt as hc

    from .pt_jobs import Net

    hvd.init(process_sets="dynamic")
    results = []
    for codec, exchange in _split(runs):
        torch.manual_seed(0)
        model = Net()
        optimizer = hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            compression=codec,
            exchange=exchange,
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        data = torch.Generator().manual_seed(100 + hvd.rank())
        digests, handed = [], []
        for _ in range(steps):
            optimizer.zero_grad()
            x = torch.randn(8, 64, generator=data)
            y = torch.randint(0, 10, (8,), generator=data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            digests.append(_digest(p.detach().numpy() for p in model.parameters()))
            handed.append(optimizer.compression_stats()["bytes_handed"])
        results.append(_run(codec, exchange, digests, handed, optimizer))
    return _placement(hvd, results)


def train_keras(runs, steps):
    """``train`` with Keras: a perceptron fitted ``steps`` batches through the Keras
    ``DistributedOptimizer`` with each ``"codec:exchange"`` of ``runs``."""
    import horovod.tensorflow as hvd
    import keras
    import numpy as np

    import hvd_compress.tf as htf

    from . import keras_perceptron

    hvd.init(process_sets="dynamic")
    results = []
    for codec, exchange in _split(runs):
        keras.utils.set_random_seed(0)
        model = keras_perceptron.model(keras)
        optimizer = htf.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), compression=codec, exchange=exchange
        )
        step = keras_perceptron.trainer(model, optimizer)
        digests, handed = [], []
        for t in range(steps):
            step(*keras_perceptron.batch(hvd.rank(), t))
            digests.append(_digest(np.asarray(v) for v in model.trainable_variables))
            handed.append(optimizer.compression_stats()["bytes_handed"])
        results.append(_run(codec, exchange, digests, handed, optimizer))
    return _placement(hvd, results)


def _digest(arrays):
    """A digest of the bytes of ``arrays``: equal on two ranks only if every bit is."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(array.tobytes())
    return digest.hexdigest()


def _run(codec, exchange, digests, handed, optimizer):
    stats = optimizer.compression_stats()
    return {
        "codec": codec,
        "exchange": exchange,
        "digests": digests,
        "handed": handed,
        "expected": optimizer._hvdc_pipeline.expected_bytes(),
        "routes": sorted({route for _, _, route, _ in stats["tensors"]}),
    }


def _placement(hvd, runs):
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "mpi": hvd.mpi_enabled(),
        "gloo": hvd.gloo_enabled(),
        "runs": runs,
    }


def main(out, steps, *runs):
    result = train(runs, int(steps))
    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
