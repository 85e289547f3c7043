"""Triton kernels of the quantizers' per-element passes, and of ef-sign's on gradient buckets
(``triton_fused`` calls them).

Every float operation is one the eager ops make, rounded as they round it: division by
``div_rn`` (Triton's ``/`` on float32 is approximate on a GPU), no product and sum contracted
into a fused multiply-add (``triton_fused`` compiles with ``enable_fp_fusion=False``), in the
eager order.

With SEGMENTED, a kernel codes a gradient bucket (``hvd_compress.bucketing``): each program
works in one member's stretch of the vector, which ``table`` names (``_stretch``), so a
member's blocks, draws and padding are those of the member alone.
"""

import triton
import triton.language as tl

# Rounding modes of ``quantize``.
ONE_LEVEL, UNIFORM, NUQSGD = 0, 1, 2


@triton.jit
def _uniform(i, lo, multiplier):
    """Draw i of the stream (lo, multiplier) (``seeding.uniforms``): lowbias32 of the
    word i multiplier + lo modulo 2^32, its top 24 bits over 2^24."""
    x = i.to(tl.uint32) * multiplier.to(tl.uint32) + lo.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (2.0**-24)


@triton.jit
def _stretch(table, members, numel, span, bucket, BLOCK, SEGMENTED):
    """This program's place: (its first item, the first element of its stretch of the
    vector, the stretch's elements, its length with padding, its first block, its block
    length, its member). In a bucket, program p works on items ``table[p, 1]`` on of
    member ``table[p, 0]``, whose row of ``members`` holds (offset, elements, length,
    first block, block length); else on items p BLOCK on of the whole vector."""
    pid = tl.program_id(0)
    if SEGMENTED:
        member = tl.load(table + 2 * pid)
        row = members + 5 * member
        return (
            tl.load(table + 2 * pid + 1),
            tl.load(row),
            tl.load(row + 1),
            tl.load(row + 2),
            tl.load(row + 3),
            tl.load(row + 4),
            member,
        )
    else:
        return pid * BLOCK, 0, numel, span, 0, bucket, 0


@triton.jit
def _decoded_scale(s):
    """A scale as the decodes apply it: NaN where it is not finite."""
    return tl.where(tl.abs(s) < float("inf"), s, float("nan"))


@triton.jit
def _nuqsgd_value(code):
    """``NUQSGD.values``: sign(code) 2^(|code| - 1), 0 for 0."""
    value = (tl.full(code.shape, 1, tl.int32) << tl.abs(code)) >> 1
    return tl.where(code < 0, -value, value)


@triton.jit
def _field(row, j, valid, WIDTH: tl.constexpr):
    """Field j of the packed ``row`` (``codes.IntCodes`` of WIDTH bits) where ``valid``, 0
    elsewhere (nothing read there), as int32 (as int64 for 32 bits)."""
    if WIDTH < 8:
        byte = tl.load(row + j // (8 // WIDTH), mask=valid, other=0).to(tl.int32)
        return (byte >> ((j % (8 // WIDTH)) * WIDTH)) & ((1 << WIDTH) - 1)
    else:
        field = tl.load(row + (WIDTH // 8) * j, mask=valid, other=0).to(tl.int64)
        for t in tl.static_range(1, WIDTH // 8):
            part = tl.load(row + (WIDTH // 8) * j + t, mask=valid, other=0).to(tl.int64)
            field = field | (part << (8 * t))
        if WIDTH == 32:
            return field
        return field.to(tl.int32)


@triton.jit
def _store_fields(out, index, field, valid, WIDTH: tl.constexpr):
    """Stores the nonnegative ``field`` of each element ``index`` (an (n, 8 // WIDTH)
    block, row k the fields of one byte, below 8 bits; else 1-D) in WIDTH bits."""
    if WIDTH < 8:
        shifts = tl.arange(0, 8 // WIDTH) * WIDTH
        byte = tl.sum(field.to(tl.int32) << shifts[None, :], axis=1)
        first = tl.max(index, axis=1) // (8 // WIDTH)
        tl.store(out + first, byte.to(tl.uint8), mask=tl.max(valid.to(tl.int32), axis=1) > 0)
    else:
        for t in tl.static_range(WIDTH // 8):
            part = (field.to(tl.int64) >> (8 * t)) & 0xFF
            tl.store(out + (WIDTH // 8) * index + t, part.to(tl.uint8), mask=valid)


@triton.jit
def quantize(
    p,
    scale,
    out,
    residual,
    numel,
    slots,
    bucket,
    lo,
    multiplier,
    levels,
    exponent,
    bound,
    table,
    members,
    words,
    MODE: tl.constexpr,
    WIDTH: tl.constexpr,
    PACKED: tl.constexpr,
    FEEDBACK: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Codes of p's ``numel`` elements under their buckets' scales, each drawn with
    draw i of the stream (lo, multiplier): packed into ``out`` (``slots`` fields, code
    0 past p's), or if not PACKED their values (``Codec.values``) in ``out``'s dtype;
    with FEEDBACK, p - decode(values, scale, 1) into ``residual``. SEGMENTED: of each
    member of a bucket in its stretch (``_stretch``), code 0 in its padding."""
    first, offset, valid, span, first_block, length, member = _stretch(
        table, members, numel, slots, bucket, BLOCK, SEGMENTED
    )
    if SEGMENTED:  # each member draws from its own stream, a row of ``words``
        lo = tl.load(words + 2 * member)
        multiplier = tl.load(words + 2 * member + 1)
    if PACKED and WIDTH < 8:
        local = (first + tl.arange(0, BLOCK))[:, None] * (8 // WIDTH) + tl.arange(0, 8 // WIDTH)[
            None, :
        ]
    else:
        local = first + tl.arange(0, BLOCK)
    index = offset + local
    inside = local < valid
    g = tl.load(p + index, mask=inside, other=0.0)
    s = tl.load(scale + first_block + local // length, mask=inside, other=1.0)
    # |g| / S, S inf for a zero or non-finite scale, and 0 for a NaN quotient.
    divisor = tl.where((s > 0) & (s < float("inf")), s, float("inf"))
    normalized = tl.math.div_rn(tl.abs(g), divisor)
    normalized = tl.where(normalized == normalized, normalized, 0.0)
    u = _uniform(local, lo, multiplier)
    if MODE == 0:
        level = (u < normalized).to(tl.int32)
    elif MODE == 1:
        x = normalized * levels
        low = tl.minimum(tl.floor(x), levels - 1.0)
        level = (low + (u < x - low).to(tl.float32)).to(tl.int32)
    else:
        # NUQSGD (as ``hvd_compress.kernels._nuqsgd_code``): the index of the level
        # below r from r's exponent, drawn up by the fraction of r's significand.
        r = tl.minimum(normalized, 1.0)
        bits = r.to(tl.int32, bitcast=True)
        biased = bits >> 23
        above = biased >= 127 - exponent
        fraction = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
        power = ((127 + exponent) << 23).to(tl.float32, bitcast=True)
        level = tl.where(above, biased - 126 + exponent, 0)
        level += (u < tl.where(above, fraction, r * power)).to(tl.int32)
    code = tl.where(inside, tl.where(g < 0, -level, level), 0)
    value = _nuqsgd_value(code) if MODE == 2 else code
    if FEEDBACK:
        sent = tl.math.div_rn(value.to(tl.float32) * _decoded_scale(s), levels)
        tl.store(residual + index, g - sent, mask=inside)
    if PACKED:
        _store_fields(out, index, code + bound, local < span, WIDTH)
    else:
        tl.store(out + index, value.to(out.dtype.element_ty), mask=local < span)


@triton.jit
def decode_totals(
    total,
    scale,
    out,
    numel,
    bucket,
    divisor,
    table,
    members,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = ``Codec.decode`` of the allreduce's summed values: total S / divisor (0 in
    a bucket's padding)."""
    first, offset, valid, span, first_block, length, _ = _stretch(
        table, members, numel, numel, bucket, BLOCK, SEGMENTED
    )
    local = first + tl.arange(0, BLOCK)
    index = offset + local
    inside = local < valid
    value = tl.load(total + index, mask=inside, other=0).to(tl.float32)
    s = _decoded_scale(tl.load(scale + first_block + local // length, mask=inside, other=1.0))
    decoded = tl.where(inside, tl.math.div_rn(value * s, divisor), 0.0)
    tl.store(out + index, decoded, mask=local < span)


@triton.jit
def decode_rows(
    rows,
    row_bytes,
    count,
    scales,
    scales_per_row,
    out,
    numel,
    bucket,
    divisor,
    bound,
    table,
    members,
    WIDTH: tl.constexpr,
    NUQSGD: tl.constexpr,
    OWN_SCALES: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The allgather's decode of ``count`` rows of packed codes: under each row's own
    scales (row r's at ``scales`` + r ``scales_per_row``), the sum over the rows in
    order of their decoded values; under one shared scale, the decode of the sum of
    their values (int32). 0 in a bucket's padding."""
    first, offset, valid, span, first_block, length, _ = _stretch(
        table, members, numel, numel, bucket, BLOCK, SEGMENTED
    )
    local = first + tl.arange(0, BLOCK)
    index = offset + local
    inside = local < valid
    b = first_block + local // length
    value = _field(rows, index, inside, WIDTH) - bound
    if NUQSGD:
        value = _nuqsgd_value(value)
    if OWN_SCALES:
        s = _decoded_scale(tl.load(scales + b, mask=inside, other=1.0))
        acc = tl.math.div_rn(value.to(tl.float32) * s, divisor)
        for r in range(1, count):
            value = _field(rows + r * row_bytes, index, inside, WIDTH) - bound
            if NUQSGD:
                value = _nuqsgd_value(value)
            s = tl.load(scales + r * scales_per_row + b, mask=inside, other=1.0)
            acc += tl.math.div_rn(value.to(tl.float32) * _decoded_scale(s), divisor)
    else:
        for r in range(1, count):
            more = _field(rows + r * row_bytes, index, inside, WIDTH) - bound
            if NUQSGD:
                more = _nuqsgd_value(more)
            value += more
        s = _decoded_scale(tl.load(scales + b, mask=inside, other=1.0))
        acc = tl.math.div_rn(value.to(tl.float32) * s, divisor)
    tl.store(out + index, tl.where(inside, acc, 0.0), mask=local < span)


@triton.jit
def sum_codes(
    rows,
    row_bytes,
    count,
    out,
    length,
    slots,
    bound,
    total_bound,
    WIDTH: tl.constexpr,
    TOTAL_WIDTH: tl.constexpr,
    NUQSGD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every row summed (int32) and packed at TOTAL_WIDTH bits (``slots`` fields, 0 past
    ``length``)."""
    start = tl.program_id(0) * BLOCK
    if TOTAL_WIDTH < 8:
        index = (start + tl.arange(0, BLOCK))[:, None] * (8 // TOTAL_WIDTH) + tl.arange(
            0, 8 // TOTAL_WIDTH
        )[None, :]
    else:
        index = start + tl.arange(0, BLOCK)
    inside = index < length
    total = tl.zeros(index.shape, tl.int32)
    for r in range(count):
        value = _field(rows + r * row_bytes, index, inside, WIDTH) - bound
        if NUQSGD:
            value = _nuqsgd_value(value)
        total += tl.where(inside, value, 0)
    _store_fields(out, index, total + total_bound, index < slots, TOTAL_WIDTH)


@triton.jit
def decode_segments(
    rows,
    row_bytes,
    out,
    numel,
    length,
    scale,
    bucket,
    divisor,
    bound,
    table,
    members,
    WIDTH: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sharded exchange's decode: row r holds the summed values of elements
    r length .. (r + 1) length - 1 (0 in a bucket's padding)."""
    first, offset, valid, span, first_block, block_length, _ = _stretch(
        table, members, numel, numel, bucket, BLOCK, SEGMENTED
    )
    local = first + tl.arange(0, BLOCK)
    index = offset + local
    inside = local < valid
    row, j = index // length, index % length
    value = _field(rows + row * row_bytes, j, inside, WIDTH)
    s = tl.load(scale + first_block + local // block_length, mask=inside, other=1.0)
    decoded = tl.math.div_rn((value - bound).to(tl.float32) * _decoded_scale(s), divisor)
    tl.store(out + index, tl.where(inside, decoded, 0.0), mask=local < span)


@triton.jit
def _bit(row, j, valid):
    """Bit j of the packed ``row`` where ``valid``, 0 elsewhere, as int32."""
    byte = tl.load(row + j // 8, mask=valid, other=0).to(tl.int32)
    return (byte >> (j % 8)) & 1


@triton.jit
def _scaled_sign(row, scales, b, j, valid):
    """Sign j of the packed ``row`` times ``scales[b]``, NaN for a non-finite scale."""
    s = _decoded_scale(tl.load(scales + b, mask=valid, other=0.0))
    return (1 - 2 * _bit(row, j, valid)).to(tl.float32) * s


@triton.jit
def signs(
    p,
    scale,
    out,
    residual,
    decoded,
    numel,
    slots,
    bucket,
    table,
    members,
    PACKED: tl.constexpr,
    FEEDBACK: tl.constexpr,
    DECODED: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``BlockSign``'s codes of p's ``numel`` elements (sign(0) = +1, and -1 for NaN, as
    ``g >= 0`` compares) under their blocks' scales: packed into ``out`` (``slots``
    bits, +1 past p's); with FEEDBACK, p - decode(codes, scale, 1) into ``residual``;
    with DECODED, decode(codes, scale, 1) into ``decoded``. SEGMENTED: of each member of
    a bucket in its stretch (``_stretch``), +1 and zeros in its padding."""
    first, offset, valid, span, first_block, length, _ = _stretch(
        table, members, numel, slots, bucket, BLOCK, SEGMENTED
    )
    local = (first + tl.arange(0, BLOCK))[:, None] * 8 + tl.arange(0, 8)[None, :]
    index = offset + local
    inside = local < valid
    g = tl.load(p + index, mask=inside, other=0.0)
    s = _decoded_scale(tl.load(scale + first_block + local // length, mask=inside, other=1.0))
    negative = inside & ~(g >= 0)
    sent = tl.where(negative, -1.0, 1.0) * s
    if FEEDBACK:
        tl.store(residual + index, tl.where(inside, g - sent, 0.0), mask=local < span)
    if DECODED:
        tl.store(decoded + index, tl.where(inside, sent, 0.0), mask=local < span)
    if PACKED:
        _store_fields(out, index, negative.to(tl.int32), local < span, 1)


@triton.jit
def average_signs(
    rows,
    row_bytes,
    count,
    scales,
    scales_per_row,
    blocks,
    residual,
    lr_ratio,
    out,
    numel,
    bucket,
    divisor,
    table,
    members,
    BLOCK_INDEX: tl.constexpr,
    FEEDBACK: tl.constexpr,
    SEGMENTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A server's p: the sum over ``count`` rows of packed signs, in order, of each sign
    times its row's scale of the element's block (row r's scales at ``scales`` + r
    ``scales_per_row``), divided by ``divisor``; with FEEDBACK, plus ``residual`` times
    ``lr_ratio``. The blocks: with BLOCK_INDEX, element i's is ``blocks[i]`` (-1: padding),
    else those of the stretches (``_stretch``). 0 in padding."""
    if BLOCK_INDEX:
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        span = index < numel
        b = tl.load(blocks + index, mask=span, other=-1)
        inside = b >= 0
    else:
        first, offset, valid, length_with_padding, first_block, length, _ = _stretch(
            table, members, numel, numel, bucket, BLOCK, SEGMENTED
        )
        local = first + tl.arange(0, BLOCK)
        index = offset + local
        span = local < length_with_padding
        inside = local < valid
        b = first_block + local // length
    acc = _scaled_sign(rows, scales, b, index, inside)
    for r in range(1, count):
        acc += _scaled_sign(rows + r * row_bytes, scales + r * scales_per_row, b, index, inside)
    acc = tl.math.div_rn(acc, divisor)
    if FEEDBACK:
        acc = acc + tl.load(residual + index, mask=inside, other=0.0) * lr_ratio
    tl.store(out + index, tl.where(inside, acc, 0.0), mask=span)


@triton.jit
def decode_shards(
    rows, row_bytes, heads, blocks, order, out, length, elements, BLOCK: tl.constexpr
):
    """The decode of every server's signs (row r: those of shard r, ``length`` of them)
    times its block scales (``heads``, a row of each server's laid end to end; element
    q's is ``heads[blocks[q]]``, -1: padding, 0), written to the bucket's element
    ``order[q]``."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    span = q < elements
    b = tl.load(blocks + q, mask=span, other=-1)
    inside = b >= 0
    negative = _bit(rows + (q // length) * row_bytes, q % length, inside)
    s = _decoded_scale(tl.load(heads + b, mask=inside, other=0.0))
    value = tl.where(inside, (1 - 2 * negative).to(tl.float32) * s, 0.0)
    tl.store(out + tl.load(order + q, mask=span, other=0), value, mask=span)
