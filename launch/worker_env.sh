# The environment every launcher gives its workers (sourced, not run); each value can be
# overridden by setting it before launching.
#
# OMP_NUM_THREADS=1: N workers on few cores would otherwise fight over threads; set it
# higher on machines with cores to spare.
# MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_: glibc gives each freed block of more than
# a few MB back to the kernel, so every new gradient-sized temporary on the CPU is faulted
# in again, page by page, at 3-5x the cost of the arithmetic that fills it. Keeping freed
# memory for reuse (blocks up to 1 GB, never trimmed) removes that; the price is that a
# worker keeps its peak memory. CUDA tensors have PyTorch's caching allocator.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
