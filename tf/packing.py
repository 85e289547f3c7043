"""TensorFlow packing of codes; mirrors ``hvd_compress.packing`` (wire formats: ``codes.py``).

Only casts, shifts and masks of integer tensors: the same code runs on CPU and GPU, eagerly
and inside ``tf.function``. The number of codes per row (the last axis) may be known only at
run time (a sparse codec's selection inside a ``tf.function``).

Codes are packed in the narrowest unsigned type that holds a field (uint8 for fields of up
to 8 bits), never in int64 or int32: eight or four times less memory traffic than int64,
and TensorFlow keeps the arithmetic of int32 tensors on the host even beside a GPU, while
the other integer types stay on the device. A field of b bits is the code plus the bound,
taken modulo 2^b: casting the signed code to the b-bit signed type and reinterpreting its
bits as unsigned gives it exactly, without a wider intermediate.
"""

import tensorflow as tf

from hvd_compress.codes import WIDTHS, FieldCodes, FloatCodes, SignCodes

# The signed and unsigned types of fields of up to 8, 16, 32 and 64 bits.
_TYPES = ((8, tf.int8, tf.uint8), (16, tf.int16, tf.uint16), (32, tf.int32, tf.uint32))


def _types(width):
    """(signed, unsigned) types of the narrowest size that holds ``width`` bits."""
    return next((signed, unsigned) for bits, signed, unsigned in _TYPES if width <= bits)


def pack(codes, space):
    """Packs codes along the last axis: ``uint8`` rows for ``IntCodes``, ``SignCodes`` and
    ``FieldCodes``, float16 for ``FloatCodes``."""
    if isinstance(space, FloatCodes):
        return tf.cast(codes, space.dtype)
    if isinstance(space, FieldCodes):
        return _pack_unsigned(tf.cast(codes, _types(space.width)[1]), space.width, pad=0)
    if isinstance(space, SignCodes):
        return _pack_unsigned(tf.cast(codes < 0, tf.uint8), 1, pad=0)
    signed, unsigned = _types(space.width)
    fields = tf.bitcast(tf.cast(codes, signed), unsigned) + tf.cast(space.bound, unsigned)
    return _pack_unsigned(fields, space.width, pad=space.bound)


def unpack(packed, space, numel):
    """Inverse of ``pack``: the first ``numel`` codes of each row (``int32``, ``int64`` for
    ``FieldCodes``, float16 for ``FloatCodes``); ``numel`` may be an int32 tensor."""
    if isinstance(space, FloatCodes):
        return packed[..., :numel]
    if isinstance(space, FieldCodes):
        return tf.cast(_unpack_unsigned(packed, space.width, numel), tf.int64)
    if isinstance(space, SignCodes):
        # 1 - 2 bit: bit 0 is +1, bit 1 is -1 (255 as int8's bits).
        signs = tf.constant(1, tf.uint8) - tf.bitwise.left_shift(
            _unpack_unsigned(packed, 1, numel), tf.constant(1, tf.uint8)
        )
        return tf.cast(tf.bitcast(signs, tf.int8), tf.int32)
    signed, unsigned = _types(space.width)
    fields = _unpack_unsigned(packed, space.width, numel) - tf.cast(space.bound, unsigned)
    return tf.cast(tf.bitcast(fields, signed), tf.int32)


def _rows(tensor, like, last):
    """``tensor`` reshaped to the leading axes of ``like`` (all but its last) and ``last``."""
    return tf.reshape(tensor, tf.concat([tf.shape(like)[:-1], last], axis=0))


def _length(tensor):
    """The length of the last axis: a Python int if it is static, else a tensor."""
    return tensor.shape[-1] if tensor.shape[-1] is not None else tf.shape(tensor)[-1]


def _joined(parts, width):
    """The bitwise or of ``parts[k] << (k * width)``: fields side by side in one integer.
    Fields are disjoint, so no sum (which has no GPU kernel for unsigned types) is needed."""
    joined = parts[0]
    for k, part in enumerate(parts[1:], 1):
        joined = tf.bitwise.bitwise_or(
            joined, tf.bitwise.left_shift(part, tf.constant(k * width, part.dtype))
        )
    return joined


def _pack_unsigned(unsigned, width, pad):
    """Fields of ``width`` bits (``unsigned``, of ``_types(width)``'s unsigned type), packed
    little-endian into bytes along the last axis."""
    if width not in WIDTHS:
        return _pack_bits(unsigned, width)
    if width >= 8:
        dtype = unsigned.dtype
        fields = [
            tf.cast(
                tf.bitwise.bitwise_and(
                    tf.bitwise.right_shift(unsigned, tf.constant(shift, dtype)),
                    tf.constant(0xFF, dtype),
                ),
                tf.uint8,
            )
            for shift in range(0, width, 8)
        ]
        return _rows(tf.stack(fields, axis=-1), unsigned, [-1])
    per_byte = 8 // width
    paddings = [[0, 0]] * (unsigned.shape.rank - 1) + [[0, -_length(unsigned) % per_byte]]
    unsigned = tf.pad(unsigned, paddings, constant_values=pad)
    groups = _rows(unsigned, unsigned, [-1, per_byte])
    return _joined([groups[..., k] for k in range(per_byte)], width)


def _unpack_unsigned(packed, width, numel):
    """The first ``numel`` fields of ``width`` bits of each row of bytes, in the unsigned
    type of ``_types(width)``."""
    if width not in WIDTHS:
        return _unpack_bits(packed, width, numel)
    if width >= 8:
        unsigned = _types(width)[1]
        fields = tf.cast(_rows(packed, packed, [-1, width // 8]), unsigned)
        joined = _joined([fields[..., k] for k in range(width // 8)], 8)
    else:
        mask = tf.constant((1 << width) - 1, tf.uint8)
        fields = [
            tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(packed, tf.constant(shift, tf.uint8)), mask
            )
            for shift in range(0, 8, width)
        ]
        joined = _rows(tf.stack(fields, axis=-1), packed, [-1])
    return joined[..., :numel]


def _pack_bits(unsigned, width):
    """Fields of any width as one little-endian bit stream per row (``codes.FieldCodes``):
    each field's bits, lowest first, packed as fields of one bit."""
    one = tf.constant(1, unsigned.dtype)
    bits = [
        tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(unsigned, tf.constant(k, unsigned.dtype)), one
        )
        for k in range(width)
    ]
    return _pack_unsigned(
        tf.cast(_rows(tf.stack(bits, axis=-1), unsigned, [-1]), tf.uint8), 1, pad=0
    )


def _unpack_bits(packed, width, numel):
    bits = _unpack_unsigned(packed, 1, numel * width)
    fields = tf.cast(_rows(bits, bits, [numel, width]), _types(width)[1])
    return _joined([fields[..., k] for k in range(width)], 1)


def float_rows(rows):
    """Rows of raw float32 bytes as float32 rows."""
    return tf.bitcast(tf.reshape(rows, [tf.shape(rows)[0], -1, 4]), tf.float32)


def sum_rows(rows):
    """The sum of the rows of code values (int32) or floats (float32)."""
    accumulate = tf.float32 if rows.dtype.is_floating else tf.int32
    return tf.reduce_sum(tf.cast(rows, accumulate), axis=0)
