#!/usr/bin/env bash
# Idempotent set-up of the development environment on Debian/Ubuntu:
#   OpenMPI (system packages) -> .venv with torch, TensorFlow, mnist1d ->
#   Horovod 0.28.1 built from its PyPI sdist (cached as a wheel outside the repo) ->
#   hvd_compress installed editable.
# A second run on the same machine takes seconds: the Horovod wheel is reused.
#
# Environment:
#   HVD_COMPRESS_VENV   where the venv goes            (default: <repo>/.venv)
#   HVD_COMPRESS_CACHE  where built wheels are cached  (default: ~/.cache/hvd_compress)
#   HVD_COMPRESS_GPU    auto (default): the GPU build where nvidia-smi lists a GPU and nvcc
#                       is on PATH; 1: the GPU build; 0: the CPU build. The GPU build
#                       (`make gpu-build`, into .venv-gpu) installs torch's CUDA build with
#                       the NCCL it pins (launch/requirements-gpu.txt) and builds
#                       Horovod with nvcc and NCCL (HOROVOD_GPU_OPERATIONS=NCCL), and
#                       TensorFlow's CUDA build without its CUDA 12 libraries (they collide
#                       with torch's CUDA 13 ones). It builds, imports and passes the CPU tests
#                       on a machine without a GPU; nothing has run on a GPU yet
#                       (docs/building-horovod.md, "The CUDA build").
#   HOROVOD_BUILD_CUDA_CC_LIST  GPU build: the compute capabilities Horovod's CUDA kernels are
#                       compiled for, e.g. 80,90 (default: every one this nvcc supports).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_COMPRESS_VENV:-$REPO/.venv}"
CACHE="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd_compress}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
UV_VERSION=0.13.9

log() { printf '[setup] %s\n' "$*"; }

case "${HVD_COMPRESS_GPU:-auto}" in
    0) GPU=0 ;;
    1) GPU=1 ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU &&
              command -v nvcc >/dev/null 2>&1; then GPU=1; else GPU=0; fi ;;
    *) echo "HVD_COMPRESS_GPU must be auto, 0 or 1, got '$HVD_COMPRESS_GPU'" >&2; exit 2 ;;
esac
if [ "$GPU" = 1 ] && ! command -v nvcc >/dev/null 2>&1; then
    echo "the GPU build needs the CUDA toolkit's nvcc on PATH" >&2
    exit 1
fi

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# The launchers and engines the tests start for real (tests/test_launchers.py): sshd for
# `horovodrun -H` and `mpirun -H` over ssh, a one-machine Slurm cluster (slurmctld, slurmd,
# MUNGE), and the Java runtime of Spark (pyspark, launch/requirements.txt).
LAUNCHER_PACKAGES=(openssh-server openssh-client slurmctld slurmd slurm-client munge
    openjdk-17-jre-headless)

install_system_packages() {
    local missing=()
    for pkg in libopenmpi-dev openmpi-bin cmake g++ iproute2 "${LAUNCHER_PACKAGES[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing system packages: ${missing[*]}"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# launch/requirements.txt; for the GPU build with TensorFlow's CUDA build (tensorflow, not
# tensorflow-cpu: Horovod's TensorFlow library, compiled with its GPU kernels, needs the GPU
# functors only that build exports) and launch/requirements-gpu.txt (PyPI's torch wheel for
# Linux is its CUDA build; that file pins the NCCL it requires).
requirements() {
    if [ "$GPU" = 1 ]; then
        sed 's/^tensorflow-cpu==/tensorflow==/' "$REPO/launch/requirements.txt"
        cat "$REPO/launch/requirements-gpu.txt"
    else
        cat "$REPO/launch/requirements.txt"
    fi
}

create_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        python3 -m venv "$VENV"
    fi
    if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
        "$VENV/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
    fi
    # A stamp of the requirements skips the no-op resolution on re-runs.
    local stamp="$VENV/.hvd_compress-requirements" want file
    want="$( (requirements; echo "tf_keras==$TF_VERSION") | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        log "installing Python packages (launch/requirements.txt, $([ "$GPU" = 1 ] && echo GPU || echo CPU) build)"
        file="$(mktemp --suffix=.txt)"
        requirements > "$file"
        install_packages -r "$file"
        rm -f "$file"
        # Keras 2, for the tests of the Keras wrapper under TF_USE_LEGACY_KERAS=1. It
        # requires the "tensorflow" distribution, which tensorflow-cpu provides under
        # another name: installed without its dependencies.
        install_packages --no-deps "tf_keras==$TF_VERSION"
        echo "$want" > "$stamp"
    fi
}

# The value pip is configured with for option $1 (its environment variable, else its
# configuration files), empty if none.
pip_option() {
    local variable="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!variable:-}" ]; then
        echo "${!variable}"
    else
        "$VENV/bin/pip" config get "global.$1" 2>/dev/null || true
    fi
}

# uv installs into the venv what pip would: from its cache it links the files instead of
# unpacking every wheel again, and compiles their bytecode on every core. uv does not read
# pip's configuration, so the index and the local wheel directories this machine gives pip
# are handed to it (here a CPU-only torch wheel, which PyPI's index for Linux does not
# have); they are looked up once, at the first install. The GPU build leaves the local
# wheel directories out: torch==2.13.0 also matches a local 2.13.0+cpu wheel, which uv
# prefers to PyPI's CUDA build.
UV_OPTIONS=()
install_packages() {
    local index link
    if [ "${#UV_OPTIONS[@]}" -eq 0 ]; then
        UV_OPTIONS=(--python "$VENV/bin/python" --quiet --compile-bytecode)
        index="$(pip_option index-url)"
        if [ -n "$index" ]; then UV_OPTIONS+=(--default-index "$index"); fi
        if [ "$GPU" = 0 ]; then
            for link in $(pip_option find-links); do UV_OPTIONS+=(--find-links "$link"); done
        fi
    fi
    "$VENV/bin/uv" pip install "${UV_OPTIONS[@]}" "$@"
}

# The NCCL the GPU build links: HOROVOD_NCCL_HOME if set, the system's (libnccl-dev), or
# the one torch's CUDA wheel brings (nvidia-nccl-cu13, launch/requirements-gpu.txt). That
# one is a namespace package (no __file__) whose library lacks the unversioned name CMake
# looks for, so links to it are made in the venv's hvd_compress-nccl/: the link directory
# becomes part of the Horovod libraries' RUNPATH, so it has to outlive the build, and it
# holds libnccl.so.2 too, the name the libraries load (horovod.tensorflow loads it before
# anything else in the process has).
nccl_environment() {
    local links="$VENV/hvd_compress-nccl" nccl
    if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e /usr/include/nccl.h ]; then
        return
    fi
    nccl="$("$VENV/bin/python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
    if [ -z "$nccl" ] || [ ! -e "$nccl/include/nccl.h" ]; then
        echo "the GPU build needs NCCL: set HOROVOD_NCCL_HOME or install libnccl-dev" >&2
        exit 1
    fi
    mkdir -p "$links"
    ln -sf "$nccl/lib/libnccl.so.2" "$links/libnccl.so"
    ln -sf "$nccl/lib/libnccl.so.2" "$links/libnccl.so.2"
    export HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$links"
    export HOROVOD_NCCL_LINK=SHARED
}

# The CUDA toolkit of the nvcc on PATH, from nvcc itself: `nvcc` may be a wrapper script
# outside the toolkit, so its own directory is not the answer.
cuda_home() {
    nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's|^#\$ TOP=\(.*\)/bin/\.\.$|\1|p' | head -n 1
}

# Builds Horovod from its sdist with the three CMake edits that torch >= 2.1 and
# TensorFlow >= 2.19 need (see README, "Building Horovod"):
#   - everything compiled as C++17 (torch's headers demand it; gloo must match or the link
#     fails on a duplicate gloo::rendezvous::Store::kDefaultTimeout),
#   - the optional XLA ops source dropped (it no longer compiles against TF 2.21's headers).
build_horovod_wheel() {
    local wheel_dir="$1" work
    work="$(mktemp -d)"
    log "building Horovod $HOROVOD_VERSION (about $([ "$GPU" = 1 ] && echo 25 || echo 5) minutes on 2 cores)"
    "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$work" "horovod==$HOROVOD_VERSION"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
    local src="$work/horovod-$HOROVOD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    mkdir -p "$wheel_dir"
    if [ "$GPU" = 1 ]; then
        # TensorFlow's ops get their CUDA stream from stream_executor::gpu::AsGpuStreamValue,
        # which TensorFlow 2.21 no longer exports (not even its CUDA build): the library then
        # fails to load (undefined symbol). Stream::platform_specific_handle() replaces it.
        local ops="$src/horovod/tensorflow/mpi_ops.cc"
        sed -i '/^GpuStreamHandle AsGpuStreamValue(Stream\* stream);$/d' "$ops"
        sed -i '0,/^#endif \/\/ TENSORFLOW_VERSION >= 2011000000$/s//&\
namespace stream_executor { namespace gpu {\
inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {\
  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);\
} } }/' "$ops"
        grep -q 'platform_specific_handle' "$ops"
        nccl_environment
        export HOROVOD_GPU_OPERATIONS=NCCL
        export HOROVOD_CUDA_HOME="${HOROVOD_CUDA_HOME:-$(cuda_home)}"
        # Horovod finds the CUDA runtime to link the torch library with through torch's
        # cpp_extension, which takes CUDA_HOME, else nvcc's parent directory (for a wrapper
        # script outside the toolkit, one without libcudart: FOUND_LIB_cudart NOTFOUND).
        export CUDA_HOME="${CUDA_HOME:-$HOROVOD_CUDA_HOME}"
        log "CUDA toolkit $HOROVOD_CUDA_HOME, compute capabilities ${HOROVOD_BUILD_CUDA_CC_LIST:-all that nvcc supports}"
    fi
    # pip's cmake 4.x rejects the bundled gloo: the system cmake is used (PATH has /usr/bin).
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j"$(nproc)" \
        "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
        -w "$work/wheel" "$src"
    mv "$work"/wheel/horovod-*.whl "$wheel_dir/"
    rm -rf "$work"
}

install_horovod() {
    local py key wheel_dir
    py="$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    key="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_tf-${TF_VERSION}_${py}_$(uname -m)"
    if [ "$GPU" = 1 ]; then
        key="${key}_nccl_$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/cuda\1/p')"
        if [ -n "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
            key="${key}_sm${HOROVOD_BUILD_CUDA_CC_LIST//,/-}"
        fi
        # Its libraries find libnccl.so.2 through the RUNPATH of the venv that built them
        # (nccl_environment): a wheel per venv.
        key="${key}_venv-$(printf '%s' "$VENV" | sha256sum | cut -c1-8)"
    fi
    wheel_dir="$CACHE/$key"
    if "$VENV/bin/python" - "$HOROVOD_VERSION" "$GPU" <<'PY' 2>/dev/null; then
import sys, importlib.metadata as md
assert md.version("horovod") == sys.argv[1]
import horovod.torch, horovod.common.util as u
assert u.gloo_built() and u.mpi_built()
assert bool(u.nccl_built()) == (sys.argv[2] == "1")
PY
        log "Horovod $HOROVOD_VERSION already installed"
        return
    fi
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        build_horovod_wheel "$wheel_dir"
    else
        log "using cached wheel in $wheel_dir"
    fi
    install_packages --reinstall --no-deps "$wheel_dir"/horovod-*.whl
    install_packages cloudpickle psutil pyyaml packaging cffi
}

install_project() {
    # Checked from / so that the checkout's own hvd_compress/ directory cannot stand in for
    # the installed package (whose hvd_compress.pt, .tf and .examples map to pt/, tf/ and
    # examples/); an install older than one of these mappings is redone.
    if (cd / && "$VENV/bin/python" -c 'import sys, hvd_compress.pt as p, hvd_compress.examples as e; sys.exit(p.__file__ != sys.argv[1] or e.__file__ != sys.argv[2])' \
            "$REPO/pt/__init__.py" "$REPO/examples/__init__.py") 2>/dev/null; then
        return
    fi
    log "installing hvd_compress (editable)"
    install_packages --no-deps --no-build-isolation -e "$REPO"
}

install_system_packages
create_venv
install_horovod
install_project
log "done ($([ "$GPU" = 1 ] && echo GPU || echo CPU) build): $("$VENV/bin/python" - <<'PY'
import importlib.metadata as m
def version(name):
    try:
        return f"{name} {m.version(name)}"
    except m.PackageNotFoundError:
        return None
print(", ".join(filter(None, map(version, ("horovod", "torch", "tensorflow-cpu", "tensorflow")))))
PY
)"
