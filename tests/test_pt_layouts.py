"""Models whose gradients Horovod's torch collectives do not take as they are: a model held
in bfloat16 (Horovod's torch allreduce has no bfloat16) and a channels_last CNN (whose
gradients are not contiguous, and Horovod takes contiguous tensors only). Every codec, and
``LocalClipSGD``, trains both for a few steps at N = 2 in one job; the parameters stay
finite, keep their dtype and layout, and agree bitwise across the ranks."""

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
    "dgc:min_size=0:ratio=0.1",
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
    for a, b, initial in zip(first["params"], second["params"], start):
        assert a.dtype == dtype and torch.isfinite(a.float()).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, initial) for a, initial in zip(first["params"], start))
    if kind == "channels_last":
        assert first["channels_last"]
