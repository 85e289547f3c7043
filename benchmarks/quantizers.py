"""Variance and bits per element of the QSGD family, and what Elias coding costs.

    python -m benchmarks.quantizers            (OMP_NUM_THREADS=1 for one-core timings)

Prints three Markdown tables:
1. the measured relative variance E||Q(v) - v||^2 / ||v||^2 of each codec at 4 bits on
   d = 8192 Gaussian vectors (one bucket), beside the papers' bounds;
2. the extra variance of the shared-scale (summable) variant: each bucket quantized under the
   Max of 4 workers' scales instead of its own;
3. bits per element on the wire for each wire option (codes and scales), the PyTorch time to
   pack and unpack a million codes on this CPU (the quantization itself is the same for both
   and left out), and the bandwidth below which Elias coding saves time on an allgather among
   4 workers.
"""

import time

import numpy as np
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress.pt import elias
from hvd_compress.pt.packing import pack, unpack
from hvd_compress.qsgd import nuqsgd_variance_bound, qsgd_variance_bound


def relative_variance(codec, vectors, draws, rng, scales=None):
    errors, norms = 0.0, 0.0
    for i, v in enumerate(vectors):
        scale = codec.local_scale(v) if scales is None else scales[i]
        for _ in range(draws):
            decoded = codec.decode(
                codec.values(codec.encode(v, scale, rng.random(v.size))), scale, 1
            )
            errors += np.sum((decoded.astype(np.float64) - v) ** 2)
            norms += np.sum(v.astype(np.float64) ** 2)
    return errors / norms


def variance_table(rng):
    d = 8192
    vectors = [rng.standard_normal(d).astype(np.float32) for _ in range(10)]
    rows = ["| codec (4 bits, d = 8192) | levels | measured | bound |", "|---|---|---|---|"]
    for codec, bound in [
        (hvd_compress.QSGD(bits=4, bucket_size=d), qsgd_variance_bound(d, 7)),
        (hvd_compress.QSGDInf(bits=4, bucket_size=d), None),
        (hvd_compress.NUQSGD(bits=4, bucket_size=d), nuqsgd_variance_bound(d, 6)),
    ]:
        levels = "0, 1/7, ..., 1" if codec.name != "nuqsgd" else "0, 1/64, ..., 1/2, 1"
        measured = relative_variance(codec, vectors, 20, rng)
        rows.append(
            f"| {codec.name} | {levels} | {measured:.3f} | "
            f"{'-' if bound is None else f'{bound:.3f}'} |"
        )
    return "\n".join(rows)


def shared_scale_table(rng, workers=4):
    rows = [
        "| codec (4 bits) | bucket | own scales | shared (Max of 4) | ratio |",
        "|---|---|---|---|---|",
    ]
    for codec in (
        hvd_compress.QSGDInf(bits=4, bucket_size=512),
        hvd_compress.NUQSGD(bits=4, bucket_size=8192),
    ):
        # Workers' gradients: a common signal plus independent noise, as in data parallelism.
        common = rng.standard_normal(65536).astype(np.float32)
        grads = [common + rng.standard_normal(65536).astype(np.float32) for _ in range(workers)]
        shared = np.max(np.stack([codec.local_scale(g) for g in grads]), axis=0)
        own = relative_variance(codec, grads, 5, rng)
        both = relative_variance(codec, grads, 5, rng, scales=[shared] * workers)
        rows.append(
            f"| {codec.name} | {codec.bucket_size} | {own:.3f} | {both:.3f} | {both / own:.2f}x |"
        )
    return "\n".join(rows)


def _seconds(function, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def wire_table(numel=1_000_000, workers=4, seed=0):
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    uniforms = torch.rand(numel, generator=torch.Generator().manual_seed(seed + 1))
    rows = [
        "| codec | wire | bits/element | pack + unpack, ms per 1M | Elias pays below |",
        "|---|---|---|---|---|",
    ]
    for codec in (hc.QSGD(), hc.QSGDInf(), hc.NUQSGD(), hc.QSGDInf(bits=2, bucket_size=128)):
        scale = codec.local_scale(grad)
        codes = codec.encode(grad, scale, uniforms)
        scale_bits = 32 * codec.buckets(numel)
        fixed_bits = 8 * codec.code_space.packed_nbytes(numel) + scale_bits
        fixed_time = _seconds(
            lambda: unpack(pack(codes.reshape(1, -1), codec.code_space), codec.code_space, numel)
        )
        data = elias.encode(codes)
        elias_bits = 8 * data.numel() + scale_bits
        elias_time = _seconds(lambda: elias.decode(elias.encode(codes), numel), repeat=1)
        # An allgather moves (workers - 1) payloads into every worker.
        saved_bits = (workers - 1) * (fixed_bits - elias_bits)
        extra = elias_time - fixed_time
        pays = (
            f"{saved_bits / extra / 1e6:.0f} Mbit/s"
            if saved_bits > 0 and extra > 0
            else ("never" if saved_bits <= 0 else "always")
        )
        name = f"{codec.name} {codec.bits}-bit d={codec.bucket_size}"
        rows.append(f"| {name} | fixed | {fixed_bits / numel:.3f} | {1000 * fixed_time:.0f} | |")
        rows.append(
            f"| {name} | elias | {elias_bits / numel:.3f} | {1000 * elias_time:.0f} | {pays} |"
        )
    return "\n".join(rows)


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("Relative variance E||Q(v) - v||^2 / ||v||^2, 10 Gaussian vectors x 20 draws:\n")
    print(variance_table(rng))
    print("\nExtra variance of the shared-scale (summable) variant, 4 workers:\n")
    print(shared_scale_table(rng))
    print("\nWire options on a 1M-element Gaussian gradient (PyTorch, CPU, 1 thread):\n")
    print(wire_table())


if __name__ == "__main__":
    main()
