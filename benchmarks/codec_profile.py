"""Where a codec's own time goes on one worker: each stage of a step of the synthetic
ResNet-50's gradients, timed on one thread with no network.

Times are the thread's CPU time (``time.thread_time``), not wall time, so that other jobs
sharing the machine's cores do not count (they still slow the caches down somewhat).

    OMP_NUM_THREADS=1 python -m benchmarks.codec_profile [--codecs terngrad,qsgd-inf,ef-sign]

Stages, summed over the tensors the codec compresses (the others are sent whole): the scale
(``local_scale``), the random draws of stochastic codecs, ``encode``, packing the codes, and
on the receiving side unpacking one worker's worth of codes, ``values`` and ``decode``. A
sharded exchange unpacks twice (the shards, then the summed shards) and packs the sums; an
allgather unpacks N rows: multiply the receiving stages accordingly.
"""
import argparse
import time

import torch

import hvd_compress.pt as hc
from hvd_compress.pt.optimizer import _classifier_names
from hvd_compress.pt.packing import pack, unpack
from hvd_compress.registry import resolve

from .models import SyntheticResNet50

STAGES = ("scale", "random draws", "encode", "pack", "unpack", "values", "decode")


def compressed_shapes(codec, named_parameters):
    """The shapes of the parameters ``codec`` compresses (the others are sent whole)."""
    whole = set() if codec.compress_classifier else _classifier_names(named_parameters)
    return [p.shape for n, p in named_parameters
            if codec.compresses(p.numel()) and n not in whole]


def profile(codec, shapes, repeats=2):
    """Seconds per stage (best of ``repeats``) for gradients of ``shapes``."""
    best = dict.fromkeys(STAGES, float("inf"))
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator).reshape(-1) for shape in shapes]
    for _ in range(repeats):
        spent = dict.fromkeys(STAGES, 0.0)

        def timed(stage, function, *args):
            start = time.thread_time()
            out = function(*args)
            spent[stage] += time.thread_time() - start
            return out
        for grad in grads:
            scale = timed("scale", codec.local_scale, grad)
            uniforms = timed("random draws", torch.rand, grad.shape) if codec.stochastic \
                else None
            codes = timed("encode", codec.encode, grad, scale, uniforms)
            packed = timed("pack", pack, codes.reshape(1, -1), codec.code_space)
            received = timed("unpack", unpack, packed, codec.code_space, grad.numel())
            values = timed("values", codec.values, received)
            timed("decode", codec.decode, values, scale, 1)
        best = {stage: min(best[stage], spent[stage]) for stage in STAGES}
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="terngrad,qsgd-inf,ef-sign")
    args = parser.parse_args(argv)
    named = list(SyntheticResNet50().named_parameters())
    rows = ["| codec | elements compressed | " + " | ".join(STAGES) + " | total |",
            "|" + "---|" * (len(STAGES) + 3)]
    for name in args.codecs.split(","):
        codec = resolve(name, hc.CODECS)
        shapes = compressed_shapes(codec, named)
        seconds = profile(codec, shapes)
        numel = sum(torch.Size(s).numel() for s in shapes)
        rows.append(f"| {name} | {numel:,} | " +
                    " | ".join(f"{1000 * seconds[s]:.0f}" for s in STAGES) +
                    f" | {1000 * sum(seconds.values()):.0f} |")
    print("CPU milliseconds per step, one thread:\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
