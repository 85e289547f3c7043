#!/usr/bin/env bash
# `make test`, what CI runs: set-up, lint, the single-process tests on both cores
# (pytest-xdist), then the multi-process tests one at a time (each Horovod job already gives
# every core a rank). Prints each part's wall time against the budget of CONTRIBUTING.md.
# Both test runs go ahead when one fails; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BUDGET_SECONDS=900

declare -a parts=()
status=0
total=0
timed() {
    local name="$1" start=$SECONDS
    shift
    "$@"
    local code=$?
    parts+=("$name $((SECONDS - start)) s")
    total=$((total + SECONDS - start))
    if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=$code; fi
    return "$code"
}

timed set-up bash launch/setup.sh || exit "$status"
timed lint bash -c "$PY -m ruff check . && $PY -m ruff format --check . && $PY -m mypy" ||
    exit "$status"
timed "single-process tests" \
    "$PY" -m pytest -ra -q --durations=10 -n 2 -m "not multiprocess" tests
timed "multi-process tests" \
    "$PY" -m pytest -ra -q --durations=15 -m "multiprocess and not launchers" tests

echo
echo "make test: $(IFS=,; echo "${parts[*]}" | sed 's/,/, /g'); ${total} s in all" \
    "(budget ${BUDGET_SECONDS} s on a quiet machine with Horovod's wheel cached: CONTRIBUTING.md)"
if [ "$total" -gt "$BUDGET_SECONDS" ]; then
    echo "make test: over the budget by $((total - BUDGET_SECONDS)) s"
fi
exit "$status"
