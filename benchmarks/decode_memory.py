"""Peak memory of the allgather's eager decode (what CUDA tensors run) against the number of
workers N: every worker's packed codes arrive, and the decode must not hold N unpacked
copies of the tensor.

For each codec and N it builds the gathered payloads of a tensor of ``--numel`` float32
elements in a fresh process (whose allocator maps every large block on allocation and
unmaps it on release, so that resident memory follows live memory), resets the
process's peak resident size (``/proc/self/clear_refs``), decodes, and reports the peak's
growth over the resident size before the decode, in MB and in multiples of the tensor's
float32 size:

    python -m benchmarks.decode_memory [--numel 10000000] [--workers 2,4,8,16]

Linux only (``/proc``); one thread is enough.
"""

import argparse
import json
import os
import subprocess
import sys

CODECS = ("terngrad", "qsgd")  # a shared scale and each worker's own scales


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(codec_name, numel, workers):
    """Peak resident growth (bytes) of one eager decode, in this process."""
    os.environ["HVD_COMPRESS_KERNELS"] = "0"
    import numpy as np
    import torch

    import hvd_compress.pt as hc
    from hvd_compress.pt.exchange import Allgather, Meter
    from hvd_compress.pt.packing import pack

    codec = hc.CODECS[codec_name](min_size=0)
    exchange = Allgather(codec, numel, workers, Meter(), workers)
    space = codec.code_space
    rng = np.random.default_rng(0)
    codes = torch.from_numpy(
        rng.integers(-space.bound, space.bound + 1, (workers, numel), dtype=np.int8)
    )
    packed = pack(codes, space)
    del codes
    scales = torch.ones(workers, codec.buckets(numel) if exchange.own_scale else 0)
    gathered = torch.cat([scales.view(torch.uint8), packed], dim=1)
    del packed
    scale = None if exchange.own_scale else torch.ones(1)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    decoded = exchange.decode(gathered, scale)
    peak = _status("VmHWM") - before
    assert decoded.shape == (numel,)
    return peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument(
        "--measure", nargs=3, metavar=("CODEC", "NUMEL", "N"), help=argparse.SUPPRESS
    )  # one measurement, in a child process
    args = parser.parse_args(argv)
    if args.measure:
        codec, numel, workers = args.measure
        print(json.dumps(measure(codec, int(numel), int(workers))))
        return
    # Blocks of 64 kB and more mapped on allocation and unmapped on release, always (a
    # fixed threshold turns off glibc's raising it after a release).
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_=str(64 << 10),
        MALLOC_TRIM_THRESHOLD_=str(64 << 10),
    )
    tensor = 4 * args.numel
    print(
        f"Peak memory of the allgather's eager decode, {args.numel:,} float32 elements "
        f"({tensor / 1e6:.0f} MB):\n"
    )
    print("| codec | N | peak growth (MB) | x the tensor |\n|---|---|---|---|")
    for codec in CODECS:
        for workers in args.workers.split(","):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.decode_memory",
                    "--measure",
                    codec,
                    str(args.numel),
                    workers,
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            ).stdout
            peak = json.loads(out.strip().splitlines()[-1])
            print(f"| {codec} | {workers} | {peak / 1e6:,.0f} | {peak / tensor:.1f} |")


if __name__ == "__main__":
    main()
