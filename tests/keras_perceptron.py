"""The Keras model of the Keras optimizer's jobs: a named 3-layer perceptron, each rank's
batches, and a traced step that applies an optimizer. Runs inside Horovod child processes
only (it imports Keras when called; see ``test_tf_codecs``)."""

import numpy as np


def model(keras):
    # Named, so that every model built gets the same variable paths (a second one restores
    # the first's checkpoint).
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(160, activation="relu", name="hidden"),
            keras.layers.Dense(12, activation="relu", name="middle"),
            keras.layers.Dense(10, name="out"),
        ],
        name="net",
    )


def batch(rank, step):
    data = np.random.default_rng(1000 * step + rank)
    return (
        data.standard_normal((8, 64)).astype(np.float32),
        data.integers(0, 10, 8).astype(np.int32),
    )


def trainer(model, optimizer):
    """A traced step that applies ``optimizer`` and returns this rank's gradients."""
    import keras
    import tensorflow as tf

    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            )
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return grads

    return step
