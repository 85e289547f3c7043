#!/usr/bin/env bash
# Runs a command as a Horovod job over Gloo on a bandwidth-limited test network: one network
# namespace per worker, veth links to a bridge, both directions of every link limited with
# `tc tbf` (benchmarks/network.py). No ssh and no horovodrun: Horovod's rendezvous server runs
# in the switch namespace and each worker gets the environment horovodrun would set.
#
#   launch/netns.sh [-n N] [-r RATE] [--timeout SECONDS] -- python train.py [args...]
#   launch/netns.sh -n 4 -r 100M -- .venv/bin/python examples/mnist1d_torch.py --steps 300
#
# Needs root (CAP_NET_ADMIN) and iproute2. Everything (namespaces hvdcb-*, /etc/netns/hvdcb-*)
# is removed on exit, on failure and on Ctrl-C; `launch/netns.sh --teardown` clears what a
# killed run left. `hvd-compress bench` (make bench) uses the same network.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_COMPRESS_VENV:-$REPO/.venv}"
if [ "$(id -u)" != 0 ]; then
    echo "launch/netns.sh: network namespaces and tc need root (CAP_NET_ADMIN); run it as root" >&2
    exit 1
fi
source "$REPO/launch/worker_env.sh"
cd "$REPO"
# The Python side tears down on its own exit; this covers it being killed outright.
trap '"$VENV/bin/python" -m benchmarks.network --teardown' EXIT
trap 'exit 130' INT TERM HUP
"$VENV/bin/python" -m benchmarks.network "$@"
