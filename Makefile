# The two commands of the README: `make demo` (the main job, a representative subset, ~10
# minutes; `make demo-full` runs every model and codec, ~80 minutes) and `make test` (every
# test and the lint, what CI runs); `make lint` runs ruff alone; `make test-fast` runs the unit tests only (no Horovod processes, no
# convergence training) for the edit-test loop; `make bench` runs the bandwidth-limited
# benchmark matrix (needs root for the namespaces).
# Each sets up the environment first (idempotent; the Horovod build is cached).
PY := .venv/bin/python
# What launch/worker_env.sh gives workers (one thread each; glibc keeps freed memory).
export OMP_NUM_THREADS := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export MALLOC_MMAP_THRESHOLD_ := 1073741824
export MALLOC_TRIM_THRESHOLD_ := 17179869184

.PHONY: setup demo demo-full lint test test-fast bench

setup:
	bash launch/setup.sh

demo: setup
	$(PY) -m hvd_compress.cli demo

demo-full: setup
	$(PY) -m hvd_compress.cli demo --full

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test:
	bash launch/test.sh

test-fast: setup
	$(PY) -m pytest -ra -q --durations=5 -n 2 -m "not multiprocess" tests

bench: setup
	$(PY) -m hvd_compress.cli bench
