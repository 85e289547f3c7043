"""PowerSGD in TensorFlow ops; the algorithm and its reference are in
``hvd_compress.powersgd``."""

import tensorflow as tf

from hvd_compress import powersgd as reference

from .codec import Codec


class PowerSGD(reference.PowerSGD, Codec):
    __doc__ = reference.PowerSGD.__doc__

    # Keras kernels are (in, out) and (kh, kw, in, out): the matrix is (rest, shape[-1]).
    out_features_first = False

    @staticmethod
    def orthogonalize(matrix):
        columns = tf.unstack(matrix, axis=1)
        for i, column in enumerate(columns):
            norm = tf.norm(column)
            column = tf.where(norm > 0, column / norm, 0.0)
            columns[i] = column
            for j in range(i + 1, len(columns)):
                columns[j] -= tf.reduce_sum(column * columns[j]) * column
        return tf.stack(columns, axis=1)
