"""Gradient buckets (``hvd_compress.bucketing``): where tensors go, and that coding a bucket
gives what coding its tensors one by one gives, bit for bit."""

import copy

import pytest
import torch

import hvd_compress
from hvd_compress.bucketing import BUCKET_BYTES, block_lengths, gradient_buckets
from hvd_compress.plan import plan_tensor

from .devices import DEVICES, rank_device


def _plans(codec, shapes, exchange="allgather"):
    return [
        plan_tensor(codec, f"t{i}", i, shape, True, exchange, False)
        for i, shape in enumerate(shapes)
    ]


def test_buckets_fill_in_backward_order_and_close_at_their_size():
    codec = hvd_compress.QSGD(bucket_size=4, min_size=10)
    # t1 and t3 are below min_size: sent whole, in no bucket.
    plans = _plans(codec, [(13,), (3,), (20,), (9,), (100,), (30,)])
    buckets = gradient_buckets(plans, codec, 2, bucket_bytes=4 * 40)
    assert [[m.plan.name for m in b.members] for b in buckets] == [["t5", "t4"], ["t2", "t0"]]
    # A tensor that fills a bucket alone goes alone, as it would without buckets.
    assert gradient_buckets(_plans(codec, [(50,), (50,)]), codec, 2, bucket_bytes=4 * 40) == []


def test_a_bucket_is_its_members_side_by_side():
    codec = hvd_compress.QSGD(bucket_size=4, min_size=10)
    plans = _plans(codec, [(13,), (20,), (11,)])
    [bucket] = gradient_buckets(plans, codec, 2)
    assert [(m.plan.name, m.offset) for m in bucket.members] == [
        ("t2", 0),
        ("t1", 16),
        ("t0", 40),
    ]
    assert bucket.numel == 56  # every member starts on a byte of packed codes
    segments, blocks = block_lengths(codec, bucket.parts())
    # t2: blocks 4, 4, 3, then 5 of padding; t1: five blocks of 4, then 4 of padding;
    # t0: blocks 4, 4, 4, 1, then 3 of padding.
    assert segments == [4, 4, 3, 5] + [4] * 5 + [4] + [4, 4, 4, 1, 3]
    assert blocks == [0, 1, 2] + [4, 5, 6, 7, 8] + [10, 11, 12, 13]
    [allreduced] = gradient_buckets(_plans(codec, [(13,), (20,)], "allreduce"), codec, 2)
    assert [m.offset for m in allreduced.members] == [0, 20]  # values need no alignment
    [sharded] = gradient_buckets(_plans(codec, [(13,), (20,)], "sharded"), codec, 2)
    assert [m.offset for m in sharded.members] == [0, 24]  # packed codes, as allgather's


def test_a_two_way_codecs_sharded_bucket_shards_each_member_as_alone():
    """Each member's stretch is its own shards (its exchange's ``shard_length``); shard r
    of the bucket is the r-th shard of every member, padding after each member's part."""
    codec = hvd_compress.BlockSign(min_size=1)
    plans = _plans(codec, [(13,), (40,), (3,)], "sharded")
    [bucket] = gradient_buckets(plans, codec, 3)
    # Shards of 8 (13 / 3, to whole bytes), 16 and 8 elements, three of each.
    assert bucket.shards == 3
    assert [(m.plan.name, m.offset) for m in bucket.members] == [
        ("t2", 0),
        ("t1", 24),
        ("t0", 72),
    ]
    assert bucket.numel == 96
    pieces = bucket.shard_pieces(1)
    assert [(p.member.plan.name, p.column, p.length, p.valid, p.first) for p in pieces] == [
        ("t2", 0, 8, 0, 8),
        ("t1", 8, 16, 16, 16),
        ("t0", 24, 8, 5, 8),
    ]
    # The allgather's two-way buckets are aligned as the one-way codecs' are.
    [gathered] = gradient_buckets(_plans(codec, [(13,), (40,)]), codec, 3)
    assert gathered.shards == 0 and [m.offset for m in gathered.members] == [0, 40]


def test_no_buckets_where_tensors_go_their_own_way():
    quantizer = hvd_compress.TernGrad(min_size=1)
    assert gradient_buckets(_plans(quantizer, [(8,), (8,)], "two-level"), quantizer, 2) == []
    assert gradient_buckets(_plans(quantizer, [(8,), (8,)]), quantizer, 2, bucket_bytes=0) == []
    # Sparse and variable-length codecs send tensors alone.
    for codec in (
        hvd_compress.QSGD(wire="elias", min_size=1),
        hvd_compress.AdaComp(min_size=1),
    ):
        assert gradient_buckets(_plans(codec, [(8,), (8,)]), codec, 2) == []


def _bucketed_and_alone(kind, cases, steps=3):
    """For each (codec, exchange, error feedback, path) of ``cases``, on the eager ops or
    on Triton's kernels (the device path; on CPU under the interpreter): ``Net``'s
    parameters after ``steps`` steps, one of which has a NaN on rank 1, with buckets and
    without; then after a checkpoint of the bucketed run is loaded into an optimizer
    without buckets and one with, and both take a step more. Also the number of buckets
    and the residuals' names in the checkpoint."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc
    from hvd_compress.pt import fused, triton_fused

    from .pt_jobs import Net

    hvd.init()
    device = rank_device(kind)
    data = torch.Generator().manual_seed(hvd.rank())
    batches = [
        (torch.randn(16, 64, generator=data), torch.randint(0, 10, (16,), generator=data))
        for _ in range(steps + 1)
    ]

    def optimizer_of(model, codec, exchange, feedback, bucket_bytes):
        return hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model.named_parameters(),
            compression=codec,
            exchange=exchange,
            error_feedback=feedback,
            bucket_bytes=bucket_bytes,
        )

    def step(model, optimizer, index):
        x, y = (t.to(device) for t in batches[index])
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if index == 1 and hvd.rank() == 1:
            model.middle.weight.grad[2, 3] = float("nan")
        optimizer.step()

    def train(codec, exchange, feedback, bucket_bytes):
        torch.manual_seed(0)
        model = Net().to(device)
        optimizer = optimizer_of(model, codec, exchange, feedback, bucket_bytes)
        for index in range(steps):
            step(model, optimizer, index)
        return model, optimizer

    def resumed(checkpoint, codec, exchange, feedback, bucket_bytes):
        torch.manual_seed(1)
        model = Net().to(device)
        # A copy, as torch.load makes: the optimizer would step the saved momentum itself.
        checkpoint = copy.deepcopy(checkpoint)
        model.load_state_dict(checkpoint["model"])
        optimizer = optimizer_of(model, codec, exchange, feedback, bucket_bytes)
        optimizer.load_state_dict(checkpoint["optimizer"])
        step(model, optimizer, steps)
        return [p.detach().clone() for p in model.parameters()]

    enabled = fused.ENABLED, triton_fused.ENABLED, triton_fused.ON_CPU
    results = {}
    try:
        fused.ENABLED = False
        for codec, exchange, feedback, path in cases:
            triton_fused.ENABLED = path == "kernels"
            triton_fused.ON_CPU = path == "kernels" and kind == "cpu"
            codec = f"{codec}:min_size=100"
            launched = triton_fused.launches
            bucketed, optimizer = train(codec, exchange, feedback, BUCKET_BYTES)
            launched = triton_fused.launches > launched
            alone, _ = train(codec, exchange, feedback, 0)
            checkpoint = {"model": bucketed.state_dict(), "optimizer": optimizer.state_dict()}
            state = checkpoint["optimizer"]["hvd_compress"]
            compressed = [
                name
                for name, _, route, _ in optimizer.compression_stats()["tensors"]
                if not route.startswith("allreduce (")
            ]
            results[codec, exchange, feedback, path] = {
                "buckets": len(optimizer._hvdc_pipeline.buckets),
                "on the path": launched == (path == "kernels"),
                "same": all(
                    torch.equal(a, b) for a, b in zip(bucketed.parameters(), alone.parameters())
                ),
                "finite": all(torch.isfinite(p).all() for p in bucketed.parameters()),
                # The residuals of the compressed tensors, under their names.
                "saved by name": sorted(state.get("worker", {}))
                == sorted(compressed if feedback else []),
                "server saved by name": sorted(state.get("server", {}))
                == sorted(compressed if "ef-sign" in codec else []),
                "resumed same": all(
                    torch.equal(a, b)
                    for a, b in zip(
                        resumed(checkpoint, codec, exchange, feedback, 0),
                        resumed(checkpoint, codec, exchange, feedback, BUCKET_BYTES),
                    )
                ),
            }
    finally:
        fused.ENABLED, triton_fused.ENABLED, triton_fused.ON_CPU = enabled
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", DEVICES)
def test_a_bucket_codes_as_its_tensors_alone(kind):
    """Off the CPU kernels, on the eager ops and on Triton's, training with buckets leaves
    every parameter bitwise equal to training tensor by tensor, for every codec that takes
    buckets, on both exchanges that do, with and without error feedback, through a step
    that a NaN on one rank skips; a checkpoint keeps residuals under the tensors' names,
    and resumes alike with or without buckets."""
    from hvd_compress.pt import triton_fused

    from .harness import run_parallel

    cases = [
        ("terngrad", "allgather", True, "eager"),
        ("terngrad", "allreduce", None, "eager"),
        ("qsgd", "allreduce", True, "eager"),
        ("qsgd-inf", "allgather", None, "eager"),
        ("nuqsgd", "allgather", True, "eager"),
        ("qsgd-inf", "sharded", None, "eager"),
        ("ef-sign", "allgather", True, "eager"),
        ("ef-sign:max_block_size=7", "sharded", True, "eager"),
        ("ef-sign", "sharded", True, "eager"),
    ]
    if triton_fused.ENABLED and (kind == "cuda" or triton_fused.INTERPRETED):
        cases += [
            ("terngrad", "allgather", True, "kernels"),
            ("qsgd", "allreduce", True, "kernels"),
            ("nuqsgd", "allgather", None, "kernels"),
            ("terngrad", "sharded", True, "kernels"),
            ("ef-sign", "allgather", True, "kernels"),
            ("ef-sign:max_block_size=7", "sharded", True, "kernels"),
        ]
    results = run_parallel(_bucketed_and_alone, 2, kind, cases)
    assert results[0] == results[1]
    for case, result in results[0].items():
        assert result == {
            "buckets": 1,
            "on the path": True,
            "same": True,
            "finite": True,
            "saved by name": True,
            "server saved by name": True,
            "resumed same": True,
        }, (case, result)


def _sparse_member():
    """The error of a step whose gradient bucket meets a sparse gradient (a sparse
    embedding's), off the kernels."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc
    from hvd_compress.pt import fused, triton_fused

    hvd.init()
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 16, sparse=True),
        torch.nn.Linear(16, 200),
        torch.nn.Linear(200, 10),
    )
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression="terngrad:min_size=100",
        exchange="allgather",
    )
    enabled = fused.ENABLED, triton_fused.ENABLED
    try:
        fused.ENABLED = triton_fused.ENABLED = False
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()
    except ValueError as error:
        return str(error)
    finally:
        fused.ENABLED, triton_fused.ENABLED = enabled
    return None


@pytest.mark.multiprocess
def test_a_sparse_gradient_in_a_bucket_fails_on_every_rank_with_the_remedies():
    from .harness import run_parallel

    for message in run_parallel(_sparse_member, 2):
        assert message is not None and "0.weight's gradient is sparse" in message, message
        assert "sparse_as_dense=True" in message and "bucket_bytes=0" in message
