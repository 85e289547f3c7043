"""Each codec's time on the gradients' device for one worker's share of a step, against one
device copy of the same gradients.

For the synthetic ResNet-50's gradients that a codec compresses: the encoding and the decode
of one worker's codes as the pipeline's allgather makes them (``codec_profile``'s calls:
Triton's kernels for CUDA tensors of TernGrad and the QSGD family, the eager ops for the
others), and ``copy_`` of every gradient into a tensor of its own, called in turn and timed each by
CUDA events on a GPU (the device's time, waited for after each call), by the wall clock
elsewhere; the best of ``--repeats``. ``make gpu-check`` runs it on a GPU:

    python -m benchmarks.device_time [--device cuda] [--codecs terngrad,qsgd-inf,nuqsgd,ef-sign]
"""

import argparse
import time

import torch

import hvd_compress.pt as hc
from hvd_compress.fused import quantizes
from hvd_compress.pt import fused
from hvd_compress.registry import resolve

from .codec_profile import _eager_quantizer, _fused_quantizer, compressed_shapes
from .models import SyntheticResNet50


def seconds_of(function, device):
    """The seconds one call of ``function`` takes on ``device``."""
    if device.type != "cuda":
        start = time.perf_counter()
        function()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def best_of_turns(functions, device, repeats):
    """The least seconds of each of ``functions`` over ``repeats`` rounds that call each in
    turn, after a round that compiles and allocates."""
    for function in functions:
        function()
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for i, function in enumerate(functions):
            best[i] = min(best[i], seconds_of(function, device))
    return best


def _on_kernels(codec, grad):
    """Whether kernels encode and decode ``codec``'s quantized codes of ``grad``."""
    return quantizes(codec) and fused.applies(codec, grad)


def codec_work(codec, grads):
    """One worker's encoding and decoding of ``grads`` as the pipeline's allgather makes
    them on their device."""
    work = _fused_quantizer if _on_kernels(codec, grads[0]) else _eager_quantizer
    return lambda: [work(codec, grad) for grad in grads]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,nuqsgd,ef-sign")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    named = list(SyntheticResNet50().named_parameters())
    generator = torch.Generator().manual_seed(0)
    print(
        f"Device time of one worker's encoding and decoding, synthetic ResNet-50, {device} "
        f"(best of {args.repeats}):\n\n| codec | path | codec ms | copy ms | codec / copy |\n"
        "|---|---|---|---|---|"
    )
    for name in args.codecs.split(","):
        codec = resolve(name, hc.CODECS)
        grads = [
            torch.randn(shape, generator=generator).reshape(-1).to(device)
            for shape in compressed_shapes(codec, named)
        ]
        path = "kernels" if _on_kernels(codec, grads[0]) else "eager ops"
        copies = [torch.empty_like(grad) for grad in grads]

        def copy():
            for out, grad in zip(copies, grads):
                out.copy_(grad)

        spent, copied = best_of_turns([codec_work(codec, grads), copy], device, args.repeats)
        print(
            f"| {name} | {path} | {spent * 1e3:.2f} | {copied * 1e3:.2f} | {spent / copied:.1f} |"
        )


if __name__ == "__main__":
    main()
