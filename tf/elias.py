"""Elias omega coding in TensorFlow ops; mirrors ``hvd_compress.elias`` (format and method are
documented there). Runs on any device, eagerly and inside ``tf.function``: only shifts,
prefix sums, searches and gathers, with no shape known before the codes are seen."""

import tensorflow as tf

from hvd_compress.elias import CHUNK, MAX_DEPTH


def _bit_length(values):
    """Bit length of positive int64 values below 2^53, from the float64 exponent bits."""
    bits = tf.bitcast(tf.cast(values, tf.float64), tf.int64)
    return tf.bitwise.right_shift(bits, 52) - 1022


def omega_codes(values):
    values = tf.cast(values, tf.int64)
    tf.debugging.assert_greater_equal(
        values, tf.constant(1, tf.int64), message="Elias omega codes integers in [1, 2^32)"
    )
    tf.debugging.assert_less(
        values, tf.constant(2**32, tf.int64), message="Elias omega codes integers in [1, 2^32)"
    )
    groups = [values]
    for _ in range(MAX_DEPTH - 1):
        groups.append(tf.maximum(_bit_length(groups[-1]) - 1, 1))
    code = tf.zeros_like(values)
    length = tf.zeros_like(values)
    for group in reversed(groups):
        width = tf.where(group > 1, _bit_length(group), 0)
        code = tf.where(
            group > 1, tf.bitwise.bitwise_or(tf.bitwise.left_shift(code, width), group), code
        )
        length += width
    return tf.bitwise.left_shift(code, 1), length + 1


def _packbits(bits):
    padded = tf.pad(bits, [[0, -tf.size(bits) % 8]])
    shifts = tf.range(7, -1, -1, dtype=tf.int64)
    return tf.cast(
        tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(padded, [-1, 8]), shifts), axis=1), tf.uint8
    )


def encode(codes):
    codes = tf.reshape(codes, [-1])
    where = tf.where(codes != 0)[:, 0]
    nonzero = tf.gather(codes, where)
    gap_code, gap_len = omega_codes(where - tf.concat([[-1], where[:-1]], axis=0))
    level_code, level_len = omega_codes(tf.abs(tf.cast(nonzero, tf.int64)))
    sign = tf.cast(nonzero < 0, tf.int64)
    symbols = tf.reshape(tf.stack([gap_code, sign, level_code], axis=1), [-1])
    lengths = tf.reshape(tf.stack([gap_len, tf.ones_like(sign), level_len], axis=1), [-1])
    ends = tf.cumsum(lengths)
    starts = ends - lengths
    # Each output bit finds its symbol by a search of the symbols' ends (no scatter, so no
    # loop over bit positions within the symbols).
    position = tf.range(tf.reduce_sum(lengths), dtype=tf.int64)
    owner = tf.searchsorted(ends, position, side="right", out_type=tf.int64)
    shift = tf.gather(lengths, owner) - 1 - (position - tf.gather(starts, owner))
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.gather(symbols, owner), shift), 1)
    offsets = starts[3 * CHUNK :: 3 * CHUNK]
    header = tf.cast(tf.concat([[tf.size(where, out_type=tf.int64)], offsets], axis=0), tf.int32)
    return tf.concat([tf.reshape(tf.bitcast(header, tf.uint8), [-1]), _packbits(bits)], axis=0)


def _windows(stream):
    """The 40 bits from each byte of ``stream`` on (``stream`` ends with 5 zero bytes)."""
    length = tf.size(stream) - 4
    window = tf.zeros([length], tf.int64)
    for j in range(5):
        window = tf.bitwise.bitwise_or(tf.bitwise.left_shift(window, 8), stream[j : j + length])
    return window


def _bits(windows, position, width):
    """``width`` (<= 32) bits at ``position``, from the window of the byte holding it."""
    # Cursors of chunks that have run out of records may walk past the end: they read the
    # zero padding, and their results are dropped.
    byte = tf.minimum(tf.bitwise.right_shift(position, 3), tf.size(windows, out_type=tf.int64) - 1)
    shift = 40 - tf.bitwise.bitwise_and(position, 7) - width
    mask = tf.bitwise.left_shift(tf.ones_like(width), width) - 1
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.gather(windows, byte), shift), mask)


def _omega(windows, position):
    # All MAX_DEPTH rounds always run (a graph cannot stop early); a value whose next bit is
    # 0 is complete and stays as it is.
    value = tf.ones_like(position)
    for _ in range(MAX_DEPTH):
        more = _bits(windows, position, tf.ones_like(position)) == 1
        width = tf.minimum(value + 1, 32)
        value = tf.where(more, _bits(windows, position, width), value)
        position = tf.where(more, position + width, position)
    return value, position + 1


@tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)])
def _records(windows, cursor):
    """(gap, sign, level) of record i of every chunk, for i < CHUNK: [CHUNK, 3, chunks].

    A ``tf.function`` with a fixed signature, traced once per process: run eagerly, the
    CHUNK sequential steps would cost tens of thousands of separate op dispatches."""

    def record(i, cursor, records):
        gap, cursor = _omega(windows, cursor)
        sign = _bits(windows, cursor, tf.ones_like(cursor))
        level, cursor = _omega(windows, cursor + 1)
        return i + 1, cursor, records.write(i, tf.stack([gap, sign, level]))

    records = tf.TensorArray(tf.int64, size=CHUNK, element_shape=tf.TensorShape([3, None]))
    _, _, records = tf.while_loop(lambda i, *_: i < CHUNK, record, (0, cursor, records))
    return records.stack()


def decode(data, numel):
    count = tf.cast(tf.bitcast(data[:4], tf.int32), tf.int64)
    chunks = -(-count // CHUNK)
    header = 4 * chunks
    offsets = tf.cast(tf.bitcast(tf.reshape(data[4:header], [-1, 4]), tf.int32), tf.int64)
    cursor = tf.concat([[0], offsets], axis=0)
    stream = tf.cast(tf.concat([data[header:], tf.zeros(5, tf.uint8)], axis=0), tf.int64)
    records = _records(_windows(stream), cursor)
    # [record, symbol, chunk] -> [symbol, chunk * CHUNK + record]
    gap, sign, level = tf.unstack(tf.reshape(tf.transpose(records, [1, 2, 0]), [3, -1])[:, :count])
    where = tf.cumsum(gap) - 1
    values = tf.cast(tf.where(sign == 1, -level, level), tf.int32)
    return tf.scatter_nd(where[:, None], values, [numel])
