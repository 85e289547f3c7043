"""Models whose gradients Horovod's torch collectives do not take as they are: a model held
in bfloat16 (Horovod's torch allreduce has no bfloat16) and a channels_last CNN (whose
gradients are not contiguous, and Horovod takes contiguous tensors only). Every codec, and
``LocalClipSGD``, trains both for a few steps at N = 2 in one job; the parameters stay
finite, keep their dtype and layout, and agree bitwise across the ranks. A model cast after
its optimizer was wrapped trains as one cast before: where a gradient goes (the CPU kernels
or the eager ops) is decided by the gradient itself, not by the parameter at wrapping."""

import pytest
import torch

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

STEPS = 5
# Every codec, compressing every tensor it can (min_size=0) so that the codec's own
# collectives meet the dtype and the layout, not only the plain allreduce.
CODECS = (
    "none",
    "fp16",
    "terngrad:min_size=0",
    "qsgd:min_size=0",
    "qsgd-inf:min_size=0",
    "nuqsgd:min_size=0",
    "ef-sign:min_size=0",
    "adacomp:min_size=0",
    "clt-k:min_size=0",
    "powersgd:start_iter=1",
    # With the SGD's momentum on the worker, masked where sent (momentum factor masking).
    "dgc:min_size=0:density=0.1",
)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


def _model(kind):
    torch.manual_seed(0)
    model = ConvNet()
    if kind == "bfloat16":
        return model.to(torch.bfloat16)
    return model.to(memory_format=torch.channels_last)


def _inputs(kind, rank, step):
    data = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 3, 8, 8, generator=data)
    x = x.to(torch.bfloat16) if kind == "bfloat16" else x.to(memory_format=torch.channels_last)
    return x, torch.randint(0, 4, (4,), generator=data)


def _train(kind, codec):
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    # Built alike on every rank (Horovod's broadcast has no bfloat16 either).
    model = _model(kind)
    if codec == "local":
        # A round after the last step, so that the ranks agree at the end.
        optimizer = hc.LocalClipSGD(
            torch.optim.SGD(model.parameters(), lr=0.1), model, clip=1.0, sync_every=STEPS
        )
    else:
        optimizer = hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            compression=codec,
        )
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _inputs(kind, hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        optimizer.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "channels_last": model.conv.weight.is_contiguous(memory_format=torch.channels_last),
    }


def _converted(codec, before=None, after=None, midway=None):
    """The CNN trained ``STEPS`` steps with ``codec``, with ``before`` applied to it in place
    before ``DistributedOptimizer`` wraps its SGD, ``after`` after, and ``midway`` after
    ``MIDWAY`` steps, when the pipeline holds state (the optimizer keeps the same
    parameters): its parameters, on the CPU."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = ConvNet()
    if before is not None:
        before(model)
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=codec,
    )
    if after is not None:
        after(model)
    for step in range(STEPS):
        if step == MIDWAY and midway is not None:
            midway(model)
        like = next(model.parameters())
        optimizer.zero_grad()
        x, y = _inputs("channels_last", hvd.rank(), step)
        x, y = x.to(like.device, like.dtype), y.to(like.device)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


# The codecs the CPU kernels take (float32 tensors only).
KERNEL_CODECS = ("terngrad:min_size=0", "qsgd-inf:min_size=0", "ef-sign:min_size=0")
# Codecs with state of every kind: residuals, worker momentum (ef-sign's, DGC's velocity)
# and PowerSGD's factors.
STATEFUL_CODECS = ("ef-sign:min_size=0", "dgc:min_size=0:density=0.1", "powersgd:start_iter=1")
# The step before which ``_converted``'s ``midway`` converts the model.
MIDWAY = 3


def _cast_runs():
    """Each kernel codec with the CNN cast to float64 (which the kernels do not take) before
    and after wrapping, and each stateful codec's with the CNN cast midway."""
    import horovod.torch as hvd

    hvd.init()
    runs = {
        (codec, after): _converted(
            codec, **{"after" if after else "before": torch.nn.Module.double}
        )
        for codec in KERNEL_CODECS
        for after in (False, True)
    }
    for codec in STATEFUL_CODECS:
        runs[codec, "midway"] = _converted(codec, midway=torch.nn.Module.double)
    return runs


@pytest.fixture(scope="module")
def cast_runs():
    return run_parallel(_cast_runs, 2, timeout=600)


@pytest.mark.parametrize("codec", STATEFUL_CODECS)
def test_a_model_cast_midway_trains_on(cast_runs, codec):
    """Cast when residuals, momentum and factors exist: the state follows the gradients'
    dtype, and the ranks still agree bitwise."""
    first, second = (runs[codec, "midway"] for runs in cast_runs)
    for a, b in zip(first, second):
        assert a.dtype == torch.float64 and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("codec", KERNEL_CODECS)
def test_a_model_cast_after_wrapping_trains_as_one_cast_before(cast_runs, codec):
    for before, after in zip(cast_runs[0][codec, False], cast_runs[0][codec, True]):
        assert after.dtype == torch.float64
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def _moved(codecs):
    """Each of ``codecs`` with the CNN moved to this rank's GPU after wrapping, and midway
    (residuals, momentum and factors then on the CPU)."""
    import horovod.torch as hvd

    from .devices import rank_device

    hvd.init()
    device = rank_device("cuda")
    runs = {codec: _converted(codec, after=lambda model: model.to(device)) for codec in codecs}
    for codec in STATEFUL_CODECS:
        runs[codec, "midway"] = _converted(codec, midway=lambda model: model.to(device))
    return runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_model_moved_to_a_gpu_after_wrapping_trains():
    codecs = KERNEL_CODECS + ("powersgd:start_iter=1",)
    first, second = run_parallel(_moved, 2, codecs, timeout=600)
    for codec in codecs + tuple((c, "midway") for c in STATEFUL_CODECS):
        for a, b in zip(first[codec], second[codec]):
            assert torch.isfinite(a).all(), codec
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _runs():
    import horovod.torch as hvd

    hvd.init()
    return {
        (kind, codec): _train(kind, codec)
        for kind in ("bfloat16", "channels_last")
        for codec in CODECS + ("local",)
    }


@pytest.fixture(scope="module")
def runs():
    return run_parallel(_runs, 2, timeout=600)


@pytest.mark.parametrize("kind", ["bfloat16", "channels_last"])
@pytest.mark.parametrize("codec", CODECS + ("local",))
def test_trains_and_ranks_agree(runs, kind, codec):
    first, second = (result[(kind, codec)] for result in runs)
    start = [p.detach() for p in _model(kind).parameters()]
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    for a, b, _initial in zip(first["params"], second["params"], start):
        assert a.dtype == dtype and torch.isfinite(a.float()).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, initial) for a, initial in zip(first["params"], start))
    if kind == "channels_last":
        assert first["channels_last"]
