#!/usr/bin/env bash
# `make gpu-check`: what a machine with CUDA GPUs checks that this project's CPU machines
# cannot, in about 10 minutes, each part under a hard timeout:
#   1. the CUDA variants of the tests (every test that takes a device, and the Triton
#      kernels compiled on CUDA against the eager ops); the multi-process ones need a GPU
#      per rank, so with one GPU only the single-process ones run;
#   2. the launches and host syncs compression adds to a step of the synthetic ResNet-50 on
#      the GPUs (benchmarks/op_count.py --device cuda);
#   3. each codec's device time against one device copy of the gradients, by CUDA events
#      (benchmarks/device_time.py);
#   4. where TensorFlow sees the GPU: its XLA-compiled calls on GPU tensors against its
#      uncompiled ops, bit for bit (tests/test_tf_kernels.py), and the TensorFlow ops a
#      ResNet-50 step runs on each path (benchmarks/tf_op_count.py).
# Run it in the environment of `make gpu-build` (HVD_COMPRESS_VENV, default .venv-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${HVD_COMPRESS_VENV:-.venv-gpu}"
PY="$VENV/bin/python"
source launch/worker_env.sh

if ! gpus="$(nvidia-smi -L 2>/dev/null | grep -c GPU)" || [ "$gpus" -eq 0 ]; then
    echo "gpu-check: no CUDA GPU here (nvidia-smi lists none)" >&2
    exit 2
fi
if [ ! -x "$PY" ]; then
    echo "gpu-check: no environment at $VENV: run make gpu-build first" >&2
    exit 2
fi
ranks=$((gpus >= 2 ? 2 : 1))
status=0
part() {
    echo "== gpu-check: $1"
    shift
    "$@" || status=$?
}

if [ "$ranks" -eq 2 ]; then markers="cuda or triton"; else markers="(cuda or triton) and not multiprocess"; fi
part "CUDA variants of the tests" timeout 420 "$PY" -m pytest -ra -q -k "$markers" tests
part "launches and syncs per step, ResNet-50, N = $ranks" timeout 180 \
    "$VENV/bin/horovodrun" -np "$ranks" -H "localhost:$ranks" --gloo \
    "$PY" -m benchmarks.op_count --device cuda
part "device time per codec" timeout 120 "$PY" -m benchmarks.device_time --device cuda
# TensorFlow places the tests' tensors on its first GPU, where fused.py sends them to XLA.
if "$PY" -c "import sys, tensorflow as tf; sys.exit(not tf.config.list_physical_devices('GPU'))"; then
    part "TensorFlow's compiled calls on the GPU against its ops" timeout 600 \
        "$PY" -m pytest -ra -q tests/test_tf_kernels.py -k "compiled_calls or kernels_are"
    part "TensorFlow ops per step, ResNet-50, N = $ranks" timeout 600 \
        "$VENV/bin/horovodrun" -np "$ranks" -H "localhost:$ranks" --gloo \
        "$PY" -m benchmarks.tf_op_count --paths xla,ops
else
    # As in .venv-gpu, whose TensorFlow lacks its CUDA 12 libraries (docs/building-horovod.md).
    echo "== gpu-check: TensorFlow sees no GPU in $VENV: its compiled path was not checked" \
        "(run this with HVD_COMPRESS_VENV set to a venv of tensorflow[and-cuda])" >&2
fi
exit "$status"
