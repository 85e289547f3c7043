"""DGC: the selection, the residual's telescoping, momentum factor masking, the warm-up
schedule and the numpy reference at N = 2 and 4, in real Horovod jobs; its checks."""

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.registry import resolve

from .dgc_reference import CODEC, LR, MU, SHAPES, STEPS, gradient, reference_averages
from .harness import run_parallel


def _train(worker_momentum):
    """DGC through the PyTorch wrapper with heavy-ball SGD on the gradients of ``gradient``,
    its worker momentum as ``worker_momentum`` says (None: the wrapper's choice, Nesterov's
    form): each step's averaged gradients, and for every compressed tensor and step the
    compensated velocity, the indices sent and the residual kept."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc
    from hvd_compress.pt import exchange

    hvd.init()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES.values()]
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(params, lr=LR, momentum=MU),
        list(zip(SHAPES, params)),
        compression=hc.DGC(**CODEC),
        worker_momentum=worker_momentum,
    )
    selections = []
    start = exchange.TopKAllgather.start

    def recorded(self, grad, lr_ratio, name):
        previous = self.memory.residuals.get(self.key)
        compensated = grad.clone() if previous is None else grad + previous * lr_ratio
        handles = start(self, grad, lr_ratio, name)
        selections.append((self.key, compensated, self.selected, self.memory.proposed[self.key]))
        return handles

    exchange.TopKAllgather.start = recorded
    averages, masked, counted = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        grads = [
            torch.from_numpy(gradient(step, hvd.rank(), i, s))
            for i, s in enumerate(SHAPES.values())
        ]
        sum((p * g).sum() for p, g in zip(params, grads)).backward()  # p.grad = g
        optimizer.synchronize()
        averages.append([p.grad.clone() for p in params])
        pipeline = optimizer._hvdc_pipeline
        counted.append((pipeline.last_step_bytes, pipeline.expected_bytes()))
        with optimizer.skip_synchronize():
            optimizer.step()
        momentum = optimizer._hvdc_momentum.momentum
        masked += [
            bool((momentum[key].view(-1)[selected] == 0).all())
            for key, _, selected, _ in selections[-2:]
        ]
    return averages, selections, masked, optimizer._hvdc_pipeline.last_sent_elements, counted


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("worker_momentum", [None, True], ids=["nesterov", "heavy-ball"])
def test_matches_the_reference_and_sends_exactly_the_k_largest(world_size, worker_momentum):
    ranks = run_parallel(_train, world_size, worker_momentum)
    nesterov = worker_momentum is None
    codec = hvd_compress.DGC(**CODEC)
    for averages, selections, masked, sent, counted in ranks:
        # The bytes handed to Horovod, as the cost model counts them, every step.
        assert all(handed == expected for handed, expected in counted)
        for _step, (mine, want) in enumerate(
            zip(averages, reference_averages(codec, SHAPES, STEPS, world_size, MU, nesterov))
        ):
            for name, a in zip(SHAPES, mine):
                # float32 against float64: the same support, values to rounding.
                np.testing.assert_array_equal(a.numpy() != 0, want[name] != 0, err_msg=name)
                np.testing.assert_allclose(a.numpy(), want[name], rtol=1e-5, atol=1e-6)
        for _key, compensated, selected, residual in selections:
            magnitude = compensated.abs()
            k = selected.numel()
            assert len(set(selected.tolist())) == k
            others = torch.ones_like(magnitude, dtype=torch.bool)
            others[selected] = False
            # Exactly the k largest magnitudes of the compensated velocity.
            assert magnitude[selected].min() >= magnitude[others].max()
            # The residual keeps everything not sent: residual + sent == compensated.
            assert torch.equal(residual[others], compensated[others])
            assert not residual[selected].any()
        assert all(masked)  # the momentum forgot what was sent
        # The last step's k: after the warm-up, density x n.
        assert sent == {"conv": codec.k(160, STEPS - 1), "linear": codec.k(2400, STEPS - 1)}
    for other in ranks[1:]:
        for a, b in zip(ranks[0][0], other[0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))  # bitwise on every rank


def test_warmup_schedule_falls_exponentially_to_the_density():
    codec = hvd_compress.DGC(density=0.001, warmup_steps=8)
    assert [codec.density_at(s) for s in range(10)] == [
        0.25,
        0.25,
        0.0625,
        0.0625,
        0.015625,
        0.015625,
        0.00390625,
        0.00390625,
        0.001,
        0.001,
    ]
    assert [codec.k(1000, s) for s in (0, 2, 4, 6, 8)] == [250, 63, 16, 4, 1]
    assert hvd_compress.DGC(density=0.1, warmup_steps=8).density_at(6) == 0.1  # never below
    assert hvd_compress.DGC(density=0.1).density_at(0) == 0.1  # no warm-up


def test_local_clip_scales_to_the_threshold_over_sqrt_n():
    import hvd_compress.pt as hc

    grad = torch.full((100,), 1.0)  # norm 10
    clipped = hc.DGC(clip_norm=4.0).local_clip(grad.clone(), 4)
    torch.testing.assert_close(torch.linalg.vector_norm(clipped), torch.tensor(2.0))
    np.testing.assert_allclose(
        hvd_compress.DGC(clip_norm=4.0).local_clip(grad.numpy(), 4), clipped.numpy(), rtol=1e-6
    )
    assert torch.equal(hc.DGC(clip_norm=40.0).local_clip(grad.clone(), 4), grad)


def test_the_former_keyword_ratio_sets_the_density_with_a_warning():
    with pytest.warns(DeprecationWarning, match="DGC: ratio= is deprecated, pass density="):
        codec = hvd_compress.DGC(ratio=0.01)
    assert codec.density == 0.01
    with pytest.warns(DeprecationWarning):
        assert resolve("dgc:ratio=0.02").density == 0.02


def test_bad_input_names_the_parameter():
    import hvd_compress.pt as hc

    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="density must be"):
            hc.DGC(density=bad)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        hc.DGC(warmup_steps=-1)
    with pytest.raises(ValueError, match="clip_norm must be"):
        hc.DGC(clip_norm=0)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        hc.DGC().compress(torch.zeros(4))
    with pytest.raises(ValueError, match="error_feedback=False"):
        hc.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
            compression="dgc",
            error_feedback=False,
        )
