# The environment every launcher gives its workers (sourced, not run); each value can be
# overridden by setting it before launching.
#
# OMP_NUM_THREADS=1: N workers on few cores would otherwise fight over threads; set it
# higher on machines with cores to spare.
# MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_: glibc gives each freed block of more than
# a few MB back to the kernel, so every new gradient-sized temporary on the CPU is faulted
# in again, page by page; a codec step on a 25M-parameter model spent more time in those
# faults than in its arithmetic. Keeping freed memory for reuse (up to 1 GB per block, never
# trimmed) makes a temporary 3-5x cheaper. CUDA tensors have PyTorch's caching allocator.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
