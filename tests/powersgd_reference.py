"""The PowerSGD case that both ports' multi-process tests train, and its numpy reference:
every rank's near-low-rank gradients, and each step's averages that PowerSGD with error
feedback gives them (``test_powersgd``, ``test_tf_powersgd``)."""

import numpy as np

RANK, START_ITER, STEPS = 2, 2, 22
# PyTorch layouts: a convolution, a linear layer, its bias (a vector: whole), a matrix too
# thin for rank 2 to save 2x (whole), and a square one.
SHAPES = {
    "conv.weight": (6, 3, 3, 3),
    "linear.weight": (10, 24),
    "linear.bias": (10,),
    "thin.weight": (40, 2),
    "square.weight": (16, 16),
}


def gradient(step, rank, index, shape, matrix_shape):
    """Rank ``rank``'s gradient of tensor ``index`` at ``step``: a fixed part of rank 2 in
    the ``matrix_shape`` view, with singular values apart, plus noise of this rank and step.
    Gradients are near low rank in practice; pure noise would have no stable dominant
    subspace, and float32 rounding would turn the power iteration's path (the hook's and
    ours alike) away from the float64 reference's within a few steps."""
    fixed = np.random.default_rng(index)
    n, m = matrix_shape
    low = (fixed.standard_normal((n, 2)) * [3.0, 1.0]) @ fixed.standard_normal((2, m))
    noise = np.random.default_rng([step, rank, index]).standard_normal((n, m))
    return (low + 0.3 * noise).reshape(shape).astype(np.float32)


def matrix(codec, shape):
    return codec.matrix_shape(shape) if len(shape) > 1 else (shape[0], 1)


def reference_averages(codec, shapes, steps, world_size, seed=0):
    """The averaged gradients of each step of the numpy reference in float64, every rank's
    error feedback simulated (``hvd_compress.powersgd``)."""
    errors = {name: [0.0] * world_size for name in shapes}
    factors = {
        name: codec.initial_factor(seed, index, shape).astype(np.float64)
        for index, (name, shape) in enumerate(shapes.items())
        if codec.why_whole(shape) is None
    }
    for step in range(steps):
        averages = {}
        for index, (name, shape) in enumerate(shapes.items()):
            grads = [
                gradient(step, r, index, shape, matrix(codec, shape)).astype(np.float64)
                for r in range(world_size)
            ]
            if step < codec.start_iter or name not in factors:
                averages[name] = sum(grads) / world_size
                continue
            matrices = [
                (g.reshape(-1) + e).reshape(codec.matrix_shape(shape))
                for g, e in zip(grads, errors[name])
            ]
            average, factors[name] = codec.average(matrices, factors[name])
            errors[name] = [(m - average).reshape(-1) for m in matrices]
            averages[name] = average.reshape(shape)
        yield averages
