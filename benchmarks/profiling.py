"""What the CPU profiles (``benchmarks.codec_profile``, ``benchmarks.kernel_profile``)
share: the tensors a codec compresses, the messages a server receives, and the clock."""

import time

import torch

from hvd_compress.plan import classifier_names


def compressed_shapes(codec, named_parameters):
    """The shapes of the parameters ``codec`` compresses (the others are sent whole)."""
    whole = set() if codec.compress_classifier else classifier_names(named_parameters)
    return [p.shape for n, p in named_parameters if codec.compresses(p.numel()) and n not in whole]


def interleaved_best_seconds(functions, repeats, clock=time.thread_time):
    """The least time by ``clock`` (this thread's CPU time) of each of ``functions`` over
    ``repeats`` rounds that call each once in turn, after a round that compiles the
    kernels. Functions to compare are timed in turn, not one after the other's runs: this
    machine's speed drifts by up to 1.5x within a minute, and their ratios should not."""
    for function in functions:
        function()
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for i, function in enumerate(functions):
            start = clock()
            function()
            best[i] = min(best[i], clock() - start)
    return best


def best_seconds(function, repeats, clock=time.thread_time):
    """``interleaved_best_seconds`` of ``function`` alone."""
    return interleaved_best_seconds([function], repeats, clock)[0]


def server_messages(bits, scales):
    """Workers' messages as a server receives them: each row's float32 scale, then its
    bits."""
    return torch.cat([scales.view(torch.uint8), bits], dim=1)
