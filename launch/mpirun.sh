#!/usr/bin/env bash
# Starts a training script with OpenMPI's mpirun, every flag spelled out.
#
#   launch/mpirun.sh [-n N] [--hostfile FILE] script.py [args...]
#
# The script may call hvd.init() (Horovod finds the MPI job itself) or hand Horovod the
# mpi4py communicator with hvd.init(comm=MPI.COMM_WORLD).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_COMPRESS_VENV:-$REPO/.venv}"
NP=2 HOSTFILE=()
while [ $# -gt 0 ]; do
    case "$1" in
        -n|-np) NP="$2"; shift 2 ;;
        --hostfile) HOSTFILE=(--hostfile "$2"); shift 2 ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "usage: $0 [-n N] [--hostfile FILE] script.py [args...]" >&2; exit 2; }
source "$REPO/launch/worker_env.sh"
FLAGS=(
    -np "$NP"
    --bind-to none        # let each worker's OMP threads use any core
    --map-by slot         # fill each host's slots in order
    --oversubscribe       # allow more ranks than cores (tests on small machines)
    -x OMP_NUM_THREADS -x TF_CPP_MIN_LOG_LEVEL -x PATH -x LD_LIBRARY_PATH
    -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_   # launch/worker_env.sh
    -x NCCL_DEBUG         # forwarded when set, for GPU runs
    --mca pml ob1 --mca btl self,tcp   # TCP between ranks; drop on InfiniBand clusters
)
if [ "$(id -u)" -eq 0 ]; then
    # OpenMPI refuses to run as root unless told to; containers often run as root.
    echo "mpirun.sh: running as root, so passing --allow-run-as-root" >&2
    FLAGS=(--allow-run-as-root "${FLAGS[@]}")
fi
exec mpirun "${FLAGS[@]}" "${HOSTFILE[@]}" "$VENV/bin/python" "$@"
