"""AdaComp in TensorFlow ops, and the layer kinds of a Keras model's variables; the algorithm,
its wire format and the numpy reference are in ``hvd_compress.adacomp``."""

import keras
import tensorflow as tf

from hvd_compress import adacomp as reference
from hvd_compress.buckets import count
from hvd_compress.codes import FieldCodes, SignCodes

from .buckets import expand, reduce
from .codec import Codec
from .packing import pack, unpack
from .pipeline import variable_name

# Layer classes whose variables form each layer kind; layers of other classes (norms, custom
# layers) hold "other" variables. Keras's recurrent layers keep their weights in a cell
# sublayer, so a layer of a listed class claims every variable it tracks, sublayers included
# (the outermost listed layer wins).
LAYER_KINDS = (
    (
        (
            keras.layers.Conv1D,
            keras.layers.Conv2D,
            keras.layers.Conv3D,
            keras.layers.Conv1DTranspose,
            keras.layers.Conv2DTranspose,
            keras.layers.Conv3DTranspose,
        ),
        "conv",
    ),
    ((keras.layers.Dense,), "linear"),
    (
        (
            keras.layers.GRU,
            keras.layers.LSTM,
            keras.layers.SimpleRNN,
            keras.layers.RNN,
            keras.layers.GRUCell,
            keras.layers.LSTMCell,
            keras.layers.SimpleRNNCell,
        ),
        "recurrent",
    ),
    ((keras.layers.Embedding,), "embedding"),
)


def layer_kinds(model):
    """{variable name: layer kind} from the layer that holds each trainable variable, with
    the names the wrappers give it (``pipeline.variable_name``, the Keras path)."""
    kinds = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        kind = next((kind for classes, kind in LAYER_KINDS if isinstance(layer, classes)), None)
        if kind is not None:
            for variable in layer.trainable_variables:
                kinds.setdefault(variable_name(variable), kind)
    return {
        variable_name(v): kinds.get(variable_name(v), "other") for v in model.trainable_variables
    }


class AdaComp(reference.AdaComp, Codec):
    __doc__ = reference.AdaComp.__doc__

    @classmethod
    def for_model(cls, model, **hyperparameters):
        """AdaComp with the layer kind of every variable of the Keras ``model`` taken from
        the layer that holds it: ``compression=htf.AdaComp.for_model(model)``."""
        return cls(layers=layer_kinds(model), **hyperparameters)

    def select(self, compensated, grad, bin_length):
        residue = tf.reshape(compensated, [-1])
        threshold = residue + tf.reshape(grad, [-1])
        bin_max = reduce(tf.abs(residue), bin_length, "max")
        return (tf.abs(threshold) >= expand(bin_max, residue.shape[0], bin_length)) & (residue != 0)

    def encode_message(self, compensated, selected, bin_length):
        residue = tf.reshape(compensated, [-1])
        positions = tf.where(selected)[:, 0]
        sent = tf.gather(residue, positions)
        magnitudes = tf.cast(tf.abs(sent), tf.float64)
        scale = tf.cast(
            tf.reduce_sum(magnitudes) / tf.cast(tf.maximum(tf.size(positions), 1), tf.float64),
            tf.float32,
        )
        scale = tf.where(tf.reduce_all(tf.math.is_finite(residue)), scale, float("nan"))
        fields = FieldCodes.holding(bin_length)
        counts = reduce(tf.cast(selected, tf.int64), bin_length, "sum")
        return tf.concat(
            [
                tf.reshape(tf.bitcast(scale, tf.uint8), [4]),
                pack(counts, fields),
                pack(positions % bin_length, fields),
                pack(sent, SignCodes()),
            ],
            axis=0,
        )

    def decode_message(self, message, numel, bin_length):
        fields = FieldCodes.holding(bin_length)
        bins = count(numel, bin_length)
        scale = tf.bitcast(tf.reshape(message[:4], [4]), tf.float32)
        start = 4 + fields.packed_nbytes(bins)
        counts = unpack(message[4:start], fields, bins)
        sent = tf.cast(tf.reduce_sum(counts), tf.int32)
        end = start + fields.packed_nbytes(sent)
        offsets = unpack(message[start:end], fields, sent)
        signs = unpack(message[end:], SignCodes(), sent)
        starts = tf.range(bins, dtype=tf.int64) * bin_length
        positions = tf.repeat(starts, counts) + offsets
        values = tf.scatter_nd(positions[:, None], tf.cast(signs, tf.float32) * scale, [numel])
        return tf.where(tf.math.is_finite(scale), values, float("nan"))
