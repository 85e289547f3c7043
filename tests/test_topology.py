"""The two-level exchange's layout, reference and traffic, without Horovod."""

import numpy as np
import pytest

import hvd_compress
from hvd_compress import cost, simulate
from hvd_compress.topology import Nodes, moved


def test_nodes_from_each_ranks_node():
    nodes = Nodes.from_placement([0, 0, 1, 1, 2, 2])
    assert nodes.ranks == ((0, 1), (2, 3), (4, 5))
    assert (nodes.local_size, nodes.cross_size) == (2, 3)
    assert nodes.cross_sets() == [[0, 2, 4], [1, 3, 5]]
    assert [nodes.locate(rank) for rank in range(6)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert nodes.shard_length(7) == 4


def test_nodes_refuse_uneven_or_unordered_layouts():
    with pytest.raises(ValueError, match="same number of ranks"):
        Nodes.from_placement([0, 0, 1])
    with pytest.raises(ValueError, match="0..N-1"):
        Nodes(((0, 1), (2, 4)))
    with pytest.raises(ValueError, match="ascending"):
        Nodes(((1, 0), (2, 3)))


class _Horovod:
    """What ``topology.moved`` reads of Horovod: the world's shape and its process sets,
    which a re-initialisation forgets (their ``size`` then raises, as Horovod's does)."""

    global_process_set = object()

    def __init__(self, size, local_size, cross_size):
        self.shape = (size, local_size, cross_size)
        self.known = set()

    def size(self):
        return self.shape[0]

    def local_size(self):
        return self.shape[1]

    def cross_size(self):
        return self.shape[2]


class _ProcessSet:
    def __init__(self, horovod, ranks):
        self.horovod, self.ranks = horovod, ranks
        horovod.known.add(self)

    def size(self):
        if self not in self.horovod.known:
            raise ValueError("Process set does not exist or has not been registered.")
        return len(self.ranks)


def test_a_layout_moves_with_the_worlds_shape_or_its_forgotten_sets():
    horovod, nodes = _Horovod(4, 2, 2), Nodes(((0, 1), (2, 3)))
    sets = (_ProcessSet(horovod, [0, 1]), _ProcessSet(horovod, [0, 2]))
    assert not moved(horovod, nodes, sets)
    horovod.known.clear()  # Horovod initialised again: every added set forgotten
    assert moved(horovod, nodes, sets)
    for shape in [(2, 1, 2), (2, 2, 1), (6, 2, 3)]:
        assert moved(_Horovod(*shape), nodes, (None, None))
    # One rank per node: no set but the global one, which a new world keeps.
    horovod = _Horovod(2, 1, 2)
    assert not moved(horovod, Nodes(((0,), (1,))), (None, horovod.global_process_set))


def _inputs(world, numel, length, seed=0):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(world)]
    return grads, [rng.random(length) for _ in range(world)]


def test_reference_reduces_to_the_flat_exchange_and_to_the_node_average():
    codec = hvd_compress.TernGrad(min_size=0)
    grads, uniforms = _inputs(4, 37, 37)
    one_rank_nodes = Nodes(((0,), (1,), (2,), (3,)))
    np.testing.assert_array_equal(
        simulate.two_level_step(codec, grads, one_rank_nodes, uniforms),
        simulate.exchange_step(codec, grads, uniforms),
    )
    one_node = Nodes(((0, 1, 2, 3),))
    np.testing.assert_allclose(
        simulate.two_level_step(codec, grads, one_node, uniforms),
        np.mean(np.stack(grads), axis=0),
        rtol=1e-6,
    )


def test_reference_exchanges_each_shard_among_the_nodes():
    codec = hvd_compress.TernGrad(min_size=0)
    nodes = Nodes(((0, 1), (2, 3)))
    grads, uniforms = _inputs(4, 37, 19)
    got = simulate.two_level_step(codec, grads, nodes, uniforms)
    means = [np.pad((grads[a] + grads[b]) / np.float32(2), (0, 1)) for a, b in nodes.ranks]
    for shard, ranks in enumerate(nodes.cross_sets()):
        cut = slice(19 * shard, 19 * (shard + 1))
        want = simulate.exchange_step(codec, [m[cut] for m in means], [uniforms[r] for r in ranks])
        np.testing.assert_array_equal(got[cut][: 37 - cut.start], want[: 37 - cut.start])


def test_two_level_traffic_on_each_tier():
    codec = hvd_compress.TernGrad(min_size=0)
    numel = 10_000
    flat = cost.compressed_traffic(codec, numel, 4, cost.two_level_inner(codec, numel, 4))
    assert cost.two_level_traffic(codec, numel, 1, 4) == flat
    whole = cost.two_level_traffic(codec, numel, 4, 1)
    assert whole.handed == 4 * 2500 * 4 + 2500 * 4 and whole.sent == 2 * 3 * 2500 * 4
    both = cost.two_level_traffic(codec, numel, 2, 2)
    inner = cost.compressed_traffic(codec, 5000, 2, cost.two_level_inner(codec, 5000, 2))
    assert both.sent == 2 * 5000 * 4 + inner.sent
