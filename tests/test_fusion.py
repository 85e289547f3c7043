"""Fusion of sharded exchanges' alltoalls (``hvd_compress.fusion``, ``hvd_compress.pt.fusion``):
the groups it forms, and that a fused step sends the same bytes and gives the same
parameters, bit for bit, as one alltoall per tensor."""

import pytest
import torch

import hvd_compress
from hvd_compress import cost, fusion

from .harness import run_parallel


def test_groups_follow_the_backward_order_and_close_at_the_threshold():
    codec = hvd_compress.BlockSign(min_size=0)
    tensors = [(f"t{i}", numel) for i, numel in enumerate([80_000, 300, 50_000, 7, 120_000, 9])]
    size = {name: cost.alltoall_nbytes(codec, numel, 4) for name, numel in tensors}
    threshold = 20_000
    groups = fusion.alltoall_groups(codec, tensors, 4, threshold)
    # Every tensor once, in the reverse order of the parameters (the backward pass's).
    assert [name for group in groups for name in group] == [name for name, _ in tensors][::-1]
    for group in groups[:-1]:  # each closed at the first member that reached the threshold
        assert sum(size[name] for name in group) >= threshold
        assert sum(size[name] for name in group[:-1]) < threshold
    assert groups == [["t5", "t4", "t3", "t2"], ["t1", "t0"]]
    alone = fusion.alltoall_groups(codec, tensors, 4, threshold=0)
    assert alone == [[name] for name, _ in tensors[::-1]]
    assert fusion.alltoall_groups(codec, [], 4) == []


class _Recorded(fusion.FusionGroup):
    """A fusion group that keeps the rows its alltoall would have joined."""

    def _alltoall(self, rows):
        self.joined = rows


def test_columns_follow_the_members_order_whatever_order_they_arrive_in():
    """Members arrive in the order their scale allreduces complete, which may differ between
    ranks (several NCCL streams); the columns, which every rank reads by the same slices,
    must not depend on it."""
    members = ["a", "b", "c", "d"]
    rows = {
        m: torch.full((2, width), i, dtype=torch.uint8)
        for i, (m, width) in enumerate(zip(members, (3, 1, 4, 2)))
    }
    layouts = []
    for arrival in (["a", "b", "c", "d"], ["d", "c", "b", "a"], ["c", "a", "d", "b"]):
        group = _Recorded(members, "g")
        for member in arrival:
            if member == "b":
                group.withdraw(member)  # on every rank alike
            else:
                group.send(member, rows[member])
        layouts.append((dict(group.columns), [r[0, 0].item() for r in group.joined]))
    assert layouts[0] == ({"a": slice(0, 3), "c": slice(3, 7), "d": slice(7, 9)}, [0, 2, 3])
    assert all(layout == layouts[0] for layout in layouts)


SHAPES = [(300, 40), (40,), (50, 300), (7, 50), (1000,), (33, 7)]


def _train_fused(configs):
    """For each (codec, threshold): 3 steps of a model of linear maps and a sparse embedding,
    every tensor through the sharded exchange; the parameters, the bytes of every step and
    the names of the alltoalls handed to Horovod."""
    import horovod.torch as hvd

    import hvd_compress.pt as hc

    hvd.init()
    results = []
    for codec, threshold in configs:
        cost.FUSION_BYTES = threshold
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        embedding = torch.nn.Embedding(20, 4, sparse=True)
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        named.insert(3, ("embedding.weight", embedding.weight))
        optimizer = hc.DistributedOptimizer(
            torch.optim.SGD([p for _, p in named], lr=0.1),
            named,
            compression=codec,
            exchange="sharded",
        )
        alltoalls, original = [], hvd.alltoall_async

        def recording(tensor, *args, **kwargs):
            alltoalls.append(kwargs["name"])
            return original(tensor, *args, **kwargs)

        hvd.alltoall_async = recording
        generator = torch.Generator().manual_seed(hvd.rank())
        step_bytes = []
        try:
            for _ in range(3):
                optimizer.zero_grad()
                loss = sum(
                    (p * torch.randn(p.shape, generator=generator)).sum() ** 2 for p in params
                )
                loss = loss + embedding(torch.tensor([hvd.rank(), 5])).sum()
                loss.backward()
                optimizer.step()
                step_bytes.append(optimizer.compression_stats()["bytes_handed"])
        finally:
            hvd.alltoall_async = original
        results.append(
            {
                "params": torch.cat([p.detach().reshape(-1) for _, p in named]),
                "bytes": step_bytes,
                "alltoalls": alltoalls,
            }
        )
    return results


@pytest.mark.multiprocess
def test_fused_alltoalls_give_the_parameters_of_one_alltoall_per_tensor():
    codecs = [
        hvd_compress.BlockSign(min_size=0),
        hvd_compress.TernGrad(min_size=0, compress_classifier=True),
    ]
    threshold = 1500  # the model's codes make several groups
    configs = [(codec, t) for codec in codecs for t in (threshold, 0)]
    per_rank = run_parallel(_train_fused, 4, configs)
    dense = [(f"p{i}", torch.Size(shape).numel()) for i, shape in enumerate(SHAPES)]
    for c, codec in enumerate(codecs):
        fused = [rank[2 * c] for rank in per_rank]
        alone = [rank[2 * c + 1] for rank in per_rank]
        groups = fusion.alltoall_groups(codec, dense, 4, threshold)
        assert 1 < len(groups) < len(dense)
        for f, a in zip(fused, alone):
            assert torch.equal(f["params"], a["params"]), codec.name
            assert torch.equal(f["params"], fused[0]["params"]), codec.name
            assert f["bytes"] == a["bytes"]
            # One alltoall per group, where there was one per tensor; the sparse embedding
            # went by Horovod's sparse allreduce and left its group on every rank.
            assert len(f["alltoalls"]) == 3 * len(groups)
            assert len(a["alltoalls"]) == 3 * len(dense)


def _tf_fused(thresholds, steps=2):
    """The TensorFlow port, eagerly: per threshold, the perceptron's parameters after
    ``steps`` steps of ef-sign through the sharded exchange, the alltoalls handed to Horovod
    and the fusion groups of its tensors."""
    import horovod.tensorflow as hvd
    import numpy as np

    from .tf_perceptron import tape_steps

    hvd.init()
    results = []
    for threshold in thresholds:
        cost.FUSION_BYTES = threshold
        codec = hvd_compress.BlockSign(min_size=0)
        alltoalls, original = [], hvd.alltoall

        def recording(tensor, *args, **kwargs):
            alltoalls.append(kwargs["name"])
            return original(tensor, *args, **kwargs)

        hvd.alltoall = recording
        try:
            *_, (_, _, variables, pipeline) = tape_steps(
                steps, False, compression=codec, exchange="sharded"
            )
        finally:
            hvd.alltoall = original
        sharded = [(plan.name, plan.numel) for plan in pipeline.plans if plan.exchange == "sharded"]
        results.append(
            {
                "params": np.concatenate([v.numpy().ravel() for v in variables]),
                "alltoalls": len(alltoalls),
                "tensors": len(sharded),
                "groups": len(fusion.alltoall_groups(codec, sharded, hvd.size())),
            }
        )
    return results


@pytest.mark.multiprocess
def test_tf_fused_alltoalls_give_the_parameters_of_one_alltoall_per_tensor():
    per_rank = run_parallel(_tf_fused, 4, [300, 0], own_job=True)
    for fused, alone in per_rank:
        assert 1 < fused["groups"] < fused["tensors"] == alone["groups"]
        assert fused["alltoalls"] == 2 * fused["groups"]
        assert alone["alltoalls"] == 2 * alone["tensors"]
        assert (fused["params"] == alone["params"]).all()
        assert (fused["params"] == per_rank[0][0]["params"]).all()
