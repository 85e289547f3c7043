"""The PyTorch DistributedOptimizer where Horovod code relies on Horovod's optimizer, the
behaviours Horovod 0.28.1's own optimizer tests check (its test files are not shipped, so
these are the project's own): sparse embeddings with and without ``sparse_as_dense``;
``hvd.broadcast_optimizer_state`` after rank 0 alone loaded a checkpoint, with a frozen
parameter; the broadcast of ranks' different options, gradients on some ranks only, a
dynamic ``requires_grad``, clipping between ``synchronize()`` and ``step()`` and the warning
of a ``step()`` without ``skip_synchronize()``: each with every ``torch.optim`` optimizer
Horovod's test broadcasts and every codec (``_pairs``; at N = 4 with TernGrad and ef-sign
too); ``_parameter_names``. One 2-process job runs them all, and one
4-process job its part."""

import inspect
import io

import pytest
import torch

from hvd_compress.pt import CODECS

from .harness import run_parallel

pytestmark = pytest.mark.multiprocess

# (codec, sparse_as_dense, backward_passes_per_step, optimizer): every codec, which compresses
# the embedding once it is dense (min_size=0, PowerSGD from the first step; the head is the
# classifier, sent whole), an accumulation of sparse gradients over two passes, and Horovod's
# own case, SparseAdam on the embedding alone (then the classifier, compressed only if told).
SPARSE_CASES = [
    (f"{codec}:min_size=0" + (":start_iter=0" if codec == "powersgd" else ""), dense, 1, "SGD")
    for codec in CODECS
    for dense in (False, True)
] + [
    ("terngrad:min_size=0", True, 2, "SGD"),
    ("none", False, 1, "SparseAdam"),
    ("none", True, 1, "SparseAdam"),
    ("terngrad:min_size=0:compress_classifier=True", True, 1, "SparseAdam"),
]
SPARSE_STEPS = 3
LOOKED_UP = {0, 1, 3, 4, 5, 10, 11}  # the embedding's rows some rank looks up (``_tokens``)

# Horovod 0.28.1's test_broadcast_state: each optimizer takes the options it has; with every
# codec, and the second options with a few.
BROADCAST_OPTIONS = (dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2))
BROADCAST_CASES = [(0, f"{codec}:min_size=0") for codec in CODECS] + [
    (1, f"{codec}:min_size=0") for codec in ("none", "terngrad", "qsgd-inf", "ef-sign")
]


def _broadcast_optimizers():
    """Horovod's test's optimizers, AdamW included: every optimizer of ``torch.optim`` but
    L-BFGS (which Horovod cannot broadcast), SparseAdam (sparse gradients only) and Muon (2-d
    parameters only)."""
    return [
        cls
        for name, cls in sorted(vars(torch.optim).items())
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and name not in ("Optimizer", "LBFGS", "SparseAdam", "Muon")
    ]


def _tokens(rank, step):
    """This rank's lookups at ``step``: over the ranks and steps the rows of ``LOOKED_UP``,
    rows 0, 1 and 4 at every step."""
    return torch.tensor([[rank, 3 + step, 10 + rank], [1, 5 - step, 4]])


def _sparse_run(codec, sparse_as_dense, passes, optimizer_name):
    """Trains an embedding (sparse gradients) and a linear head; returns the weights after
    every step, whether the optimizer was handed sparse embedding gradients, and the bytes
    of the last step handed to Horovod against a plain allreduce's."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8, sparse=True)
    head = torch.nn.Linear(8, 3)
    named = [("embedding.weight", embedding.weight)]
    if optimizer_name == "SparseAdam":
        base = torch.optim.SparseAdam([embedding.weight], lr=0.1)
    else:
        named += [("head.weight", head.weight), ("head.bias", head.bias)]
        base = torch.optim.SGD([p for _, p in named], lr=0.5, momentum=0.9)
    optimizer = hc.DistributedOptimizer(
        base,
        named,
        compression=codec,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=passes,
    )
    weights, sparse = [], []
    for step in range(SPARSE_STEPS):
        optimizer.zero_grad()
        for _ in range(passes):
            head(embedding(_tokens(hvd.rank(), step))).pow(2).sum().backward()
        optimizer.step()
        sparse.append(embedding.weight.grad.is_sparse)
        weights.append((embedding.weight.detach().clone(), head.weight.detach().clone()))
    stats = optimizer.compression_stats()
    return weights, sparse, (stats["bytes_handed"], stats["bytes_uncompressed"])


def _state(optimizer):
    """A copy of the optimizer's ``state`` and ``param_groups`` (the compression state
    apart): what ``hvd.broadcast_optimizer_state`` sends."""
    state = optimizer.state_dict()
    return {
        "state": {
            pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for pid, s in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def _broadcast_run(cls, options, codec):
    """One step, rank 0 saves, every rank rebuilds, rank 0 alone loads, then the usual
    broadcasts; returns rank 0's loaded state (None elsewhere), every rank's state after the
    broadcasts, and rank 0's compression state before and after them."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    data = torch.Generator().manual_seed(hvd.rank())

    def build():
        torch.manual_seed(hvd.rank())  # different weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        model[0].bias.requires_grad_(False)  # Horovod's test_broadcast_state_no_grad
        base = cls(model.parameters(), **_accepted(cls, options))
        return model, hc.DistributedOptimizer(base, model.named_parameters(), compression=codec)

    model, optimizer = build()
    optimizer.zero_grad()
    model(torch.randn(4, 6, generator=data)).pow(2).sum().backward()
    optimizer.step()
    checkpoint = io.BytesIO()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    model, optimizer = build()
    loaded = compression = None
    if hvd.rank() == 0:
        checkpoint.seek(0)
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loaded, compression = _state(optimizer), optimizer.state_dict()["hvd_compress"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return loaded, _state(optimizer), compression, optimizer.state_dict()["hvd_compress"]


# Codecs whose collectives depend on the step counter: CLT-k's leader, and the adaptive
# mode's decision steps.
RESUME_CASES = ("clt-k", "terngrad+adaptive")
RESUME_STEPS = 3


def _resume_on_rank0(case):
    """Trains RESUME_STEPS steps; rank 0 saves, every rank rebuilds, rank 0 alone loads,
    the state is broadcast, and RESUME_STEPS more steps run. Returns the parameters and
    the step counter of the compression state."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    data = torch.Generator().manual_seed(hvd.rank())
    codec, adaptive = (case.split("+")[0], case.endswith("+adaptive"))

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 500), torch.nn.Linear(500, 3))
        return model, hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression=hc.CODECS[codec](min_size=100),
            adaptive=hc.Adaptive(warmup_steps=2, every=2) if adaptive else False,
        )

    def train(model, optimizer):
        for _ in range(RESUME_STEPS):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(
                model(torch.randn(4, 6, generator=data)), torch.randint(0, 3, (4,), generator=data)
            ).backward()
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    model, optimizer = build()
    if hvd.rank() == 0:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    train(model, optimizer)
    return ([p.detach().clone() for p in model.parameters()], optimizer.compression_stats()["step"])


# Horovod 0.28.1's test_broadcast_state_options: each rank's optimizer takes other options,
# which the broadcast replaces by rank 0's; with every codec.
OPTIONS = (
    dict(
        lr=0.1,
        momentum=0.8,
        weight_decay=0.2,
        nesterov=True,
        betas=(0.9, 0.999),
        etas=(0.8, 2.4),
        step_sizes=(1e-5, 100),
    ),
    dict(
        lr=0.2,
        momentum=0.9,
        weight_decay=0.1,
        nesterov=False,
        betas=(0.8, 0.9),
        etas=(0.25, 1.75),
        step_sizes=(1e-7, 5),
    ),
)
# Every codec of the PyTorch port, by name.
OPTIONS_CODECS = tuple(CODECS)


def _accepted(cls, options):
    parameters = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in parameters}


def _options_run(cls, codec):
    """A step with this rank's own options, the broadcast of rank 0's optimizer state, and
    a step more; returns the options of the groups and the optimizer's ``state`` after the
    broadcast, and the parameters after the last step (rank 0's weights, broadcast with its
    state, on every rank: the same after it)."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))
    base = cls(model.parameters(), **_accepted(cls, OPTIONS[min(hvd.rank(), 1)]))
    optimizer = hc.DistributedOptimizer(
        base, model.named_parameters(), compression=f"{codec}:min_size=0"
    )
    data = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(64, 100, generator=data), torch.randn(64, 10, generator=data)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = _state(optimizer)["state"]
    step()
    return options, state, [p.detach().clone() for p in model.parameters()]


class _Branches(torch.nn.Module):
    """Horovod's optimizer tests' model shapes in one: a trunk, two heads of which a rank may
    use one only (gradients present on some ranks only), and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(12, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.left, self.right = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, heads):
        h = self.frozen(torch.relu(self.trunk(x)))
        return sum(getattr(self, head)(h) for head in heads)


def _behaviours_run(cls, codec):
    """Horovod's optimizer tests' behaviours with ``codec`` and optimizer ``cls``, one step
    each: a head used by rank 0 only; a head whose ``requires_grad`` is switched off for a
    step; clipping between ``synchronize()`` and a ``step()`` under ``skip_synchronize()``;
    a ``step()`` after ``synchronize()`` without it. Returns the parameters after each
    step and the warnings of the last."""
    import warnings

    import horovod.torch as hvd

    import hvd_compress.pt as hc

    torch.manual_seed(0)
    model = _Branches()
    optimizer = hc.DistributedOptimizer(
        cls(model.parameters(), **_accepted(cls, OPTIONS[0])),
        model.named_parameters(),
        compression=f"{codec}:min_size=0",
    )
    data = torch.Generator().manual_seed(hvd.rank())
    after = []

    def backward(heads):
        optimizer.zero_grad()
        model(torch.randn(8, 12, generator=data), heads).pow(2).mean().backward()

    backward(("left", "right") if hvd.rank() == 0 else ("left",))
    optimizer.step()
    after.append([p.detach().clone() for p in model.parameters()])
    model.right.requires_grad_(False)
    backward(("left",))
    optimizer.step()
    model.right.requires_grad_(True)
    after.append([p.detach().clone() for p in model.parameters()])
    backward(("left", "right"))
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with optimizer.skip_synchronize():
        optimizer.step()
    after.append([p.detach().clone() for p in model.parameters()])
    backward(("left", "right"))
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    return after, [str(w.message) for w in caught]


def _parameter_names():
    """Horovod's own test of unnamed parameters (two groups, no ``named_parameters``), and
    named ones; returns the names in parameter order and in the map's order."""
    import hvd_compress.pt as hc

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    unnamed = hc.DistributedOptimizer(
        torch.optim.SGD(
            [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.001
        )
    )
    named = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001),
        reversed(list(model.named_parameters())),
        compression="terngrad",
    )
    return {
        which: (
            [optimizer._parameter_names[p] for p in model.parameters()],
            list(optimizer._parameter_names.values()),
        )
        for which, optimizer in (("unnamed", unnamed), ("named", named))
    }


# Optimizers whose state the wrappers change by codec: SGD's worker momentum (ef-sign, DGC),
# Adam's and AdamW's compressed Adam (the error-feedback codecs).
REMEDIED_OPTIMIZERS = ("SGD", "Adam", "AdamW")
# Codecs whose compression state differs in kind: none, a codec with a step counter and seed,
# and one with residuals and the worker momentum.
STATE_KINDS = ("none", "terngrad", "ef-sign")


def _pairs(codecs):
    """(optimizer class, codec) pairs that cover both axes of ``codecs`` and Horovod's
    optimizers: every optimizer with each of ``STATE_KINDS`` in ``codecs`` (all of them if
    none is), and every codec with each of ``REMEDIED_OPTIMIZERS``. Their every pair costs a
    third of the module's time and tests no interaction these miss: an optimizer's options
    and state are broadcast alike whatever the codec, and a codec's state alike whatever
    the optimizer, but for the remedies."""
    kinds = [codec for codec in codecs if codec.split(":")[0] in STATE_KINDS] or list(codecs)
    optimizers = _broadcast_optimizers()
    pairs = [(cls, codec) for cls in optimizers for codec in kinds]
    pairs += [
        (cls, codec)
        for cls in optimizers
        if cls.__name__ in REMEDIED_OPTIMIZERS
        for codec in codecs
        if codec not in kinds
    ]
    return pairs


def _with_optimizers(run, codecs):
    return {(cls.__name__, codec): run(cls, codec) for cls, codec in _pairs(codecs)}


def _dropin_job():
    import horovod.torch as hvd

    hvd.init()
    return {
        "sparse": [_sparse_run(*case) for case in SPARSE_CASES],
        "broadcast": {
            (cls.__name__, index, codec): _broadcast_run(cls, BROADCAST_OPTIONS[index], codec)
            for index in range(len(BROADCAST_OPTIONS))
            for cls, codec in _pairs([c for i, c in BROADCAST_CASES if i == index])
        },
        "options": _with_optimizers(_options_run, OPTIONS_CODECS),
        "behaviours": _with_optimizers(_behaviours_run, OPTIONS_CODECS),
        "names": _parameter_names(),
        "resume": {case: _resume_on_rank0(case) for case in RESUME_CASES},
    }


# The codecs of the drop-in tests at N = 4 as well.
FOUR_RANK_CODECS = ("terngrad", "ef-sign")


def _four_rank_job():
    import horovod.torch as hvd

    hvd.init()
    return {
        "options": _with_optimizers(_options_run, FOUR_RANK_CODECS),
        "behaviours": _with_optimizers(_behaviours_run, FOUR_RANK_CODECS),
    }


@pytest.fixture(scope="module")
def job():
    return run_parallel(_dropin_job, 2, timeout=300)


@pytest.fixture(scope="module")
def four_rank_job():
    return run_parallel(_four_rank_job, 4, timeout=300)


@pytest.fixture(params=[2, 4])
def every_job(request):
    """The 2-rank job (every codec) and the 4-rank one (``FOUR_RANK_CODECS``)."""
    return request.getfixturevalue("job" if request.param == 2 else "four_rank_job")


@pytest.mark.parametrize(
    "case",
    range(len(SPARSE_CASES)),
    ids=[f"{c}/dense={d}/passes={p}/{o}" for c, d, p, o in SPARSE_CASES],
)
def test_sparse_embedding_trains_with_and_without_sparse_as_dense(job, case):
    (weights, sparse, (handed, whole)), (other_weights, *_) = (rank["sparse"][case] for rank in job)
    codec, dense = SPARSE_CASES[case][:2]
    if dense:
        # The embedding went by the dense allreduce, or compressed by the codec.
        assert handed == whole if codec.startswith("none") else 0 < handed < whole
    for (embedding, head), (other_embedding, other_head) in zip(weights, other_weights):
        assert torch.equal(embedding, other_embedding) and torch.equal(head, other_head)
    # As in Horovod, the optimizer is handed sparse gradients either way (SparseAdam
    # takes no others).
    assert all(sparse)
    torch.manual_seed(0)
    before = torch.nn.Embedding(50, 8, sparse=True).weight.detach()
    changed = set((weights[-1][0] != before).any(1).nonzero().reshape(-1).tolist())
    assert changed
    if codec.split(":")[0] not in ("dgc", "powersgd"):
        # Rows every rank looked up at every step moved (DGC's top-k and PowerSGD's low
        # rank may send a row's share at a later step).
        assert {0, 1, 4} <= changed
    if not codec.startswith("ef-sign"):
        # Rows no rank looked up stay (ef-sign's one bit per element has no zero).
        assert changed <= LOOKED_UP


def test_sparse_as_dense_averages_as_the_sparse_allreduce(job):
    """``none`` by a dense allreduce and by Horovod's sparse allreduce: the same training."""
    index = {case[:2]: i for i, case in enumerate(SPARSE_CASES) if case[2:] == (1, "SGD")}
    sparse, dense = (job[0]["sparse"][index["none:min_size=0", d]][0] for d in (False, True))
    for (embedding, head), (dense_embedding, dense_head) in zip(sparse, dense):
        torch.testing.assert_close(dense_embedding, embedding, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense_head, head, rtol=1e-5, atol=1e-5)


def _equal(a, b):
    """Same structure, types and values; tensors bit for bit."""
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_broadcast_after_rank0_loads_leaves_the_loaded_state_everywhere(job):
    broadcasts = job[0]["broadcast"]
    assert len(_broadcast_optimizers()) >= 12
    assert len(broadcasts) == sum(
        len(_pairs([c for i, c in BROADCAST_CASES if i == index]))
        for index in range(len(BROADCAST_OPTIONS))
    )
    for key, (loaded, _, compression, compression_after) in broadcasts.items():
        for rank in job:
            after = rank["broadcast"][key][1]
            assert after["state"].keys() == loaded["state"].keys(), key
            assert _equal(after, loaded), key
        # The broadcast's initialising step leaves rank 0's compression state alone.
        assert _equal(compression_after, compression), key


def test_the_broadcast_gives_every_rank_rank_0s_options(every_job):
    """Horovod's own test_broadcast_state_options, with every codec: ranks whose optimizers
    took different options end the broadcast with rank 0's options, of the same types, and
    its state (the worker momentum mode's m and w among it), and step on alike."""
    job = every_job
    assert len(job[0]["options"]) >= len(_broadcast_optimizers()) * len(FOUR_RANK_CODECS)
    for (name, codec), (options, state, params) in job[0]["options"].items():
        cls = getattr(torch.optim, name)
        for group in options:
            for key, want in _accepted(cls, OPTIONS[0]).items():
                assert type(group[key]) is type(want), (name, codec, key)
                assert group[key] == want, (name, codec, key, group[key])
        assert all(torch.isfinite(p).all() for p in params), (name, codec)
        for rank in job[1:]:
            other_options, other_state, other_params = rank["options"][name, codec]
            assert other_options == options and _equal(other_state, state), (name, codec)
            assert _equal(other_params, params), (name, codec)


def test_horovods_optimizer_behaviours_with_every_codec_and_every_optimizer(every_job):
    """Gradients on some ranks only, a dynamic ``requires_grad``, clipping between
    ``synchronize()`` and ``step()``, frozen parameters: the ranks step alike, the frozen
    layer stays, and a ``step()`` after ``synchronize()`` warns, as in Horovod."""
    job = every_job
    torch.manual_seed(0)
    frozen = [p.detach().clone() for p in _Branches().frozen.parameters()]
    assert job[0]["behaviours"].keys() == job[0]["options"].keys()
    for key, (after, caught) in job[0]["behaviours"].items():
        for rank in job[1:]:
            assert _equal(rank["behaviours"][key][0], after), key
        for params in after:
            assert all(torch.isfinite(p).all() for p in params), key
            assert all(torch.equal(a, b) for a, b in zip(params[2:4], frozen)), key
        assert any("skip_synchronize" in message for message in caught), (key, caught)


def test_parameter_names_as_in_horovod(job):
    names = job[0]["names"]
    assert all(rank["names"] == names for rank in job)
    in_order, in_map = names["unnamed"]
    assert in_order == [
        "allreduce.noname.0.0",
        "allreduce.noname.0.1",
        "allreduce.noname.1.0",
        "allreduce.noname.1.1",
    ]
    assert in_map == sorted(in_map)
    in_order, in_map = names["named"]
    assert in_order == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert in_map == sorted(in_order)


@pytest.mark.parametrize("case", RESUME_CASES)
def test_ranks_resume_at_the_step_rank_0_loaded(job, case):
    """The step counter, which CLT-k's leader and the adaptive mode's decisions follow,
    is taken from rank 0's checkpoint by every rank (the others would count from 0 and
    start different collectives)."""
    (params, step), (other_params, other_step) = (rank["resume"][case] for rank in job)
    assert step == other_step == 2 * RESUME_STEPS
    for a, b in zip(params, other_params):
        assert torch.equal(a, b)
