#!/usr/bin/env bash
# Starts a training script on N local (or listed) workers with horovodrun.
#
#   launch/horovodrun.sh [-n N] [-H host1:slots,host2:slots] [--mpi] script.py [args...]
#
# Gloo is the default controller (no MPI needed at run time); --mpi uses OpenMPI instead.
# Each worker gets the environment of launch/worker_env.sh (one thread, glibc keeping freed
# memory).
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
source "$REPO/launch/worker_env.sh"
exec "$VENV/bin/horovodrun" -np "$NP" -H "${HOSTS:-localhost:$NP}" "$CONTROLLER" \
    "$VENV/bin/python" "$@"
