"""What every kernel module shares: numba's jit with the project's options, the pieces and
chunks the loops work in, the cache-line prefetch, and the scale as the decodes apply it.
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


def jit(function=None, **options):
    # nogil: Horovod's background thread and the other ranks' collectives go on during a
    # kernel. cache: compiled once per machine, not in every worker process.
    if function is None:
        return lambda f: jit(f, **options)
    return numba.njit(nogil=True, cache=True, **options)(function)


# Loops that compute more per element than a copy does (the quantizers' draws and levels,
# the scales' float64 sums) fall behind the memory when their array is not in the cache: the
# hardware prefetcher runs only a little ahead of the loads such a loop issues, and left to
# it each pass waits on memory about as long as it computes. They run a piece at a time and,
# before each, ask for the cache lines a fixed distance ahead of it: a piece's worth at a
# time, since the core keeps only so many misses in flight, and a loop that asked for a
# whole chunk's lines at once waited for them as long as for the data. Loops that move more
# bytes than they compute on (the compensation, the decoding) are bounded by the memory's
# bandwidth, which asking earlier does not raise: they do not.
SUM_PIECE = 1024  # elements of a sum's piece, and how far ahead of it lines are asked for


CODE_PIECE = 512  # elements of an encoding's piece (how far ahead: ``quantized``)


_LINE = 64  # bytes


@intrinsic
def _prefetch_line(typingctx, array, index):
    """LLVM's prefetch of the cache line that holds array[index], for reading, into every
    level of the cache; a hint that changes no result."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        word = ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte], ir.FunctionType(ir.VoidType(), [byte, word, word, word])
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte)
        # Read (0), locality 3 (keep in every level), data (1).
        builder.call(prefetch, [address] + [ir.Constant(word, k) for k in (0, 3, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@jit(inline="always")
def prefetch_ahead(array, start, stop, distance):
    """Asks for the cache lines of array[start + distance : stop + distance]: called for
    each piece start .. stop - 1 that a loop is about to work on, it keeps the lines
    ``distance`` elements ahead of the loop in flight."""
    step = max(_LINE // array.itemsize, 1)
    for i in range(start + distance, min(stop + distance, array.size), step):
        _prefetch_line(array, i)


@jit(inline="always")
def decoded_scale(scale):
    """A scale as the eager decodes apply it: NaN for a non-finite one (+inf flags a
    non-finite gradient), so that every decoded element is NaN."""
    return scale if np.isfinite(scale) else np.float32(np.nan)


# Sums of several rows' codes are decoded a chunk of elements at a time: a chunk's codes or
# sums wait in a buffer small enough to stay in the cache, and each loop over it is alone in
# a function, as above. Chunks start on byte boundaries.
CHUNK = 4096
