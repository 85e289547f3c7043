# The two commands of the README: `make demo` (the main job) and `make test` (every test).
# Both set up the environment first (idempotent; the Horovod build is cached).
PY := .venv/bin/python
export OMP_NUM_THREADS := 1
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup demo test

setup:
	bash launch/setup.sh

demo: setup
	$(PY) -m hvd_compress.cli demo

test: setup
	$(PY) -m pytest -ra -q tests
