"""The training that the launcher tests start through a real launcher or engine
(``test_launchers``: ``horovodrun -H`` and ``mpirun -H`` over ssh, Slurm's ``sbatch``,
``horovod.spark.run``, ``horovod.ray.RayExecutor``): a few steps per codec and exchange, each
rank reporting where Horovod placed it and, after every step, its parameters and the bytes
handed to Horovod beside what the cost model predicts; PyTorch's runs also its local and
exchanged gradients, for the numpy reference.

    python -m tests.launched_train OUT STEPS CODEC:EXCHANGE [CODEC:EXCHANGE ...]

writes ``OUT/rank<r>.pkl`` (a pickle) on every rank; the engines call ``train`` (PyTorch) or
``train_keras`` and collect what it returns. The exchange ``two-level`` needs Horovod's
dynamic process sets, which ``train`` initialises.
"""

import os
import pickle
import sys


def _split(runs):
    """(codec, exchange) of each ``"codec[:hyperparameters]:exchange"`` of ``runs``."""
    return [run.rsplit(":", 1) for run in runs]


def train(runs, steps):
    """Trains ``pt_jobs.Net`` for ``steps`` steps on this rank's random data with each
    ``"codec:exchange"`` of ``runs`` (``pt_jobs.train``: every step's local and exchanged
    gradients, parameters and bytes handed); returns them with this rank's placement."""
    import horovod.torch as hvd

    from . import process_sets, pt_jobs

    runs = [
        dict(
            pt_jobs.train(codec, exchange, steps=steps, layout=process_sets.DYNAMIC),
            codec=codec,
            exchange=exchange,
        )
        for codec, exchange in _split(runs)
    ]
    return _placement(hvd, "torch", runs)


def train_keras(runs, steps):
    """``train`` with Keras: a perceptron fitted ``steps`` batches through the Keras
    ``DistributedOptimizer`` with each ``"codec:exchange"`` of ``runs``; records every
    step's parameters and bytes handed."""
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
        records = []
        for t in range(steps):
            step(*keras_perceptron.batch(hvd.rank(), t))
            params = np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables])
            records.append(
                {"params": params, "bytes": optimizer.compression_stats()["bytes_handed"]}
            )
        results.append(
            {
                "codec": codec,
                "exchange": exchange,
                "records": records,
                "expected_bytes": optimizer._hvdc_pipeline.expected_bytes(),
                "tensors": optimizer.compression_stats()["tensors"],
            }
        )
    return _placement(hvd, "keras", results)


def _placement(hvd, framework, runs):
    return {
        "framework": framework,
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
    with open(os.path.join(out, f"rank{result['rank']}.pkl"), "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
