"""The byte-count cost model and the choice of exchange."""

import pytest

import hvd_compress
from hvd_compress import cost


def test_terngrad_traffic_formulas():
    codec = hvd_compress.TernGrad()
    n = 1_000_000
    gather = cost.compressed_traffic(codec, n, 4, "allgather")
    assert gather.handed == n // 4 + 4  # 2-bit codes + the shared scale
    assert gather.sent == pytest.approx(3 * n / 4 + 2 * 3 / 4 * 4)
    sharded = cost.compressed_traffic(codec, n, 4, "sharded")
    # phase 1: 4 shards of n/4 codes at 2 bits; phase 2: one shard of sums in [-4, 4], 4 bits
    assert sharded.handed == n // 4 + n // 8 + 4
    reduce = cost.compressed_traffic(codec, n, 4, "allreduce")
    assert reduce.handed == 2 * n + 4  # float16 carrier: sums up to 2048 are exact
    assert cost.compressed_traffic(codec, n, 3000, "allreduce").handed == 4 * n + 4  # int32


def test_auto_picks_the_fewest_bytes_counting_the_alltoall_latency():
    codec = hvd_compress.TernGrad()
    assert cost.choose_exchanges(codec, [1_000_000], 2) == ["allgather"]
    assert cost.choose_exchanges(codec, [1_000_000], 4) == ["sharded"]
    assert cost.choose_exchanges(hvd_compress.FP16(), [100_000], 8) == ["allreduce"]
    # At N = 4 sharded sends 3/16 of a byte per element fewer than allgather: below
    # 200k elements the saving is less than the alltoall's latency.
    saving = (
        cost.compressed_traffic(codec, 100_000, 4, "allgather").sent
        - cost.compressed_traffic(codec, 100_000, 4, "sharded").sent
    )
    assert 0 < saving < cost.ALLTOALL_LATENCY_BYTES
    assert cost.choose_exchanges(codec, [100_000], 4) == ["allgather"]
    assert cost.choose_exchanges(codec, [300_000], 4) == ["sharded"]


def test_auto_shards_tensors_together_once_their_savings_pay_for_the_alltoall():
    codec = hvd_compress.BlockSign()
    n = 75_000

    def sent(exchange):
        return cost.compressed_traffic(codec, n, 4, exchange).sent

    # Bytes, and the work of the server that the allgather would run on every rank.
    saving = sent("allgather") - sent("sharded") + cost.server_work_saved(codec, n, 4)
    # Alone, a tensor saves less than the alltoall's latency; two save a little less, three
    # more than the latency of the one fusion group they share.
    assert 2 * saving < cost.ALLTOALL_LATENCY_BYTES < 3 * saving
    assert cost.choose_exchanges(codec, [n, n], 4) == ["allgather"] * 2
    assert cost.choose_exchanges(codec, [n, n, n], 4) == ["sharded"] * 3
    # A large tensor pays for the group, and the small one then saves bytes by joining it.
    assert cost.choose_exchanges(codec, [n, 2_000_000], 4) == ["sharded"] * 2
    assert cost.choose_exchanges(hvd_compress.FP16(), [n] * 3, 4) == ["allreduce"] * 3


def test_at_two_workers_a_two_way_codec_shards_the_tensors_whose_server_work_pays():
    codec = hvd_compress.BlockSign()

    def sent(numel, exchange):
        return cost.compressed_traffic(codec, numel, 2, exchange).sent

    # At N = 2 both exchanges send a tensor's signs once; sharded adds a shard's scale.
    assert 0 < sent(2_400_000, "sharded") - sent(2_400_000, "allgather") <= 8
    # What decides is the server, which the allgather runs on every rank over the whole
    # tensor: halved, it pays for the alltoall's latency on large tensors, not on small.
    saved = cost.server_work_saved(codec, 2_400_000, 2)
    assert saved == pytest.approx(cost.SERVER_BYTES_PER_ELEMENT * 1_200_000)
    assert saved < cost.ALLTOALL_LATENCY_BYTES < 4 * saved
    assert cost.choose_exchanges(codec, [2_400_000] * 4, 2) == ["sharded"] * 4
    assert cost.choose_exchanges(codec, [2_400_000], 2) == ["allgather"]
    assert cost.choose_exchanges(codec, [20_000] * 4, 2) == ["allgather"] * 4
    # A one-way codec has no server: its sharded sums only widen the codes.
    assert cost.server_work_saved(hvd_compress.TernGrad(), 2_400_000, 2) == 0
    terngrad = cost.choose_exchanges(hvd_compress.TernGrad(), [2_400_000] * 4, 2)
    assert terngrad == ["allgather"] * 4


def test_unknown_exchange():
    with pytest.raises(ValueError, match="exchange must be one of"):
        cost.compressed_traffic(hvd_compress.TernGrad(), 10, 2, "ring")
