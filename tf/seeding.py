"""``hvd_compress.seeding`` in TensorFlow ops: the stream seeds of a step that may be a
tensor, and their uniform draws, the same numbers as the numpy reference and the PyTorch
port draw.

int64 tensors hold the words: sums and products wrap modulo 2^64 (on CPU, GPU and in XLA),
and a logical right shift is the arithmetic one masked to the bits that remain.
"""

import tensorflow as tf

from hvd_compress.seeding import _LOWBIAS32, _MASK, _MASK32, _splitmix64

_SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _int64(word):
    """The int64 of the same 64 bits as the unsigned ``word``."""
    return word - (1 << 64) if word >= 1 << 63 else word


def _right_shift(x, bits):
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, bits), (1 << (64 - bits)) - 1)


def _xor_shift(x, bits):
    return tf.bitwise.bitwise_xor(x, _right_shift(x, bits))


def _splitmix64_tf(x):
    gamma, first, second = (_int64(c) for c in _SPLITMIX64)
    x = _xor_shift(x + gamma, 30) * first
    x = _xor_shift(x, 27) * second
    return _xor_shift(x, 31)


def stream_seed(seed: int, rank: int, step, index: int) -> tf.Tensor:
    """``hvd_compress.seeding.stream_seed`` with ``step`` an int64 tensor (or an int)."""
    return _stream_seed(seed, rank, tf.cast(step, tf.int64), index)


# Compiled by XLA: one launch on a GPU, where its two rounds of splitmix64 are some twenty
# int64 ops.
@tf.function(jit_compile=True, autograph=False)
def _stream_seed(seed, rank, step, index):
    x = tf.constant(_int64(_splitmix64((seed ^ rank) & _MASK)), tf.int64)
    x = _splitmix64_tf(tf.bitwise.bitwise_xor(x, step))
    x = _splitmix64_tf(tf.bitwise.bitwise_xor(x, index))
    return _right_shift(x, 1)


def _lowbias32(x):
    x = _xor_shift(x, 16)
    x = tf.bitwise.bitwise_and(x * _LOWBIAS32[0], _MASK32)
    x = _xor_shift(x, 15)
    x = tf.bitwise.bitwise_and(x * _LOWBIAS32[1], _MASK32)
    return _xor_shift(x, 16)


# Compiled by XLA: as one loop, where a graph's twenty-odd int64 ops each make a pass over
# memory (65 against 920 ms for 25M draws on one CPU thread; Philox took 110).
@tf.function(jit_compile=True)
def uniforms(key: tf.Tensor, numel: int) -> tf.Tensor:
    """Draws 0 .. numel - 1 of the stream ``key`` (an int64 tensor), float32."""
    lo = tf.bitwise.bitwise_and(key, _MASK32)
    multiplier = tf.bitwise.bitwise_and(_right_shift(key, 32) * 2 + 1, _MASK32)
    x = _lowbias32(
        tf.bitwise.bitwise_and(tf.range(numel, dtype=tf.int64) * multiplier + lo, _MASK32)
    )
    return tf.cast(tf.bitwise.right_shift(x, 8), tf.float32) * 2.0**-24
