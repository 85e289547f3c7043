"""ef-sign's worker and server work on one thread, eager ops against the fused kernels
(``hvd_compress.pt.fused``), for the synthetic ResNet-50's compressed gradients.

    OMP_NUM_THREADS=1 python -m benchmarks.kernel_profile

Each stage is timed as the pipeline runs it, best of ``--repeats`` (after one call that
compiles the kernels); wall time, so run it on an otherwise idle machine.
"""

import argparse
import time

import torch

import hvd_compress.pt as hc
from hvd_compress.pt import fused
from hvd_compress.pt.memory import ErrorFeedback
from hvd_compress.pt.momentum import WorkerMomentum
from hvd_compress.pt.packing import pack, unpack_scaled_signs
from hvd_compress.server import ServerStep

from .models import SyntheticResNet50
from .profiling import best_seconds, compressed_shapes, server_messages

MU = 0.9


def eager_worker(codec, grad, buffer, residual):
    """WorkerMomentum's, ErrorFeedback's and BlockSign's eager calls, as the pipeline makes
    them for one tensor."""
    u = grad.clone()
    m = torch.add(u, buffer, alpha=MU)
    u.add_(m, alpha=MU)
    memory = ErrorFeedback()
    memory.residuals["x"] = residual
    p = memory.compensate("x", u)
    scale = codec.local_scale(p)
    codes = codec.encode(p, scale, None)
    memory.update("x", p, codec.decode(codec.values(codes), scale, 1))
    return pack(codes.reshape(1, -1), codec.code_space)


def fused_worker(codec, grad, buffer, residual):
    momentum = WorkerMomentum.Deferred(buffer, MU, True, torch.empty_like(grad))
    p, scale = fused.compensated_scale(codec, grad, residual, 1.0, momentum=momentum)
    # p is the compensation's own buffer, as in the pipeline: the residual goes over it.
    return fused.signs_with_feedback(codec, p, scale, in_place=True)


def eager_server(codec, messages, residual):
    """The sharded server's eager calls for one shard of ``messages`` (rows: a worker's
    one scale, then its signs): decode, average, ``ServerStep``."""
    scales, bits = messages[:, :4].contiguous().view(torch.float32), messages[:, 4:]
    average = unpack_scaled_signs(bits, scales, residual.numel()).sum(dim=0) / len(bits)
    memory = ErrorFeedback()
    memory.residuals["s"] = residual
    codes, _, _ = ServerStep(memory, "s")(codec, average)
    return pack(codes.reshape(1, -1), codec.code_space)


def fused_server(codec, messages, residual):
    memory = ErrorFeedback()
    memory.residuals["s"] = residual
    return fused.server_step(
        ServerStep(memory, "s"), codec, messages, 4, 0, len(messages), residual.numel()
    )


def _best(function, repeats):
    return 1000 * best_seconds(function, repeats, time.perf_counter)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    codec = hc.BlockSign()
    named = list(SyntheticResNet50().named_parameters())
    generator = torch.Generator().manual_seed(0)
    tensors = [
        [torch.randn(shape.numel(), generator=generator) for _ in range(3)]
        for shape in compressed_shapes(codec, named)
    ]
    numel = sum(grad.numel() for grad, _, _ in tensors)
    # The final decode of one sharded exchange: 4 servers' shards of every tensor's signs.
    shards = [
        (torch.randint(0, 256, (4, -(-grad.numel() // 32)), dtype=torch.uint8), torch.rand(4, 1))
        for grad, _, _ in tensors
    ]
    servers = [
        (server_messages(bits, scales), torch.randn(bits.shape[1] * 8, generator=generator))
        for bits, scales in shards
    ]
    rows = [
        (
            "worker: momentum, compensation, scales, signs, packing, residual",
            lambda: [eager_worker(codec, *t) for t in tensors],
            lambda: [fused_worker(codec, *t) for t in tensors],
        ),
        (
            "server of one shard (N = 4): average, compensation, scales, signs, residual",
            lambda: [eager_server(codec, *s) for s in servers],
            lambda: [fused_server(codec, *s) for s in servers],
        ),
        (
            "final decode of the servers' signs",
            lambda: [unpack_scaled_signs(b, s, b.shape[1] * 8) for b, s in shards],
            lambda: [fused.scaled_signs(b, s, b.shape[1] * 8) for b, s in shards],
        ),
    ]
    print(f"{len(tensors)} tensors, {numel:,} elements, one thread, best of {args.repeats}:")
    print("| stage | eager ops (ms) | kernels (ms) |\n|---|---|---|")
    for label, eager, kernels in rows:
        print(
            f"| {label} | {_best(eager, args.repeats):.0f} | {_best(kernels, args.repeats):.0f} |"
        )


if __name__ == "__main__":
    main()
