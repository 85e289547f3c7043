"""The model of the TensorFlow tape tests: a 3-layer perceptron of plain variables trained by
``DistributedGradientTape`` on random data of each rank. Runs inside Horovod child processes
only (it imports TensorFlow when called; see ``test_tf_codecs``)."""

import numpy as np

SHAPES = {
    "hidden/kernel": (64, 160),
    "hidden/bias": (160,),
    "middle/kernel": (160, 12),
    "middle/bias": (12,),
    "out/kernel": (12, 10),
    "out/bias": (10,),
}
LR = 0.1


def tape_steps(steps, traced, uncompressed=(), **tape_options):
    """Trains for ``steps`` steps (inside ``tf.function`` if ``traced``) with
    ``DistributedGradientTape(tape, uncompressed=..., **tape_options)``, ``uncompressed``
    naming keys of ``SHAPES``; yields after each step the local and the exchanged gradients
    (in the order of ``SHAPES``), the variables and the tape's ``CompressionPipeline``."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf.pipeline import variable_name

    init = np.random.default_rng(hvd.rank())  # different on every rank until broadcast
    variables = [
        tf.Variable(init.standard_normal(shape).astype(np.float32) * 0.3, name=name)
        for name, shape in SHAPES.items()
    ]
    hvd.broadcast_variables(variables, root_rank=0)
    skipped = [variable_name(v) for v, key in zip(variables, SHAPES) if key in uncompressed]

    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            h = tf.nn.relu(x @ variables[0] + variables[1])
            h = tf.nn.relu(h @ variables[2] + variables[3])
            logits = h @ variables[4] + variables[5]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        local = tape.gradient(loss, variables)
        distributed = htf.DistributedGradientTape(tape, uncompressed=skipped, **tape_options)
        exchanged = distributed.gradient(loss, variables)
        for v, g in zip(variables, exchanged):
            v.assign_sub(LR * g)
        return local, exchanged

    step = tf.function(step) if traced else step
    data = np.random.default_rng(100 + hvd.rank())
    for _ in range(steps):
        x = data.standard_normal((8, 64)).astype(np.float32)
        y = data.integers(0, 10, 8).astype(np.int32)
        local, exchanged = step(tf.constant(x), tf.constant(y))
        pipeline = htf.tape._PIPELINES[
            next(k for k in htf.tape._PIPELINES if k[0][0] == id(variables[0]))
        ][1]
        yield local, exchanged, variables, pipeline
