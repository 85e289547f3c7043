"""PowerSGD in the TensorFlow port: the numpy reference in a real Horovod job, the bytes of
the PyTorch port, and its state resumed bitwise from a ``tf.train.Checkpoint``."""

import os
import tempfile

import numpy as np
import pytest

import hvd_compress

from .harness import run_parallel
from .powersgd_reference import (
    RANK,
    SHAPES,
    START_ITER,
    STEPS,
    gradient,
    matrix,
    reference_averages,
)

# ``powersgd_reference.SHAPES`` in Keras's layouts (out-features last), in the same order.
TF_SHAPES = {
    "conv/kernel": (3, 3, 3, 6),
    "dense/kernel": (24, 10),
    "dense/bias": (10,),
    "thin/kernel": (2, 40),
    "square/kernel": (16, 16),
}


def _reference_codec():
    codec = hvd_compress.PowerSGD(RANK, start_iter=START_ITER)
    codec.out_features_first = False  # Keras's layout
    return codec


def _steps(steps):
    """Our pipeline's averages of ``steps`` steps in a ``tf.function``, and a resume of the
    last three from a checkpoint taken before them."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tf as hc
    from hvd_compress.tf.pipeline import CompressionPipeline

    hvd.init()
    codec = hc.PowerSGD(rank=RANK, start_iter=START_ITER)
    variables = [(name, tf.Variable(tf.zeros(shape))) for name, shape in TF_SHAPES.items()]

    def pipeline():
        return CompressionPipeline(variables, codec, error_feedback=True)

    def grads(step):
        return [
            tf.constant(gradient(step, hvd.rank(), i, shape, matrix(codec, shape)))
            for i, shape in enumerate(TF_SHAPES.values())
        ]

    ours = pipeline()
    reduce = tf.function(ours.reduce)
    averages = [[g.numpy() for g in reduce(grads(step))] for step in range(steps - 3)]
    checkpoint = tf.train.Checkpoint(pipeline=ours).write(os.path.join(tempfile.mkdtemp(), "c"))
    averages += [[g.numpy() for g in reduce(grads(step))] for step in range(steps - 3, steps)]
    resumed = pipeline()
    tf.train.Checkpoint(pipeline=resumed).read(checkpoint).assert_consumed()
    reduce = tf.function(resumed.reduce)
    again = [[g.numpy() for g in reduce(grads(step))] for step in range(steps - 3, steps)]
    return averages, again, ours.compression_stats()


@pytest.mark.multiprocess
def test_matches_the_reference_with_the_bytes_of_the_pytorch_port():
    ranks = run_parallel(_steps, 2, STEPS)
    averages, again, stats = ranks[0]
    for mine, others in zip(averages, ranks[1][0]):
        for a, b in zip(mine, others):
            np.testing.assert_array_equal(a, b)  # every rank holds the same average
    for mine, resumed in zip(averages[-3:], again):
        for a, b in zip(mine, resumed):
            np.testing.assert_array_equal(a, b)
    reference = reference_averages(_reference_codec(), TF_SHAPES, STEPS, 2)
    for step, (mine, want) in enumerate(zip(averages, reference)):
        for name, a in zip(TF_SHAPES, mine):
            # As in ``test_powersgd``: float32 rounding of a few units in the last place.
            assert np.abs(a - want[name]).max() <= 2e-6 * np.abs(want[name]).max(), (step, name)
    # The same matrices transposed: the PyTorch port's routes and bytes.
    reasons = [(route, reason) for _, _, route, reason in stats["tensors"]]
    assert [reason for _, reason in reasons] == [
        "compressed",
        "compressed",
        "rank 1 saves < 2x",
        "rank 2 saves < 2x",
        "compressed",
    ]
    assert len(TF_SHAPES) == len(SHAPES)
    assert stats["bytes_handed"] == 4 * 2 * ((6 + 27) + (10 + 24) + (16 + 16)) + 4 * (10 + 80)
