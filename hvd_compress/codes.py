"""Code spaces: how one worker's codes, and the sum of several workers' codes, travel.

A code space is the single written-down wire format shared by the numpy reference and the
framework ports (``packing.py`` in each of them implements it):

``IntCodes(bound)``
    Signed integers in [-bound, bound]. On the wire each code is stored as the unsigned
    value ``code + bound`` in ``width`` bits, the narrowest of 1, 2, 4, 8, 16 or 32 bits that
    holds ``2 * bound + 1`` values. Widths below 8 bits are packed little-endian inside each
    byte: element ``i`` of a row sits in byte ``i // k`` at bit offset ``(i % k) * width``,
    with ``k = 8 // width`` codes per byte; a row is padded with the code for 0 to a whole
    byte. Widths of 16 and 32 bits are little-endian unsigned integers.
    The sum of ``count`` workers' codes is ``IntCodes(bound * count)``: summing is exact, and
    the wider space says how many bits the sum needs.

``SignCodes()``
    Signs -1 and +1, one bit each (1 for -1), packed like ``IntCodes`` of width 1.

``FieldCodes(width)``
    Unsigned integers in [0, 2^width), each in exactly ``width`` bits (1 to 32, any width):
    a little-endian bit stream, element ``i`` in bits ``i * width`` to ``(i + 1) * width - 1``
    of the row, bit ``j`` of the row in byte ``j // 8`` at bit ``j % 8``, padded with zero bits
    to a whole byte. For widths of 1, 2, 4, 8, 16 and 32 bits this is ``IntCodes``' layout of
    the unsigned values. Sparse messages (AdaComp's within-bin offsets) use it where a power
    of two would waste bits.

``FloatCodes(dtype)``
    Floating-point values of ``dtype`` (float16), sent as they are; a sum of several workers'
    values is rounded back to ``dtype`` before it is sent again.
"""

import functools
from dataclasses import dataclass

WIDTHS = (1, 2, 4, 8, 16, 32)


@functools.cache
def _width(bound):
    """The narrowest of ``WIDTHS`` that holds 2 bound + 1 values. Cached by bound: codecs
    make a new code space whenever asked for one, and every packing and decoding asks."""
    needed = (2 * bound).bit_length()
    return next(w for w in WIDTHS if w >= needed)


# Largest integer magnitude each allreduce carrier represents exactly.
EXACT_INTEGER_LIMIT = {
    "int8": 127,
    "float16": 2048,
    "int16": 32767,
    "float32": 2**24,
    "int32": 2**31 - 1,
    "int64": 2**63 - 1,
}
ITEMSIZE = {"int8": 1, "float16": 2, "int16": 2, "float32": 4, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class IntCodes:
    bound: int

    def __post_init__(self):
        if self.bound < 1:
            raise ValueError(f"IntCodes: bound must be >= 1, got {self.bound}")
        if 2 * self.bound + 1 > 2**32:
            raise OverflowError(f"IntCodes: {2 * self.bound + 1} code values do not fit in 32 bits")

    @property
    def width(self):
        """Bits per code on the wire."""
        return _width(self.bound)

    @property
    def codes_per_byte(self):
        """Codes sharing one byte (1 for widths of 8 bits and more)."""
        return max(1, 8 // self.width)

    def packed_nbytes(self, numel):
        """Bytes of one packed row of ``numel`` codes."""
        if self.width < 8:
            return -(-numel // self.codes_per_byte)
        return numel * self.width // 8

    def summed(self, count):
        """The code space of a sum of ``count`` workers' codes."""
        return IntCodes(self.bound * count)

    def allreduce_carrier(self, count, dtypes):
        """The narrowest of ``dtypes`` that sums ``count`` workers' codes without overflow."""
        total = self.bound * count
        exact = [d for d in dtypes if EXACT_INTEGER_LIMIT[d] >= total]
        if not exact:
            raise OverflowError(
                f"the sum of {count} workers' codes in [-{self.bound}, {self.bound}] does not "
                f"fit any allreduce carrier of {dtypes}"
            )
        return min(exact, key=lambda d: ITEMSIZE[d])


@dataclass(frozen=True)
class SignCodes:
    width = 1
    codes_per_byte = 8

    def packed_nbytes(self, numel):
        return -(-numel // 8)


@dataclass(frozen=True)
class FieldCodes:
    width: int

    def __post_init__(self):
        if not 1 <= self.width <= 32:
            raise ValueError(f"FieldCodes: width must be in [1, 32], got {self.width}")

    @classmethod
    def holding(cls, value):
        """The narrowest fields that hold every integer in [0, value]."""
        return cls(max(1, int(value).bit_length()))

    def packed_nbytes(self, numel):
        return -(-numel * self.width // 8)


@dataclass(frozen=True)
class FloatCodes:
    dtype: str = "float16"

    width = 16
    codes_per_byte = 1

    def packed_nbytes(self, numel):
        return numel * ITEMSIZE[self.dtype]

    def summed(self, count):
        return self

    def allreduce_carrier(self, count, dtypes):
        if self.dtype not in dtypes:
            raise ValueError(f"allreduce does not carry {self.dtype}; it carries {dtypes}")
        return self.dtype


def shard_length(numel, world_size, *spaces):
    """Elements per shard when ``numel`` codes are split across ``world_size`` ranks.

    Every shard starts on a byte boundary in each of ``spaces`` (the phase-1 codes and the
    phase-2 sums of the sharded exchange), so shards can be packed independently.
    """
    per_byte = max(space.codes_per_byte for space in spaces)
    length = -(-numel // world_size)
    return -(-length // per_byte) * per_byte
