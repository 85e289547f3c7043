"""The DGC case that both ports' multi-process tests train, and its numpy reference: every
rank's gradients, and each step's averages that DGC gives them (``test_dgc``,
``test_tf_dgc``)."""

import numpy as np

MU, LR, STEPS = 0.9, 0.1, 7
# The warm-up's four stages over steps 0-3 (25% ... 0.39%, floored at the density), then
# the density.
CODEC = {"density": 0.02, "warmup_steps": 4, "clip_norm": 3.0, "min_size": 100}
SHAPES = {"conv": (8, 4, 5), "linear": (40, 60), "bias": (40,)}


def gradient(step, rank, index, shape):
    """Rank ``rank``'s gradient of tensor ``index`` at ``step``, the same in every test."""
    return np.random.default_rng([step, rank, index]).standard_normal(shape).astype(np.float32)


def reference_averages(codec, shapes, steps, world_size, mu, nesterov):
    """Each step's averaged gradients of the numpy reference in float64: every rank's
    clipping, velocity u, accumulation v of u (or, in Nesterov's form, of g + mu u), top-k
    and masking simulated. Tensors under the codec's min_size average whole what would
    have been accumulated."""
    velocity = {name: [0.0] * world_size for name in shapes}
    accumulated = {name: [0.0] * world_size for name in shapes}
    for step in range(steps):
        averages = {}
        for index, (name, shape) in enumerate(shapes.items()):
            grads = [
                codec.local_clip(gradient(step, r, index, shape), world_size).astype(np.float64)
                for r in range(world_size)
            ]
            total = np.zeros(int(np.prod(shape)))
            for r, g in enumerate(grads):
                u = mu * velocity[name][r] + g.reshape(-1)
                step_value = g.reshape(-1) + mu * u if nesterov else u
                if codec.why_whole(shape) is not None:
                    velocity[name][r] = u
                    total += step_value
                    continue
                v = accumulated[name][r] + step_value
                selected = codec.top_k(v, codec.k(v.size, step))
                total[selected] += v[selected]
                v[selected], u[selected] = 0, 0
                velocity[name][r], accumulated[name][r] = u, v
            averages[name] = (total / world_size).reshape(shape)
        yield averages
