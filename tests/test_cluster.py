"""The two-tier model of the collectives (``hvd_compress.cluster``): with no latency it
charges exactly the bytes of ``hvd_compress.cost`` on the busiest link; its message rounds;
the two-level exchange on one node, one rank per node, and shared node links."""

import pytest

from hvd_compress import cluster, cost
from hvd_compress.registry import resolve

BITS = 8e9  # a byte a nanosecond
NO_LATENCY = cluster.Tier(0.0, BITS)
SIZES = [1_000_000, 65_536, 2_359_296, 4_096]


def _seconds(nbytes):
    return 8 * nbytes / BITS


@pytest.mark.parametrize("workers", [2, 4, 16])
def test_ring_collectives_carry_the_cost_models_bytes(workers):
    nbytes = 10_000_000
    assert cluster.allreduce(NO_LATENCY, workers, nbytes) == pytest.approx(
        _seconds(cost.allreduce_traffic(nbytes, workers).sent)
    )
    assert cluster.allgather(NO_LATENCY, workers, nbytes) == pytest.approx(
        _seconds((workers - 1) * nbytes)
    )
    assert cluster.allreduce(NO_LATENCY, 1, nbytes) == cluster.allgather(NO_LATENCY, 1, nbytes) == 0


def test_rounds_are_charged_per_fused_buffer():
    tier = cluster.Tier(1e-3, float("inf"))
    two_buffers = cluster.HOROVOD_FUSION_BYTES + 1
    assert cluster.allreduce(tier, 8, 1000) == pytest.approx(2 * 7 * 1e-3)
    assert cluster.allreduce(tier, 8, two_buffers) == pytest.approx(2 * 2 * 7 * 1e-3)
    assert cluster.allgather(tier, 8, two_buffers) == pytest.approx(2 * 7 * 1e-3)


@pytest.mark.parametrize("name", ["terngrad", "qsgd-inf", "ef-sign"])
@pytest.mark.parametrize("workers", [2, 4, 8])
def test_flat_exchanges_send_what_the_cost_model_counts(name, workers):
    codec = resolve(name)
    shape = cluster.Cluster(workers, 1, NO_LATENCY, NO_LATENCY)
    for exchange in cost.exchanges_for(codec):
        expected = (
            sum(cost.compressed_traffic(codec, n, workers, exchange).sent for n in SIZES)
            + cost.uncompressed_traffic(5000, workers).sent
        )
        seconds = cluster.exchange_seconds(codec, SIZES, 5000, shape, exchange)
        assert seconds == pytest.approx(_seconds(expected)), exchange


@pytest.mark.parametrize("name", ["terngrad", "ef-sign"])
def test_the_two_level_exchange_on_its_edge_layouts(name):
    codec = resolve(name)
    slow = cluster.Tier(0.0, 1e8)
    # One rank per node: the flat exchange of each tensor by the inner exchange.
    shape = cluster.Cluster(4, 1, NO_LATENCY, slow)
    inner = [cost.two_level_inner(codec, n, 4) for n in SIZES]
    assert len(set(inner)) == 1
    assert cluster.exchange_seconds(codec, SIZES, 0, shape, cost.TWO_LEVEL) == pytest.approx(
        cluster.exchange_seconds(codec, SIZES, 0, shape, inner[0])
    )
    # One node: an fp32 reduce-scatter and allgather inside, nothing between.
    shape = cluster.Cluster(1, 4, NO_LATENCY, slow)
    padded = sum(-(-n // 4) * 4 for n in SIZES)
    assert cluster.exchange_seconds(codec, SIZES, 0, shape, cost.TWO_LEVEL) == pytest.approx(
        cluster.allreduce(NO_LATENCY, 4, 4 * padded)
    )
    # Averaged by an allreduce (CPU tensors): that allreduce, then the allgather of the
    # shards, 3 (L - 1) / L of the padded gradient in all.
    by_allreduce = cluster.exchange_seconds(
        codec, SIZES, 0, shape, cost.TWO_LEVEL, node_allreduce=True
    )
    assert by_allreduce == pytest.approx(_seconds(3 * 3 / 4 * 4 * padded))


def test_a_node_link_carries_the_shards_of_all_its_ranks():
    codec = resolve("terngrad")
    fast = cluster.Tier(0.0, float("inf"))
    nodes, per_node = 4, 8
    shape = cluster.Cluster(nodes, per_node, fast, NO_LATENCY)
    length = -(-SIZES[0] // per_node)
    inner = cost.two_level_inner(codec, length, nodes)
    per_rank = cost.compressed_traffic(codec, length, nodes, inner).sent
    seconds = cluster.exchange_seconds(codec, SIZES[:1], 0, shape, cost.TWO_LEVEL)
    assert seconds == pytest.approx(_seconds(per_node * per_rank))


def test_hierarchical_allreduce_sends_fewer_bytes_between_nodes_and_fewer_rounds():
    shape = cluster.Cluster(16, 8, cluster.Tier(0.0, float("inf")), NO_LATENCY)
    numel = 25_000_000
    flat = cluster.whole_seconds(shape, numel, cluster.FP32)
    hierarchical = cluster.whole_seconds(shape, numel, cluster.HIERARCHICAL)
    # 2 (M - 1) / M against 2 (N - 1) / N of the gradient on a node's link.
    assert hierarchical / flat == pytest.approx((15 / 16) / (127 / 128))
    slow_rounds = cluster.Cluster(16, 8, cluster.Tier(0.0, float("inf")), cluster.Tier(1e-3, 1e30))
    # 2 (M - 1) rounds for the shard (one buffer), 2 (N - 1) per buffer for the flat ring.
    assert cluster.whole_seconds(slow_rounds, numel, cluster.HIERARCHICAL) == pytest.approx(
        2 * 15 * 1e-3
    )
    assert cluster.whole_seconds(slow_rounds, numel, cluster.FP32) == pytest.approx(
        2 * 127 * 2 * 1e-3
    )


def test_an_allgathers_decode_reads_every_ranks_codes():
    codec = resolve("terngrad")
    small = cluster.codec_bytes_per_element(codec, "allgather", 8)
    large = cluster.codec_bytes_per_element(codec, "allgather", 1024)
    assert large - small == pytest.approx((1024 - 8) * codec.code_space.width / 8)


def test_the_projected_models_are_the_benchmarks():
    from benchmarks import projection

    resnet = projection.resnet50_tensors()
    assert len(resnet) == 161 and sum(n for n, _ in resnet) == 25_557_032
    assert [head for _, head in resnet[-2:]] == [True, True]
    assert 0.95e9 < sum(n for n, _ in projection.transformer_tensors()) < 1.1e9


def test_on_one_node_an_alltoall_uses_every_ranks_own_link():
    codec = resolve("ef-sign")
    one_node = cluster.Cluster(1, 4, NO_LATENCY, cluster.Tier(0.0, 1.0))
    four_nodes = cluster.Cluster(4, 1, NO_LATENCY, NO_LATENCY)
    assert cluster.exchange_seconds(codec, SIZES, 0, one_node, "sharded") == pytest.approx(
        cluster.exchange_seconds(codec, SIZES, 0, four_nodes, "sharded")
    )
