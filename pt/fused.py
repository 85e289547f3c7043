"""ef-sign's worker and server passes on CPU tensors, fused by ``hvd_compress.kernels``.

The codec, memory and exchange calls (``BlockSign``, ``ErrorFeedback``, ``ServerStep``)
define the step and are what CUDA tensors run; on CPU float32 tensors these three calls do
the same work in a few passes, with the same results: codes and residuals bit for bit, and
block scales equal to the float64 reference's (the eager port's are within 3e-7 of it).

``HVD_COMPRESS_KERNELS=0`` in the environment keeps the eager calls everywhere, to compare
the two.
"""
import functools
import importlib.util
import os

import torch

from .blocksign import BlockSign

ENABLED = importlib.util.find_spec("numba") is not None and \
    os.environ.get("HVD_COMPRESS_KERNELS", "1") != "0"

# "No residual" for kernels that take an array.
_NONE = torch.empty(0).numpy()


@functools.cache
def _kernels():
    """``hvd_compress.kernels``, imported when first needed: numba's import takes 0.25 s
    that a process without ef-sign on CPU tensors need not spend."""
    from hvd_compress import kernels
    return kernels


def applies(codec, tensor):
    """Whether ``codec``'s work on tensors like ``tensor`` goes through the kernels: CPU
    float32 tensors of ``BlockSign``."""
    return ENABLED and isinstance(codec, BlockSign) and tensor.device.type == "cpu" and \
        tensor.dtype == torch.float32


def momentum(grad, buffer, mu, nesterov):
    """``WorkerMomentum``'s m = mu m + g and u = g + mu m (or m) in one pass over a
    contiguous ``grad``, which becomes u; returns the new m."""
    out = torch.empty_like(grad)
    _kernels().momentum(grad.view(-1).numpy(), buffer.reshape(-1).numpy(), mu, nesterov,
                        out.view(-1).numpy())
    return out


def compensated_scale(codec, vector, residual, ratio, momentum=None):
    """``ErrorFeedback.compensate`` and ``BlockSign.local_scale`` in one pass: (p, scale),
    p = u + residual * ratio. u is ``vector``, or with a ``momentum``
    (``WorkerMomentum.Deferred``) the direction of ``WorkerMomentum.before_exchange``,
    whose new buffer is written in the same pass. Without either, p is ``vector`` itself."""
    numel = vector.numel()
    sums = torch.empty(codec.buckets(numel), dtype=torch.float64)
    p = vector if residual is None and momentum is None else torch.empty_like(vector)
    accelerate = (_NONE, 0.0, False, _NONE) if momentum is None else \
        (momentum.buffer.reshape(-1).numpy(), momentum.mu, momentum.nesterov,
         momentum.out.view(-1).numpy())
    _kernels().compensated_block_l1(vector.detach().numpy(), *accelerate,
                                    _NONE if residual is None else residual.numpy(), ratio,
                                    codec.bucket_length(numel), p.detach().numpy(),
                                    sums.numpy())
    return p, codec.scale_from_sums(sums, numel)


def signs_with_feedback(codec, p, scale):
    """``BlockSign.encode``, packing, and the residual p - decode(codes) that
    ``ErrorFeedback.update`` keeps, in one pass: (packed signs, residual)."""
    packed = torch.empty(-(-p.numel() // 8), dtype=torch.uint8)
    residual = torch.empty_like(p)
    _kernels().signs_with_feedback(p.detach().numpy(), scale.numpy(),
                                   codec.bucket_length(p.numel()), packed.numpy(),
                                   residual.numpy())
    return packed, residual


def server_step(server, codec, bits, scales, count, numel):
    """``ServerStep`` of a server (of one shard, or replicated over a whole tensor) whose
    workers each sent their ``numel`` signs (rows of ``bits``) under one scale each
    (``scales``): the average, the server residual and the second compression. Returns
    (packed signs, scale) and proposes the new server residual."""
    p = torch.empty(numel, dtype=torch.float32)
    sums = torch.empty(codec.buckets(numel), dtype=torch.float64)
    previous = server.memory.residuals.get(server.key)
    _kernels().averaged_block_l1(bits.numpy(), scales.contiguous().numpy(), count,
                                 _NONE if previous is None else previous.numpy(), server.ratio,
                                 codec.bucket_length(numel), p.numpy(), sums.numpy())
    scale = codec.scale_from_sums(sums, numel)
    packed, residual = signs_with_feedback(codec, p, scale)
    server.memory.propose(server.key, residual)
    return packed, scale


def scaled_signs(bits, scales, numel):
    """``packing.unpack_scaled_signs``: the first ``numel`` signs of each row of ``bits``
    times that row's scale, as float32 rows."""
    out = torch.empty(bits.shape[0], numel, dtype=torch.float32)
    _kernels().scaled_signs(bits.numpy(), scales.reshape(-1).contiguous().numpy(), out.numpy())
    return out
