"""The quantizers' per-element passes on device tensors, by ``triton_kernels``.

TernGrad's and the fixed-width QSGD family's encoding (the draws of ``seeding.uniforms``,
rounding, packing or the allreduce's values, and the worker residual) and their decoding on
each exchange's receiving side, one launch per call where the eager ops take dozens; and
ef-sign's on gradient buckets: the worker's and the server's signs and residuals, the
server's average, the decode of the servers' messages. The
calls take the arguments of ``fused``'s CPU calls and give their results bit for bit, which
are the eager ops' (``tests/test_triton_kernels.py`` checks both under Triton's
interpreter): every float operation is one the eager ops make, rounded as they round it
(``triton_kernels``).

Under ``TRITON_INTERPRET=1`` Triton runs the same kernels on CPU tensors with numpy:
``HVD_COMPRESS_KERNELS=triton`` sends CPU tensors here instead of to the numba kernels, to
test and count the device path on a machine without a GPU; the tests also compile every
kernel for CUDA architectures without one.
"""

import functools
import importlib.util
import os

import torch

from hvd_compress.codes import IntCodes
from hvd_compress.fused import divisor, quantizes
from hvd_compress.seeding import key_words

from .blocksign import BlockSign
from .buckets import Segments
from .packing import pack

# Whether Triton is installed and not turned off (``HVD_COMPRESS_KERNELS=0``).
ENABLED = (
    importlib.util.find_spec("triton") is not None
    and os.environ.get("HVD_COMPRESS_KERNELS", "1") != "0"
)
# Whether Triton runs kernels with numpy (``TRITON_INTERPRET=1``), and the profiler range
# that holds the tensor ops it makes to do so.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_RANGE = "hvdc.triton_interpreter"
# Whether CPU tensors take these kernels too, under Triton's interpreter
# (``HVD_COMPRESS_KERNELS=triton``): the device path, run where there is no GPU.
ON_CPU = os.environ.get("HVD_COMPRESS_KERNELS") == "triton"
if ON_CPU and (not ENABLED or not INTERPRETED):
    raise RuntimeError(
        "HVD_COMPRESS_KERNELS=triton runs the Triton kernels on CPU tensors, which needs "
        "Triton installed and its interpreter on (TRITON_INTERPRET=1)"
    )

# Elements (or packed bytes) per program: a GPU's, and larger ones for the interpreter, which
# runs one program at a time in Python (results do not depend on the size).
_BLOCK = 1 << 16 if INTERPRETED else 1024

# Pinned rounding: a * b + c rounds twice in the eager ops, and must not become one fma.
_COMPILE_OPTIONS = {"enable_fp_fusion": False}

# Kernel launches made so far, for ``benchmarks/op_count.py``.
launches = 0


def applies(codec, tensor: torch.Tensor) -> bool:
    """Whether these kernels take ``codec``'s work on ``tensor``: float32 tensors of
    TernGrad and the QSGD family with fixed-width codes, on a CUDA device, or on the CPU
    under the interpreter."""
    return _takes(tensor) and quantizes(codec)


def _takes(tensor: torch.Tensor) -> bool:
    """Whether these kernels run on ``tensor``: float32, on a CUDA device, or on the CPU
    under the interpreter, with Triton on."""
    return (
        ENABLED
        and tensor.dtype == torch.float32
        and (tensor.device.type == "cuda" or (ON_CPU and tensor.device.type == "cpu"))
    )


@functools.cache
def _kernels():
    """``triton_kernels``, imported when first needed: Triton's import takes a third of a
    second that a process without work for it need not spend."""
    from . import triton_kernels

    return triton_kernels


def _launch(name, items, *args, **constants):
    """Launches kernel ``name`` over ``items`` (elements, or packed bytes) ``_BLOCK`` at a
    time, or with a program ``table`` (``Segments.programs``) one program per row. Under
    the interpreter, the tensor ops it makes to run the kernel with numpy are marked
    (``INTERPRETER_RANGE``) so that counts of a step's ops can leave them out: on a GPU
    the launch is one."""
    global launches
    launches += 1
    table = constants.get("table")
    grid = (max(1, -(-items // _BLOCK)) if table is None else table.shape[0],)
    kernel = getattr(_kernels(), name)[grid]
    if not INTERPRETED:
        kernel(*args, BLOCK=_BLOCK, **constants, **_COMPILE_OPTIONS)
        return
    with torch.profiler.record_function(INTERPRETER_RANGE):
        kernel(*args, BLOCK=_BLOCK, **constants, **_COMPILE_OPTIONS)


# ----- the calls of ``fused`` -----


def _rounding(codec):
    """(mode, s as a float, exponent) of ``quantize`` for ``codec``."""
    if codec.name == "nuqsgd":
        return _kernels().NUQSGD, float(2**codec.exponent), codec.exponent
    kernels = _kernels()
    return (kernels.ONE_LEVEL if codec.levels == 1 else kernels.UNIFORM), float(codec.levels), 0


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a flat contiguous float32 tensor: itself where it is one already, so
    that a step makes no op (a launch on a GPU) to convert what needs no converting."""
    if tensor.dtype != torch.float32:
        tensor = tensor.to(torch.float32)
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    return tensor.contiguous()


def _stretches(codec, numel, per_item=1):
    """The arguments of a kernel's ``_stretch``: (block length, {program table, members})
    of a gradient bucket's codec (its blocks are ``Segments``), or the block length of a
    tensor's and no tables."""
    blocks = codec.bucket_length(numel)
    if not isinstance(blocks, Segments):
        return blocks, {"table": None, "members": None, "SEGMENTED": False}
    tables = {"table": blocks.programs(per_item, _BLOCK), "members": blocks.members}
    return 0, {**tables, "SEGMENTED": True}


@functools.lru_cache
def _zero_codes(space: IntCodes, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of packed codes 0 on ``device``, made once per size: the kernels write a
    bucket's members' stretches only."""
    zeros = torch.zeros(1, nbytes * 8 // space.width, dtype=torch.int32)
    return pack(zeros, space).reshape(-1).to(device)


def _output(codec, numel, device):
    """Where a decode writes: a new tensor, or a gradient bucket's ``Segments.decoded``."""
    blocks = codec.bucket_length(numel)
    if isinstance(blocks, Segments):
        return blocks.decoding()
    return torch.empty(numel, dtype=torch.float32, device=device)


def encode(codec, payload: torch.Tensor, p: torch.Tensor, scale: torch.Tensor, key, residual):
    """``fused.encode`` of a quantizer: p's codes under ``scale`` with the draws of stream
    ``key`` into ``payload`` (uint8: packed, with code 0 in every field past p's; else the
    codes' values in its dtype), and with a ``residual`` tensor like p, p - decode(values,
    scale, 1) there. For a gradient bucket, ``key`` holds its members' stream words
    (``BucketLayout.words``)."""
    space = codec.code_space
    mode, levels, exponent = _rounding(codec)
    packed = payload.dtype == torch.uint8
    p = p if p.dim() == 1 else p.reshape(-1)
    slots = payload.numel() * 8 // space.width if packed else p.numel()
    per_item = 8 // space.width if packed and space.width < 8 else 1
    items = payload.numel() if per_item > 1 else slots
    bucket, tables = _stretches(codec, p.numel(), per_item)
    words = key if tables["SEGMENTED"] else None
    lo, multiplier = (0, 0) if tables["SEGMENTED"] else key_words(key)
    _launch(
        "quantize",
        items,
        p,
        flat_float32(scale),
        payload,
        p if residual is None else residual,
        p.numel(),
        slots,
        bucket,
        lo,
        multiplier,
        levels,
        exponent,
        space.bound,
        **tables,
        words=words,
        MODE=mode,
        WIDTH=space.width,
        PACKED=packed,
        FEEDBACK=residual is not None,
    )
    if tables["SEGMENTED"] and packed:
        head = space.packed_nbytes(p.numel())
        if payload.numel() > head:  # the sharded exchange's padding to whole shards
            payload[head:].copy_(_zero_codes(space, payload.numel() - head, payload.device))
    return payload


def decoded_totals(codec, total: torch.Tensor, scale: torch.Tensor, count: int) -> torch.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    numel, scale = total.numel(), flat_float32(scale)
    bucket, tables = _stretches(codec, numel)
    out = _output(codec, numel, total.device)
    divided_by = float(divisor(codec, count))
    _launch("decode_totals", numel, total, scale, out, numel, bucket, divided_by, **tables)
    return out


def _rows(rows):
    """2-D packed rows whose bytes are contiguous within each row (row r at r stride(0))."""
    rows = rows.reshape(1, -1) if rows.dim() == 1 else rows
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _decode_rows(codec, rows, scales, own, count, numel):
    space = codec.code_space
    bucket, tables = _stretches(codec, numel)
    out = _output(codec, numel, rows.device)
    _launch(
        "decode_rows",
        numel,
        rows,
        rows.stride(0),
        rows.shape[0],
        scales,
        scales.numel() // rows.shape[0] if own else 0,
        out,
        numel,
        bucket,
        float(divisor(codec, count)),
        space.bound,
        **tables,
        WIDTH=space.width,
        NUQSGD=codec.name == "nuqsgd",
        OWN_SCALES=own,
    )
    return out


def decoded_sums(codec, rows: torch.Tensor, scale: torch.Tensor, count: int, numel: int):
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    return _decode_rows(codec, _rows(rows), flat_float32(scale), False, count, numel)


def decoded_own_scales(codec, messages: torch.Tensor, head: int, count: int, numel: int):
    """The allgather's sum over the workers' ``messages`` (rows: ``head`` bytes of float32
    scales, then the codes) of ``codec.decode`` of their values, each under its own
    scales."""
    scales = messages[:, :head].reshape(-1).view(torch.float32)
    return _decode_rows(codec, _rows(messages)[:, head:], scales, True, count, numel)


def summed_codes(codec, rows: torch.Tensor, length: int, total_space: IntCodes) -> torch.Tensor:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every row, summed over the rows and packed in ``total_space``."""
    space = codec.code_space
    out = torch.empty(total_space.packed_nbytes(length), dtype=torch.uint8, device=rows.device)
    rows = _rows(rows)
    slots = out.numel() * 8 // total_space.width
    _launch(
        "sum_codes",
        out.numel() if total_space.width < 8 else slots,
        rows,
        rows.stride(0),
        rows.shape[0],
        out,
        length,
        slots,
        space.bound,
        total_space.bound,
        WIDTH=space.width,
        TOTAL_WIDTH=total_space.width,
        NUQSGD=codec.name == "nuqsgd",
    )
    return out


def decoded_segments(
    codec,
    rows: torch.Tensor,
    total_space: IntCodes,
    length: int,
    scale: torch.Tensor,
    count: int,
    numel: int,
) -> torch.Tensor:
    """The sharded exchange's ``codec.decode`` of the gathered partial sums: row r is
    elements r length .. (r + 1) length - 1, packed in ``total_space``."""
    bucket, tables = _stretches(codec, numel)
    out = _output(codec, numel, rows.device)
    rows = _rows(rows)
    _launch(
        "decode_segments",
        numel,
        rows,
        rows.stride(0),
        out,
        numel,
        length,
        flat_float32(scale),
        bucket,
        float(divisor(codec, count)),
        total_space.bound,
        **tables,
        WIDTH=total_space.width,
    )
    return out


# ----- ef-sign's gradient buckets -----


def signs_apply(codec, tensor: torch.Tensor) -> bool:
    """Whether these kernels take ef-sign's work on ``tensor``, a gradient bucket's vector
    (its codec's blocks are ``Segments``): float32, on a CUDA device, or on the CPU under
    the interpreter. A tensor of its own takes the eager ops."""
    return (
        _takes(tensor)
        and isinstance(codec, BlockSign)
        and isinstance(codec.bucket_length(tensor.numel()), Segments)
    )


def signs(codec, p: torch.Tensor, scale: torch.Tensor, packed=True, feedback=True, decoded=False):
    """``BlockSign.encode`` of p under ``scale``, in one pass: (the packed codes, with
    ``feedback`` the residual p - decode(codes, scale, 1), with ``decoded`` that decode,
    written where the bucket decodes), each None where not asked for."""
    numel = p.numel()
    bucket, tables = _stretches(codec, numel, per_item=8)
    nbytes = codec.code_space.packed_nbytes(numel)
    out = torch.empty(nbytes, dtype=torch.uint8, device=p.device) if packed else None
    residual = torch.empty_like(p) if feedback else None
    values = _output(codec, numel, p.device) if decoded else None
    _launch(
        "signs",
        nbytes,
        p,
        flat_float32(scale),
        p if out is None else out,
        p if residual is None else residual,
        p if values is None else values,
        numel,
        numel,
        bucket,
        **tables,
        PACKED=packed,
        FEEDBACK=feedback,
        DECODED=decoded,
    )
    return out, residual, values


def _averaged_signs(codec, rows, scales, count, residual, lr_ratio, numel, blocks):
    """The ``average_signs`` kernel's p (see there)."""
    out = torch.empty(numel, dtype=torch.float32, device=rows.device)
    if blocks is None:
        bucket, tables = _stretches(codec, numel)
    else:
        bucket, tables = 0, {"table": None, "members": None, "SEGMENTED": False}
    rows = _rows(rows)
    _launch(
        "average_signs",
        numel,
        rows,
        rows.stride(0),
        rows.shape[0],
        scales,
        scales.shape[-1],
        rows if blocks is None else blocks,
        out if residual is None else residual,
        float(lr_ratio),
        out,
        numel,
        bucket,
        float(count),
        **tables,
        BLOCK_INDEX=blocks is not None,
        FEEDBACK=residual is not None,
    )
    return out


def server_step(server, codec, rows, scales, count: int, numel: int, blocks=None, decoded=False):
    """``ServerStep`` of a server whose workers each sent a row of ``rows`` (packed signs)
    under their block ``scales`` (a row each): p, the average plus the server residual;
    its scales under ``codec``'s blocks; its codes, and the new server residual, which it
    proposes. The blocks of the workers' scales are those of ``codec``'s stretches, or
    ``blocks`` (each element's, -1 for padding: a sharded server's, ``ShardLayout``).
    Returns (packed codes, scale), or with ``decoded`` (a replicated server, which sends
    nothing) (the decoded codes, scale)."""
    residual = server.memory.residuals.get(server.key)
    lr_ratio = server.lr_ratio
    if isinstance(lr_ratio, torch.Tensor):  # not read: the compensation is the eager op
        p = _averaged_signs(codec, rows, scales, count, None, 1.0, numel, blocks)
        p = server.memory.compensate(server.key, p, lr_ratio)
    else:
        p = _averaged_signs(codec, rows, scales, count, residual, lr_ratio, numel, blocks)
    scale = codec.local_scale(p)
    packed, kept, values = signs(codec, p, scale, packed=not decoded, decoded=decoded)
    server.memory.propose(server.key, kept)
    return (values if decoded else packed), scale


def decoded_shards(codec, rows, heads, blocks, order, length, numel):
    """A bucket sharded member by member (``ShardLayout``): every server's decoded signs
    (row r: shard r's ``length`` packed signs) times its block scales (``heads``, each
    server's in a row; element q of the shards laid end to end takes ``heads[blocks[q]]``),
    written to the bucket's elements ``order[q]``, where the bucket decodes."""
    out = _output(codec, numel, rows.device)
    rows = _rows(rows)
    total = rows.shape[0] * length
    _launch("decode_shards", total, rows, rows.stride(0), heads, blocks, order, out, length, total)
    return out
