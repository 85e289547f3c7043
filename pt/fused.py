"""The codecs' per-element passes on CPU tensors, fused by ``hvd_compress.kernels``:
ef-sign's worker and server, and TernGrad's and the fixed-width QSGD family's scales,
encoding (with the draws of ``seeding.uniforms``, packing and residual) and decoding.

The codec, memory and exchange calls (``BlockSign``, ``TernGrad``, ``QSGD``, ...,
``ErrorFeedback``, ``ServerStep``, ``pt.exchange``) define the step and are what CUDA
tensors run; on CPU float32 tensors these calls do the same work in a few passes, with the
same results: codes, packed bytes, decoded values and residuals bit for bit, and scales
equal to the float64 reference's (the eager port's float64 sums are within float64
rounding of it, so its float32 scales very rarely differ in the last bit).

Device tensors of the quantizers take the same calls through Triton kernels
(``triton_fused``). ``HVD_COMPRESS_KERNELS=0`` in the environment keeps the eager calls
everywhere, to compare; ``HVD_COMPRESS_KERNELS=triton`` (with ``TRITON_INTERPRET=1``) sends CPU
tensors down the device path instead of to the numba kernels.
"""

import numpy as np
import torch

from hvd_compress import fused as core
from hvd_compress.codes import IntCodes

from . import triton_fused
from .blocksign import BlockSign

# Whether the CPU kernels run at all (tests and benchmarks switch it to compare).
ENABLED = core.AVAILABLE


# numpy's type string of each dtype whose tensors the kernels read or write.
_TYPESTRS = {
    dtype: torch.empty(0, dtype=dtype).numpy().dtype.str
    for dtype in (
        torch.float16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    )
}
_DTYPES = {np.dtype(typestr): dtype for dtype, typestr in _TYPESTRS.items()}


class _Borrowed:
    """The base of a numpy array made by ``_array``: it keeps the viewed tensor alive."""

    __slots__ = ("__array_interface__", "tensor")


def _array(tensor: torch.Tensor, flat: bool = True) -> np.ndarray:
    """A numpy array sharing the memory of CPU ``tensor``: flattened (a contiguous copy of
    a strided input, such as a column of scales), or if not ``flat`` with its shape and
    strides (rows sliced out of a gathered message). Made without torch's dispatcher:
    ``Tensor.numpy()`` is four aten ops (detach, to, resolve_conj, resolve_neg) and
    ``reshape(-1)`` two more, none of which does any work, but each costs a dispatch and a
    profiler counts them."""
    if flat:
        tensor = tensor.contiguous()
    borrowed = _Borrowed()
    borrowed.tensor = tensor
    borrowed.__array_interface__ = {
        "data": (tensor.data_ptr(), False),
        "shape": (tensor.numel(),) if flat else tuple(tensor.shape),
        "strides": None if flat else tuple(s * tensor.element_size() for s in tensor.stride()),
        "typestr": _TYPESTRS[tensor.dtype],
        "version": 3,
    }
    return np.asarray(borrowed)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing the memory of a kernel's result ``array`` (which it keeps alive):
    ``torch.frombuffer`` of a 1-D array goes without the dispatcher, where
    ``torch.from_numpy`` is an aten op (lift_fresh)."""
    if array.ndim != 1 or not array.size:
        return torch.from_numpy(array)
    return torch.frombuffer(array, dtype=_DTYPES[array.dtype])


def applies(codec, tensor):
    """Whether ``codec``'s encoding and decoding of tensors like ``tensor`` go through
    kernels: the CPU kernels' (``on_host``) or Triton's (``triton_fused.applies``)."""
    return on_host(codec, tensor) or triton_fused.applies(codec, tensor)


def on_host(codec, tensor):
    """Whether the CPU kernels take ``codec``'s work on tensors like ``tensor``: CPU float32
    tensors of ``BlockSign``, ``TernGrad`` and the QSGD family's fixed width (by name: the
    codec modules call this module). Their scales, compensation and finiteness come from
    these kernels only; on the device path those are the eager ops."""
    return host_reads(tensor) and tensor.dtype == torch.float32 and core.covers(codec)


def host_reads(tensor):
    """Whether the CPU kernels' path reads ``tensor`` on the host (``finite``): a CPU
    tensor, with the kernels on and not standing in for the device path."""
    return ENABLED and not triton_fused.ON_CPU and tensor.device.type == "cpu"


def _on_device(tensor):
    """Whether a call on ``tensor`` that both kernels make goes to Triton's."""
    return tensor.device.type != "cpu" or triton_fused.ON_CPU


def _factor(mu):
    """mu for the kernels: m = mu m + g rounded once, as ``torch.add(alpha=mu)`` rounds."""
    return core.momentum_factor(mu, rounded_per_op=False)


def momentum(grad, buffer, mu, nesterov):
    """``WorkerMomentum``'s m = mu m + g and u = g + mu m (or m) in one pass over a
    contiguous ``grad``, which becomes u; returns the new m."""
    out = core.momentum(_array(grad), _array(buffer), _factor(mu), nesterov)
    return _tensor(out).view(grad.shape)


def compensated_scale(codec, vector, residual, lr_ratio, momentum=None):
    """``ErrorFeedback.compensate`` and ``codec.local_scale`` (``hvd_compress.fused``):
    (p, scale), p = u + residual * lr_ratio, u ``vector`` or with a ``momentum``
    (``WorkerMomentum.Deferred``) its direction, whose new buffer is written in the same
    pass. Without either, p is ``vector`` itself."""
    p, scale = core.compensated_scale(codec, *_compensation(vector, residual, lr_ratio, momentum))
    same = residual is None and momentum is None
    return vector if same else _tensor(p), _tensor(scale)


def compensated(codec, vector, residual, lr_ratio, momentum=None):
    """p of ``compensated_scale`` alone, for scales that ``scaled_encode`` takes."""
    if residual is None and momentum is None:
        return vector
    return _tensor(core.compensated(codec, *_compensation(vector, residual, lr_ratio, momentum))[0])


def _compensation(vector, residual, lr_ratio, momentum):
    """The arrays of ``compensated_scale``'s arguments, as ``hvd_compress.fused``'s
    (vector, residual, lr_ratio, momentum) take them."""
    accelerate = None
    if momentum is not None:
        accelerate = (
            _array(momentum.buffer),
            _factor(momentum.mu),
            momentum.nesterov,
            _array(momentum.out),
        )
    return _array(vector), None if residual is None else _array(residual), lr_ratio, accelerate


def signs_with_feedback(codec, p, scale, in_place=False):
    """``BlockSign.encode``, packing, and the residual p - decode(codes) that
    ``ErrorFeedback.update`` keeps, in one pass: (packed signs, residual); ``in_place``,
    the residual over p (``hvd_compress.fused.signs_with_feedback``)."""
    packed, residual = core.signs_with_feedback(codec, _array(p), _array(scale), in_place)
    return _tensor(packed), p if in_place else _tensor(residual)


def server_step(server, codec, messages, head, block, count, numel):
    """``ServerStep`` of a server (of one shard, or replicated over a whole tensor) whose
    workers each sent a message (row of ``messages``: ``head`` bytes of float32 block
    scales, then the server's ``numel`` packed signs, all in scale block ``block``): the
    average, the server residual and the second compression. Returns (packed signs,
    scale) and proposes the new server residual."""
    previous = server.memory.residuals.get(server.key)
    packed, scale, residual = core.server_step(
        codec,
        _array(messages, flat=False),
        head,
        block,
        count,
        None if previous is None else _array(previous),
        server.lr_ratio,
        numel,
    )
    server.memory.propose(server.key, _tensor(residual))
    return _tensor(packed), _tensor(scale)


def headed(scale: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """One worker's message of an exchange that sends its own scales: the bytes of its
    float32 ``scale``, then its ``packed`` codes (``torch.cat`` of the two would take four
    more dispatches to view the scale as bytes)."""
    if _on_device(packed):
        return torch.cat([triton_fused.flat_float32(scale).view(torch.uint8), packed])
    return _tensor(core.headed(_array(scale), _array(packed)))


def sharded_messages(
    scale: torch.Tensor, packed: torch.Tensor, count: int, shard_bytes: int
) -> torch.Tensor:
    """A worker's rows of the sharded exchange (``hvd_compress.fused.sharded_messages``):
    row k its float32 ``scale``'s bytes, then shard k of its ``packed`` codes."""
    return _tensor(core.sharded_messages(_array(scale), _array(packed), count, shard_bytes))


def server_message(
    scale: torch.Tensor, scale_bytes: int, packed: torch.Tensor, shard_bytes: int
) -> torch.Tensor:
    """A sharded server's row (``hvd_compress.fused.server_message``)."""
    return _tensor(core.server_message(_array(scale), scale_bytes, _array(packed), shard_bytes))


def servers_signs(rows: torch.Tensor, length: int, numel: int) -> tuple:
    """The sharded servers' decoded signs from their gathered ``rows``, and whether all
    their scales are finite (``hvd_compress.fused.servers_signs``)."""
    out, finite = core.servers_signs(_array(rows, flat=False), length, numel)
    return _tensor(out), finite


def finite(tensor: torch.Tensor) -> bool:
    """Whether every element of CPU ``tensor`` is finite, read without a dispatch."""
    return bool(np.isfinite(_array(tensor)).all())


def scaled_signs(bits, scales, numel):
    """``packing.unpack_scaled_signs``: the first ``numel`` signs of each row of ``bits``
    times that row's scale, as float32 rows."""
    return _tensor(core.scaled_signs(_array(bits, flat=False), _array(scales), numel))


def local_scale(codec, grad: torch.Tensor) -> torch.Tensor:
    """``TernGrad.local_scale`` or the QSGD family's (``hvd_compress.fused.local_scale``)."""
    return _tensor(core.local_scale(codec, _array(grad)))


def encode(
    codec,
    exchange,
    p: torch.Tensor,
    scale: torch.Tensor,
    key: int,
    feedback: bool,
    overwrite: bool = False,
) -> tuple:
    """``codec.encode`` of p under ``scale`` with the draws of stream ``key``
    (``seeding.uniforms``), written as ``exchange`` sends it (its ``payload``: packed
    codes, or values in the allreduce's carrier), and with ``feedback`` the residual
    p - decode(values(codes), scale, 1) of ``ErrorFeedback.update``, in one pass:
    (payload, residual or None). ef-sign's are ``signs_with_feedback``: with
    ``overwrite`` (p a temporary of the caller's) its residual is written over p."""
    if isinstance(codec, BlockSign):
        return signs_with_feedback(codec, p, scale, in_place=overwrite)
    payload, residual = _outputs(exchange, p, feedback)
    if _on_device(p):
        return triton_fused.encode(codec, payload, p, scale, key, residual), residual
    values = core.encode(
        codec,
        _array(p),
        _array(scale),
        key,
        _array(payload),
        None if residual is None else _array(residual),
    )
    return _sent(payload, values), residual


def scaled_encode(codec, exchange, p: torch.Tensor, key: int, feedback: bool) -> tuple:
    """``local_scale`` and ``encode`` in one pass over p, for a QSGD-family codec whose
    scales no collective shares (``scales_in_encode``): (payload, residual or None,
    scale)."""
    payload, residual = _outputs(exchange, p, feedback)
    values, scale = core.scaled_encode(
        codec, _array(p), key, _array(payload), None if residual is None else _array(residual)
    )
    return _sent(payload, values), residual, _tensor(scale)


def _outputs(exchange, p, feedback):
    """What an encoding kernel writes: ``exchange``'s payload and, with ``feedback``, a
    residual like p."""
    return exchange.payload(p.device), torch.empty_like(p) if feedback else None


def _sent(payload, values):
    """The payload as the exchange sends it: the packed codes the kernel wrote into it, or
    the values it returned in the allreduce's carrier."""
    return payload if payload.dtype == torch.uint8 else _tensor(values)


def scales_in_encode(codec, numel: int) -> bool:
    """Whether ``scaled_encode`` takes ``codec``'s scales of a tensor of ``numel`` elements
    (``hvd_compress.fused.scales_in_encode``)."""
    return core.scales_in_encode(codec, numel)


def decoded_totals(codec, total: torch.Tensor, scale: torch.Tensor, count: int) -> torch.Tensor:
    """``codec.decode`` of the allreduce's summed values ``total``."""
    if _on_device(total):
        return triton_fused.decoded_totals(codec, total, scale, count)
    return _tensor(core.decoded_totals(codec, _array(total), _array(scale), count))


def summed_codes(codec, rows: torch.Tensor, length: int, total_space: IntCodes) -> torch.Tensor:
    """The sharded exchange's partial sum: the values of the first ``length`` codes of
    every row, summed over the rows and packed in ``total_space``."""
    if _on_device(rows):
        return triton_fused.summed_codes(codec, rows, length, total_space)
    return _tensor(core.summed_codes(codec, _array(rows, flat=False), length, total_space))


def decoded_sums(
    codec, rows: torch.Tensor, scale: torch.Tensor, count: int, numel: int
) -> torch.Tensor:
    """The allgather's ``codec.decode`` of the sum over the rows' values, shared scale."""
    if _on_device(rows):
        return triton_fused.decoded_sums(codec, rows, scale, count, numel)
    return _tensor(core.decoded_sums(codec, _array(rows, flat=False), _array(scale), count, numel))


def decoded_own_scales(
    codec, messages: torch.Tensor, head: int, count: int, numel: int
) -> torch.Tensor:
    """The allgather's sum over the workers' ``messages`` (rows: ``head`` bytes of float32
    scales, then the codes) of ``codec.decode`` of their values, each under its own scales."""
    if _on_device(messages):
        return triton_fused.decoded_own_scales(codec, messages, head, count, numel)
    return _tensor(core.decoded_own_scales(codec, _array(messages, flat=False), head, count, numel))


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
    if _on_device(rows):
        return triton_fused.decoded_segments(codec, rows, total_space, length, scale, count, numel)
    return _tensor(
        core.decoded_segments(
            codec,
            _array(rows, flat=False),
            total_space,
            length,
            _array(scale),
            count,
            numel,
        )
    )
