#!/usr/bin/env bash
# Starts a training script on N local (or listed) workers with horovodrun.
#
#   launch/horovodrun.sh [-n N] [-H host1:slots,host2:slots] [--mpi] script.py [args...]
#
# Gloo is the default controller (no MPI needed at run time); --mpi uses OpenMPI instead.
# Each worker gets OMP_NUM_THREADS (default 1) so that N workers on few cores do not fight
# over threads; set it higher on machines with cores to spare.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_COMPRESS_VENV:-$REPO/.venv}"
NP=2 HOSTS="" CONTROLLER=--gloo
while [ $# -gt 0 ]; do
    case "$1" in
        -n|-np) NP="$2"; shift 2 ;;
        -H) HOSTS="$2"; shift 2 ;;
        --mpi) CONTROLLER=--mpi; shift ;;
        --gloo) CONTROLLER=--gloo; shift ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "usage: $0 [-n N] [-H hosts] [--mpi|--gloo] script.py [args...]" >&2; exit 2; }
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$VENV/bin/horovodrun" -np "$NP" -H "${HOSTS:-localhost:$NP}" "$CONTROLLER" \
    "$VENV/bin/python" "$@"
