"""The receiving side of the fixed-width exchanges in TensorFlow ops: what a worker computes
from the codes it received. The exchanges (``exchange``) run these ops as they are;
``xla_fused`` compiles the same functions for the device path, so that each is defined once
and the compiled calls cannot drift from the ops they stand for."""

import tensorflow as tf

from .packing import pack, sum_rows, unpack


def decoded_totals(codec, total: tf.Tensor, scale: tf.Tensor, count) -> tf.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total`` (an integer carrier is
    decoded from int32, the type ``codec.decode`` takes for integer values)."""
    if not total.dtype.is_floating:
        total = tf.cast(total, tf.int32)
    return codec.decode(total, scale, count)


def summed_codes(codec, rows: tf.Tensor, length: int, total_space) -> tf.Tensor:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of every
    row, summed over the rows and packed in ``total_space``."""
    return pack(sum_rows(codec.values(unpack(rows, codec.code_space, length))), total_space)


def decoded_sums(codec, rows: tf.Tensor, scale: tf.Tensor, count, numel: int) -> tf.Tensor:
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    return codec.decode(sum_rows(codec.values(unpack(rows, codec.code_space, numel))), scale, count)


def decoded_segments(
    codec, rows: tf.Tensor, total_space, length: int, scale: tf.Tensor, count, numel: int
) -> tf.Tensor:
    """The sharded exchange's ``codec.decode`` of the gathered partial sums: row r is
    elements r length .. (r + 1) length - 1, packed in ``total_space``."""
    total = tf.reshape(unpack(rows, total_space, length), [-1])[:numel]
    return codec.decode(
        tf.cast(total, tf.float32 if total.dtype.is_floating else tf.int32), scale, count
    )
