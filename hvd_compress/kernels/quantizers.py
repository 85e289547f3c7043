"""TernGrad's and the QSGD family's encoding: their scales (shifted moments, bucket norms), the
counter-based draws, the levels, and the packed fixed-width codes.
"""

import numpy as np

from .base import CHUNK, CODE_PIECE, SUM_PIECE, decoded_scale, jit, prefetch_ahead

# error_model="numpy" on the kernels that divide: a division by zero gives inf or NaN as in
# numpy and torch, instead of a check for ZeroDivisionError in every iteration, which kept
# LLVM from vectorizing a loop whose divisor varies.


# max|g| is found as the max of the bits of |g| (those of g, ``bits``, read as int32, without
# the sign bit), which order as |g| does, NaN above inf: exact, and a reduction of integers
# that LLVM vectorizes, where the maximum of floats it does not.


# reassoc and contract: the sums' order and rounding are free (float64 sums of float32
# elements, as exact in any order as the float32 results need), and the vectorized loop
# with fused multiply-adds is a memory pass, not the adds' latency chain.
@jit(fastmath={"reassoc", "contract"})
def _shifted_moments_and_top(g, bits, shift):
    total, squares, top = 0.0, 0.0, np.int32(0)
    for i in range(g.size):
        d = np.float64(g[i]) - shift
        total += d
        squares += d * d
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return total, squares, top


@jit
def shifted_moments_and_top(g, bits):
    """TernGrad's one pass (``terngrad.shifted_variance``): the float64 sums of d and d^2
    for d = g - g[0], and the bits of max|g|."""
    shift = np.float64(g[0]) if g.size else 0.0
    total, squares, top = 0.0, 0.0, np.int32(0)
    for start in range(0, g.size, SUM_PIECE):
        stop = min(g.size, start + SUM_PIECE)
        prefetch_ahead(g, start, stop, SUM_PIECE)
        piece = _shifted_moments_and_top(g[start:stop], bits[start:stop], shift)
        total, squares, top = total + piece[0], squares + piece[1], max(top, piece[2])
    return total, squares, top


@jit(fastmath={"reassoc"})
def _squares(g):
    total = 0.0
    for i in range(g.size):
        total += np.float64(g[i]) * np.float64(g[i])
    return total


@jit
def _top(bits):
    top = np.int32(0)
    for i in range(bits.size):
        top = max(top, bits[i] & np.int32(0x7FFFFFFF))
    return top


@jit(inline="always")
def _bucket_squares(g, b, bucket):
    """The float64 sum of g^2 over bucket b, a piece at a time."""
    total = 0.0
    bucket_stop = min(g.size, (b + 1) * bucket)
    for start in range(b * bucket, bucket_stop, SUM_PIECE):
        stop = min(bucket_stop, start + SUM_PIECE)
        prefetch_ahead(g, start, stop, SUM_PIECE)
        total += _squares(g[start:stop])
    return total


@jit(inline="always")
def _bucket_top(bits, b, bucket):
    """The bits of max|g| over bucket b (``bits``: g's float32 bits), a piece at a time."""
    top = np.int32(0)
    bucket_stop = min(bits.size, (b + 1) * bucket)
    for start in range(b * bucket, bucket_stop, SUM_PIECE):
        stop = min(bucket_stop, start + SUM_PIECE)
        prefetch_ahead(bits, start, stop, SUM_PIECE)
        top = max(top, _top(bits[start:stop]))
    return top


@jit
def bucket_squares(g, bucket, sums):
    """QSGD's and NUQSGD's L2 norms, squared: sums[b] = float64 sum of g^2 over bucket b."""
    for b in range(sums.size):
        sums[b] = _bucket_squares(g, b, bucket)


@jit
def bucket_tops(bits, bucket, tops):
    """QSGD-inf's max norms: tops[b] = the bits of max|g| over bucket b."""
    for b in range(tops.size):
        tops[b] = _bucket_top(bits, b, bucket)


# The norms a ``quantized`` call computes itself, for scales that no collective shares.
GIVEN_SCALES, MAX_NORMS, L2_NORMS = 0, 1, 2


@jit(inline="always")
def _bucket_norm(p, bits, b, bucket, norm):
    """Bucket b's scale by ``norm``, as ``fused.local_scale`` gives it before its test of
    finiteness: max|p| (``bucket_tops``), or the L2 norm rounded from float64."""
    if norm == L2_NORMS:
        return np.float32(np.sqrt(_bucket_squares(p, b, bucket)))
    return np.int32(_bucket_top(bits, b, bucket)).view(np.float32)


# numba computes with uint32 words in int64: every result is cut back to 32 bits, which
# LLVM turns into 32-bit vector operations.


@jit(inline="always")
def _lowbias32(x):
    x = np.uint32(x ^ (x >> 16))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> 15))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> 16))


@jit(inline="always")
def _word(first, stream):
    """The word that draw ``first`` of ``stream`` = (lo, multiplier) (``seeding.key_words``)
    hashes: first multiplier + lo, modulo 2^32. Draw k + 1's is draw k's plus the
    multiplier: the loops step it so, with no product per draw."""
    lo, multiplier = stream
    return np.uint32(np.uint32(np.uint32(first) * multiplier) + lo)


@jit(inline="always")
def _uniform(word):
    """The draw of a ``_word``: ``seeding.uniforms``."""
    return np.float32(np.uint32(_lowbias32(word) >> 8)) * np.float32(2.0**-24)


@jit(inline="always")
def _divisor(scale):
    """The divisor S of a bucket's ratios |g| / S: its scale, or inf for a zero or
    non-finite scale (every ratio 0, as ``normalized``)."""
    return scale if np.isfinite(scale) and scale > 0 else np.float32(np.inf)


@jit(inline="always")
def _normalized(g, divisor):
    """|g| / S of the eager ``buckets.normalized_unclipped`` (``divisor``: S, or inf for a zero or
    non-finite S), with 0 for NaN as ``normalized``."""
    a = abs(g) / divisor
    return a if a == a else np.float32(0.0)


@jit(inline="always")
def _uniform_code(g, divisor, levels, u):
    """``UniformQuantizer.encode`` of one element under s = ``levels`` (float32)."""
    x = _normalized(g, divisor) * levels
    low = min(np.floor(x), levels - np.float32(1.0))
    level = np.int32(low + np.float32(u < x - low))
    return -level if g < 0 else level


@jit(inline="always")
def _one_level_code(g, divisor, u):
    """``_uniform_code`` under s = 1 (TernGrad, 2-bit QSGD): x is the ratio itself and
    min(floor(x), 0) is 0, so the level is the draw's test alone."""
    level = np.int32(u < _normalized(g, divisor))
    return -level if g < 0 else level


@jit(inline="always")
def _nuqsgd_code(g, divisor, s, u):
    """``NUQSGD.encode`` of one element with smallest level 2^-s: the index of the level
    below r (the frexp of the eager op), then drawn up to the level above it."""
    r = min(_normalized(g, divisor), np.float32(1.0))
    # The level below r >= 2^-s is 2^e, e the binary exponent of r, its index e + s + 1
    # (r = 1 is level s + 1 itself); below 2^-s it is 0, index 0. The gap to the next
    # level is 2^e (2^-s above 0), so r's place in it, (r - 2^e) / 2^e, is the fraction
    # of r's significand, read from its bits exactly; below 2^-s it is r 2^s, also exact.
    bits = np.float32(r).view(np.int32)
    biased = bits >> 23  # e + 127
    above = biased >= 127 - s
    index = biased - 126 + s if above else 0
    fraction = np.int32((bits & 0x7FFFFF) | 0x3F800000).view(np.float32) - np.float32(1.0)
    index += u < (fraction if above else r * _power(s))
    return -index if g < 0 else index


@jit(inline="always")
def _power(s):
    """2^s, float32."""
    return np.int32((127 + s) << 23).view(np.float32)


@jit(inline="always")
def nuqsgd_value(code):
    """``NUQSGD.values``: sign(code) 2^(|code| - 1), 0 for 0."""
    index = abs(code)
    value = (np.int32(1) << index) >> 1  # 0 for 0
    return -value if code < 0 else value


# The code loops write code + ``offset`` into ``out``: the packed exchanges' fields
# (``codes.IntCodes``: code + bound, one per byte of a uint8 ``out``, which costs a quarter
# of int32 codes' stores), or the codes themselves (int32, offset 0) for the allreduce's
# values. Element first + i hashes the 32-bit word of ``_word``, stepped beside i rather
# than computed from the 64-bit first + i: LLVM then keeps it in 32-bit vector lanes.


@jit(inline="always")
def _uniform_codes(p, divisor, levels, one_level, first, stream, offset, out):
    x = _word(first, stream)
    for i in range(p.size):
        u = _uniform(x)
        if one_level:
            out[i] = _one_level_code(p[i], divisor, u) + offset
        else:
            out[i] = _uniform_code(p[i], divisor, levels, u) + offset
        x = np.uint32(x + stream[1])


@jit(inline="always")
def _uniform_codes_with_feedback(
    p, divisor, levels, one_level, first, stream, scale, offset, out, residual
):
    x = _word(first, stream)
    for i in range(p.size):
        u = _uniform(x)
        if one_level:
            code = _one_level_code(p[i], divisor, u)
        else:
            code = _uniform_code(p[i], divisor, levels, u)
        out[i] = code + offset
        residual[i] = p[i] - np.float32(code) * scale / levels
        x = np.uint32(x + stream[1])


@jit(inline="always")
def _code_piece(position, stop, bucket):
    """(b, end): the bucket b of element ``position`` and the end of the encoding's piece
    that starts there, at the bucket's end, the next multiple of ``CODE_PIECE`` or
    ``stop``, whichever comes first."""
    b = position // bucket
    return b, min(stop, (b + 1) * bucket, (position // CODE_PIECE + 1) * CODE_PIECE)


@jit(inline="always", error_model="numpy")
def _uniform_buckets(p, start, stop, quantizer, one_level, feedback, offset, out, residual):
    """``_uniform_codes`` (with ``feedback``, ``_uniform_codes_with_feedback``) of elements
    start .. stop - 1 of ``p`` into ``out`` (from its element 0), bucket by bucket and
    ``CODE_PIECE`` by ``CODE_PIECE``, asking for the lines ``ahead`` elements on."""
    scale, bucket, levels, _, stream, ahead = quantizer
    s = np.float32(levels)
    position = start
    while position < stop:
        b, end = _code_piece(position, stop, bucket)
        prefetch_ahead(p, position, end, ahead)
        divisor = _divisor(scale[b])
        piece, into = p[position:end], out[position - start : end - start]
        if feedback:
            decoded = decoded_scale(scale[b])
            # Sliced here, where feedback is a constant: with the array chosen by a
            # condition inside this inlined loop, the element loop ran 4x slower.
            kept = residual[position:end]
            _uniform_codes_with_feedback(
                piece, divisor, s, one_level, position, stream, decoded, offset, into, kept
            )
        else:
            _uniform_codes(piece, divisor, s, one_level, position, stream, offset, into)
        position = end


@jit(inline="always")
def _nuqsgd_codes(p, divisor, s, first, stream, scale, offset, out, residual):
    # s is a constant where this is inlined, so LLVM unrolls the loop over levels and
    # vectorizes the loop over elements.
    x = _word(first, stream)
    for i in range(p.size):
        out[i] = _nuqsgd_code(p[i], divisor, s, _uniform(x)) + offset
        x = np.uint32(x + stream[1])
    # The residual from the codes, in a loop of its own over the chunk (in the loop above it
    # keeps LLVM from vectorizing); / 2^s as a product, which is exactly the same and cheaper.
    for i in range(residual.size):
        code = np.int32(out[i]) - offset
        residual[i] = p[i] - np.float32(nuqsgd_value(code)) * scale * np.float32(2.0**-s)


@jit(inline="always", error_model="numpy")
def _nuqsgd_buckets(p, start, stop, quantizer, s, offset, out, residual):
    """``_nuqsgd_codes`` with smallest level 2^-``s`` of elements start .. stop - 1 of ``p``
    into ``out`` (from its element 0), as ``_uniform_buckets`` goes."""
    scale, bucket, _, _, stream, ahead = quantizer
    position = start
    while position < stop:
        b, end = _code_piece(position, stop, bucket)
        prefetch_ahead(p, position, end, ahead)
        piece, into = p[position:end], out[position - start : end - start]
        kept = residual[position:end] if residual.size else residual
        decoded = decoded_scale(scale[b])
        _nuqsgd_codes(piece, _divisor(scale[b]), s, position, stream, decoded, offset, into, kept)
        position = end


@jit(error_model="numpy")
def _quantize(p, start, quantizer, offset, out, residual):
    """code + ``offset`` of elements start .. start + out.size - 1 of ``p`` into ``out``
    under ``quantizer`` = (scale, bucket, levels, exponent, stream, ahead) of ``quantized``, each
    under its bucket's scale; their residuals into ``residual``'s elements if it is not
    empty."""
    # One inlined copy of the bucket loop per kind of element loop, its kind a constant
    # there, so that LLVM specializes each (s = 1 drops the general code's floor, min and
    # conversions; NUQSGD's loop over levels unrolls) and no call is made per bucket.
    _, _, levels, exponent, _, _ = quantizer
    stop, feedback = start + out.size, residual.size > 0
    if levels == 1 and feedback:
        _uniform_buckets(p, start, stop, quantizer, True, True, offset, out, residual)
    elif levels == 1:
        _uniform_buckets(p, start, stop, quantizer, True, False, offset, out, residual)
    elif levels and feedback:
        _uniform_buckets(p, start, stop, quantizer, False, True, offset, out, residual)
    elif levels:
        _uniform_buckets(p, start, stop, quantizer, False, False, offset, out, residual)
    elif exponent == 0:
        _nuqsgd_buckets(p, start, stop, quantizer, 0, offset, out, residual)
    elif exponent == 2:
        _nuqsgd_buckets(p, start, stop, quantizer, 2, offset, out, residual)
    elif exponent == 6:
        _nuqsgd_buckets(p, start, stop, quantizer, 6, offset, out, residual)
    else:
        _nuqsgd_buckets(p, start, stop, quantizer, 14, offset, out, residual)


# Packing reads the fields four (2 bits) or two (4 bits) at a time as one little-endian word
# (every platform numba targets is little-endian) and moves each to its place with a
# constant shift: a loop over contiguous words, which LLVM vectorizes, where a loop
# gathering every fourth byte it vectorizes poorly.


@jit
def _pack_fields(fields, width, packed):
    """``fields`` (one per byte, each less than 2^``width``; a multiple of 8 / ``width``
    of them) packed ``width`` bits each, little-endian in each byte, into ``packed``
    (``codes.IntCodes``)."""
    if width == 2:
        words = fields.view(np.uint32)
        for j in range(words.size):
            w = words[j]
            packed[j] = (
                (w & np.uint32(0x3))
                | ((w >> np.uint32(6)) & np.uint32(0xC))
                | ((w >> np.uint32(12)) & np.uint32(0x30))
                | ((w >> np.uint32(18)) & np.uint32(0xC0))
            )
    elif width == 4:
        halves = fields.view(np.uint16)
        for j in range(halves.size):
            w = halves[j]
            packed[j] = (w & np.uint16(0xF)) | ((w >> np.uint16(4)) & np.uint16(0xF0))
    else:
        for j in range(fields.size):
            packed[j] = fields[j]


@jit
def pack_chunk(fields, count, bound, width, packed):
    """The first ``count`` of the chunk ``fields`` packed into ``packed``, the last byte's
    free fields the code 0 (``bound``), as ``codes.IntCodes`` pads."""
    per = 8 // width
    whole = -(-count // per) * per
    fields[count:whole] = bound
    _pack_fields(fields[:whole], width, packed)


@jit(error_model="numpy")
def quantized(
    p, bits, norm, scale, bucket, levels, exponent, stream, bound, width, values, packed, residual
):
    """One worker's codes of ``p`` under its bucket scales, drawn from ``stream``
    (``seeding.key_words``; draw k for element k of ``seeding.uniforms``):
    ``UniformQuantizer`` with s = ``levels``, or with ``levels`` 0 ``NUQSGD`` with
    2^-``exponent`` its smallest level. Written as the exchange sends them: into ``packed``
    at ``width`` bits per code (``codes.IntCodes(bound)``), or else into ``values`` (the
    codes' values, in the allreduce's carrier). With a ``residual``, p - decode(values,
    scale, 1) goes there (NaN where the scale is not finite, as the eager decode gives).

    ``norm``: ``GIVEN_SCALES``, or the scales' norm (``MAX_NORMS``, read from ``bits``, p's
    float32 bits; ``L2_NORMS``), each bucket's written into ``scale`` a chunk ahead of its
    codes, while its elements are in the cache: one pass over p where a pass for the
    scales and one for the codes read it twice. Returns whether every scale it computed is
    finite (True for ``GIVEN_SCALES``); where one is not, the caller encodes again under
    the scales ``local_scale`` gives a non-finite gradient."""
    # Each piece asks for the lines of what the next chunk reads first: its own elements,
    # or, where this pass takes the norms, the next bucket's, when it is a few chunks long
    # (the norms' sums ask for the lines of longer buckets themselves).
    ahead = bucket if norm != GIVEN_SCALES and CHUNK < bucket <= 4 * CHUNK else CHUNK
    quantizer = (scale, bucket, levels, exponent, stream, ahead)
    fields = np.empty(CHUNK if packed.size else 0, dtype=np.uint8)
    codes = np.empty(0 if packed.size else CHUNK, dtype=np.int32)
    finite, scaled = True, 0  # buckets whose scales ``norm`` has written
    for start in range(0, p.size, CHUNK):
        count = min(p.size - start, CHUNK)
        if norm != GIVEN_SCALES:
            needed = -(-(start + count) // bucket)
            for b in range(scaled, needed):
                scale[b] = _bucket_norm(p, bits, b, bucket, norm)
                finite &= np.isfinite(scale[b])
            scaled = needed
        if packed.size and width == 8:  # a field per byte: the codes go to ``packed`` directly
            _quantize(p, start, quantizer, np.int32(bound), packed[start : start + count], residual)
        elif packed.size:
            _quantize(p, start, quantizer, np.int32(bound), fields[:count], residual)
            pack_chunk(fields, count, bound, width, packed[start * width // 8 :])
        else:
            _quantize(p, start, quantizer, np.int32(0), codes[:count], residual)
            _values(codes[:count], levels, values[start : start + count])
    return finite


@jit
def _values(codes, levels, out):
    """The codes' values (``Codec.values``) in the allreduce carrier ``out``."""
    if levels:
        for i in range(codes.size):
            out[i] = codes[i]
    else:
        for i in range(codes.size):
            out[i] = nuqsgd_value(codes[i])


@jit
def draws(stream, out):
    """Draws 0 .. out.size - 1 of ``stream`` (``seeding.key_words``), as the kernels above
    draw them inside their loops: for tests to compare with ``seeding.uniforms``."""
    x = _word(0, stream)
    for k in range(out.size):
        out[k] = _uniform(x)
        x = np.uint32(x + stream[1])
