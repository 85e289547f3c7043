# The two commands of the README: `make demo` (the main job, a representative subset, ~5
# minutes; `make demo-full` runs every model and codec, ~80 minutes) and `make test` (every
# test and the lint, what CI runs); `make lint` runs ruff and mypy alone; `make test-fast` runs the unit tests only (no Horovod processes, no
# convergence training) for the edit-test loop; `make bench` runs the bandwidth-limited
# benchmark matrix (needs root for the namespaces).
# Each sets up the environment first (idempotent; the Horovod build is cached).
# `make gpu-build` (not in CI: 7.4 GB, ~25 minutes the first time) makes the CUDA build in
# .venv-gpu (torch's CUDA build, Horovod compiled with nvcc and NCCL) and checks that it
# imports; docs/building-horovod.md, "The CUDA build". `make gpu-check`, on a machine with
# CUDA GPUs, runs the CUDA tests, op counts and device times there (docs/testing.md).
PY := .venv/bin/python
# What launch/worker_env.sh gives workers (one thread each; glibc keeps freed memory).
export OMP_NUM_THREADS := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export MALLOC_MMAP_THRESHOLD_ := 1073741824
export MALLOC_TRIM_THRESHOLD_ := 17179869184

.PHONY: setup demo demo-full lint test test-fast test-launchers bench gpu-build gpu-check

setup:
	bash launch/setup.sh

demo: setup
	$(PY) -m hvd_compress.examples.cli demo

demo-full: setup
	$(PY) -m hvd_compress.examples.cli demo --full

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test:
	bash launch/test.sh

test-fast: setup
	$(PY) -m pytest -ra -q --durations=5 -n 2 -m "not multiprocess" tests

# The launchers and engines clusters run, started for real (tests/test_launchers.py): about
# 5 minutes, outside `make test`'s budget.
test-launchers: setup
	$(PY) -m pytest -ra -q --durations=10 -m launchers tests

bench: setup
	$(PY) -m hvd_compress.examples.cli bench

GPU_PY := .venv-gpu/bin/python
gpu-build:
	HVD_COMPRESS_GPU=1 HVD_COMPRESS_VENV=$(CURDIR)/.venv-gpu nice -n 19 timeout 3600 bash launch/setup.sh
	$(GPU_PY) -c "import torch, triton, horovod.torch as hvd; hvd.init(); \
	assert hvd.nccl_built() and hvd.gloo_built() and hvd.mpi_built(), 'Horovod lacks NCCL, Gloo or MPI'; \
	print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__, \
	'| Horovod NCCL', hvd.nccl_built(), 'Gloo', hvd.gloo_built(), 'MPI', hvd.mpi_built())"
	$(GPU_PY) -c "import horovod.tensorflow as hvd; hvd.init(); \
	assert hvd.nccl_built(); print('horovod.tensorflow: NCCL', hvd.nccl_built())"

gpu-check:
	bash launch/gpu_check.sh
