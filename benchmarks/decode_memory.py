"""Peak memory of the allgather's decode on the device path against the number of workers
N: every worker's packed codes arrive, and the decode must not hold N unpacked copies of
the tensor. PyTorch's eager decode (what CUDA tensors run without the Triton kernels) and
TensorFlow's XLA-compiled one (``hvd_compress.tf.xla_fused``, what GPU tensors run), with
TensorFlow's uncompiled ops beside them.

For each port, codec and N it builds the gathered payloads of a tensor of ``--numel``
float32 elements in a fresh process (whose allocator maps every large block on allocation
and unmaps it on release, so that resident memory follows live memory), decodes once to
compile (TensorFlow), resets the process's peak resident size (``/proc/self/clear_refs``),
decodes, and reports the peak's growth over the resident size before the decode, in MB and
in multiples of the tensor's float32 size:

    python -m benchmarks.decode_memory [--numel 10000000] [--workers 2,4,8,16] \
        [--paths torch,tf-xla,tf-ops]

Linux only (``/proc``); one thread is enough.
"""

import argparse
import json
import os
import subprocess
import sys

CODECS = ("terngrad", "qsgd")  # a shared scale and each worker's own scales
# --paths: name -> (the table's label, HVD_COMPRESS_KERNELS of the measuring process).
PATHS = {
    "torch": ("PyTorch, eager ops", "0"),
    "tf-xla": ("TensorFlow, XLA-compiled", "xla"),
    "tf-ops": ("TensorFlow, uncompiled ops", "0"),
}


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak(decode):
    """Peak resident growth (bytes) while ``decode()`` runs, and what it returned."""
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    decoded = decode()
    return _status("VmHWM") - before, decoded


def _codes(space, workers, numel):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(-space.bound, space.bound + 1, (workers, numel), dtype=np.int8)


def measure(path, codec_name, numel, workers):
    """Peak resident growth (bytes) of one decode on ``path``, in this process (whose
    ``HVD_COMPRESS_KERNELS`` is the path's)."""
    if path == "torch":
        return _measure_torch(codec_name, numel, workers)
    return _measure_tf(codec_name, numel, workers)


def _measure_torch(codec_name, numel, workers):
    import torch

    import hvd_compress.pt as hc
    from hvd_compress.pt.exchange import Allgather, Meter
    from hvd_compress.pt.packing import pack

    codec = hc.CODECS[codec_name](min_size=0)
    exchange = Allgather(codec, numel, workers, Meter(), workers)
    packed = pack(torch.from_numpy(_codes(codec.code_space, workers, numel)), codec.code_space)
    scales = torch.ones(workers, codec.buckets(numel) if exchange.own_scale else 0)
    gathered = torch.cat([scales.view(torch.uint8), packed], dim=1)
    del packed
    scale = None if exchange.own_scale else torch.ones(1)
    peak, decoded = _peak(lambda: exchange.decode(gathered, scale))
    assert decoded.shape == (numel,)
    return peak


def _measure_tf(codec_name, numel, workers):
    import tensorflow as tf

    import hvd_compress.tf as htf
    from hvd_compress.tf import xla_fused
    from hvd_compress.tf.exchange import Allgather, Meter
    from hvd_compress.tf.packing import pack

    codec = htf.CODECS[codec_name](min_size=0)
    exchange = Allgather(codec, numel, workers, Meter(), workers)
    packed = pack(tf.constant(_codes(codec.code_space, workers, numel)), codec.code_space)
    scales = tf.ones([workers, codec.buckets(numel) if exchange.own_scale else 0])
    gathered = tf.concat([tf.reshape(tf.bitcast(scales, tf.uint8), [workers, -1]), packed], 1)
    del packed
    # The worker's own scale, which its exchange passes on whether or not it is shared.
    scale = tf.ones([codec.buckets(numel)])
    before = xla_fused.calls
    exchange.finish((gathered, scale))  # compiles the decode, on the XLA path
    peak, decoded = _peak(lambda: exchange.finish((gathered, scale)))
    assert decoded.shape == (numel,)
    assert (xla_fused.calls > before) == xla_fused.ON_CPU  # the path measured is the one named
    return peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    parser.add_argument(
        "--measure", nargs=4, metavar=("PATH", "CODEC", "NUMEL", "N"), help=argparse.SUPPRESS
    )  # one measurement, in a child process
    args = parser.parse_args(argv)
    if args.measure:
        path, codec, numel, workers = args.measure
        print(json.dumps(measure(path, codec, int(numel), int(workers))))
        return
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {', '.join(unknown)}")
    # Blocks of 64 kB and more mapped on allocation and unmapped on release, always (a
    # fixed threshold turns off glibc's raising it after a release). TensorFlow's oneDNN
    # build allocates large blocks from a pool it keeps, which would hide the decode's
    # memory behind the compiling call's; without oneDNN it allocates with malloc.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_=str(64 << 10),
        MALLOC_TRIM_THRESHOLD_=str(64 << 10),
        TF_ENABLE_ONEDNN_OPTS="0",
    )
    tensor = 4 * args.numel
    print(
        f"Peak memory of the allgather's decode, {args.numel:,} float32 elements "
        f"({tensor / 1e6:.0f} MB):\n"
    )
    print("| path | codec | N | peak growth (MB) | x the tensor |\n|---|---|---|---|---|")
    for path in paths:
        label, kernels = PATHS[path]
        for codec in CODECS:
            for workers in args.workers.split(","):
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.decode_memory",
                        "--measure",
                        path,
                        codec,
                        str(args.numel),
                        workers,
                    ],
                    env=dict(env, HVD_COMPRESS_KERNELS=kernels),
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=600,
                ).stdout
                peak = json.loads(out.strip().splitlines()[-1])
                print(
                    f"| {label} | {codec} | {workers} | {peak / 1e6:,.0f} | {peak / tensor:.1f} |"
                )


if __name__ == "__main__":
    main()
