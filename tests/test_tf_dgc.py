"""DGC in the TensorFlow port: the numpy reference at N = 4 through the Keras
wrapper's worker momentum (in the form it chooses), the bytes of the PyTorch port, and the
warm-up's k in a graph."""

import numpy as np
import pytest

import hvd_compress

from .dgc_reference import CODEC, LR, MU, SHAPES, STEPS, gradient, reference_averages
from .harness import run_parallel


def _train():
    """Each step's averaged gradients of ``gradient`` through the Keras wrapper (heavy-ball
    SGD: worker momentum on, in Nesterov's form, as by default), in a ``tf.function``."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import hvd_compress.tf as hc

    hvd.init()
    variables = [keras.Variable(np.zeros(shape, np.float32), name=n) for n, shape in SHAPES.items()]
    optimizer = hc.DistributedOptimizer(
        keras.optimizers.SGD(LR, momentum=MU), compression=hc.DGC(**CODEC)
    )
    optimizer.build(variables)
    exchange = tf.function(lambda grads: optimizer._hvdc_exchange(grads, variables))
    averages = []
    for step in range(STEPS):
        grads = [
            tf.constant(gradient(step, hvd.rank(), i, s)) for i, s in enumerate(SHAPES.values())
        ]
        averages.append([g.numpy() for g in exchange(grads)])
    return averages, optimizer.compression_stats()["bytes_handed"]


@pytest.mark.multiprocess
def test_matches_the_reference_with_the_bytes_of_the_pytorch_port():
    # N = 4 only: the PyTorch port's test runs N = 2 and 4 on the same reference.
    world_size = 4
    ranks = run_parallel(_train, world_size)
    codec = hvd_compress.DGC(**CODEC)
    reference = list(reference_averages(codec, SHAPES, STEPS, world_size, MU, nesterov=True))
    for averages, handed in ranks:
        for mine, want in zip(averages, reference):
            for name, a in zip(SHAPES, mine):
                np.testing.assert_array_equal(a != 0, want[name] != 0, err_msg=name)
                np.testing.assert_allclose(a, want[name], rtol=1e-5, atol=1e-6)
        # The last step: k int32 indices and k float32 values per compressed tensor, the
        # bias whole (what the PyTorch port hands over, tests/test_dgc.py).
        k = codec.k(160, STEPS - 1) + codec.k(2400, STEPS - 1)
        assert handed == 8 * k + 4 * 40
    for other in ranks[1:]:
        for a, b in zip(ranks[0][0], other[0]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)  # bitwise on every rank


def test_warmup_k_in_a_graph_equals_the_reference():
    import tensorflow as tf

    import hvd_compress.tf as hc

    port, reference = hc.DGC(density=0.003, warmup_steps=8), hvd_compress.DGC(0.003, 8)
    k = tf.function(lambda step: port.k(2401, step))
    for step in range(12):
        assert int(k(tf.constant(step, tf.int64))) == reference.k(2401, step)
