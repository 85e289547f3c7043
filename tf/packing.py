"""TensorFlow packing of codes; mirrors ``hvd_compress.packing`` (wire formats: ``codes.py``).

Only shifts, masks and sums of integer tensors: the same code runs on CPU and GPU, eagerly
and inside ``tf.function``. The number of codes per row (the last axis) may be known only at
run time (a sparse codec's selection inside a ``tf.function``).
"""

import tensorflow as tf

from hvd_compress.codes import WIDTHS, FieldCodes, FloatCodes, IntCodes, SignCodes


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes``, ``SignCodes`` and
    ``FieldCodes``, float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return tf.cast(codes, space.dtype)
    if isinstance(space, FieldCodes):
        return _pack_unsigned(tf.cast(codes, tf.int64), space.width, pad=0)
    if isinstance(space, SignCodes):
        return _pack_unsigned(tf.cast(codes < 0, tf.int64), 1, pad=0)
    return _pack_unsigned(tf.cast(codes, tf.int64) + space.bound, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row (``int32``, ``int64`` for
    ``FieldCodes``, float16 for ``FloatCodes``); ``numel`` may be an int32 tensor."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    if isinstance(space, FieldCodes):
        return _unpack_unsigned(packed, space.width, numel)
    if isinstance(space, SignCodes):
        return tf.cast(1 - 2 * _unpack_unsigned(packed, 1, numel), tf.int32)
    return tf.cast(_unpack_unsigned(packed, space.width, numel) - space.bound, tf.int32)


def _rows(tensor, like, last):
    """``tensor`` reshaped to the leading axes of ``like`` (all but its last) and ``last``."""
    return tf.reshape(tensor, tf.concat([tf.shape(like)[:-1], last], axis=0))


def _length(tensor):
    """The length of the last axis: a Python int if it is static, else a tensor."""
    return tensor.shape[-1] if tensor.shape[-1] is not None else tf.shape(tensor)[-1]


def _pack_unsigned(unsigned, width, pad):
    if width not in WIDTHS:
        return _pack_bits(unsigned, width)
    if width >= 8:
        shifts = tf.range(0, width, 8, dtype=tf.int64)
        fields = tf.bitwise.bitwise_and(tf.bitwise.right_shift(unsigned[..., None], shifts), 0xFF)
        return tf.cast(_rows(fields, unsigned, [-1]), tf.uint8)
    per_byte = 8 // width
    paddings = [[0, 0]] * (unsigned.shape.rank - 1) + [[0, -_length(unsigned) % per_byte]]
    unsigned = tf.pad(unsigned, paddings, constant_values=pad)
    groups = _rows(unsigned, unsigned, [-1, per_byte])
    shifts = tf.range(per_byte, dtype=tf.int64) * width
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(groups, shifts), axis=-1), tf.uint8)


def _unpack_unsigned(packed, width, numel):
    if width not in WIDTHS:
        return _unpack_bits(packed, width, numel)
    packed = tf.cast(packed, tf.int64)
    if width >= 8:
        fields = _rows(packed, packed, [-1, width // 8])
        shifts = tf.range(0, width, 8, dtype=tf.int64)
        unsigned = tf.reduce_sum(tf.bitwise.left_shift(fields, shifts), axis=-1)
    else:
        shifts = tf.range(8 // width, dtype=tf.int64) * width
        fields = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(packed[..., None], shifts), (1 << width) - 1
        )
        unsigned = _rows(fields, packed, [-1])
    return unsigned[..., :numel]


def _pack_bits(unsigned, width):
    """Fields of any width as one little-endian bit stream per row (``codes.FieldCodes``):
    each field's bits, lowest first, packed as fields of one bit."""
    bits = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(unsigned[..., None], tf.range(width, dtype=tf.int64)), 1
    )
    return _pack_unsigned(_rows(bits, unsigned, [-1]), 1, pad=0)


def _unpack_bits(packed, width, numel):
    bits = _unpack_unsigned(packed, 1, numel * width)
    fields = _rows(bits, bits, [numel, width])
    return tf.reduce_sum(tf.bitwise.left_shift(fields, tf.range(width, dtype=tf.int64)), axis=-1)


__all__ = ["pack", "unpack", "FieldCodes", "IntCodes", "FloatCodes", "SignCodes"]
