"""How one tensor's codes cross the network, built only from Horovod's TensorFlow collectives.

Mirrors ``hvd_compress.pt.exchange``. Every exchange delivers the same decoded gradient to
every rank, in two calls that build its collectives as TensorFlow ops: ``start`` the first,
``finish`` the rest and the decoding. Inside a ``tf.function`` the executor runs the
collectives of all tensors concurrently as their inputs become ready (Horovod's ops are
asynchronous kernels, matched across ranks by name), and eagerly every rank runs them in the
same order. The two calls are for the sharded exchange: its alltoall goes through an
``AlltoallFusion`` (``hvd_compress.tf.fusion``) with those of other tensors, so every
tensor's ``start`` comes before any ``finish``. The byte-count model of each exchange is in
``hvd_compress.cost``.

Summing exchanges (``Allreduce``, ``Sharded``) need summable codes under one scale for all
workers; ``Allgather`` also carries each worker's own scales (prefixed to its packed codes as
raw float32 bytes, so one collective moves both).

Sparse codecs have exchanges of their own, chosen by what their worker sends
(``codec.message``): ``SparseAllgather`` (AdaComp), ``LeaderAllreduce`` (CLT-k),
``TopKAllgather`` (DGC) and ``LowRankAllreduce`` (PowerSGD). What a worker sends decides
what its memory keeps, so they run compensate -> compress -> update on the worker's memory
(passed in, not kept) around their collectives.
"""

import contextlib
import re
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import exchange as layout
from hvd_compress import watchdog
from hvd_compress.cost import TF_ALLREDUCE_DTYPES

from . import decoding, elias, fused
from .codec import divide
from .packing import float_rows, pack, sum_rows, unpack


def collective_name(plan):
    """A Horovod collective's name for ``plan``: unique, and valid as a TensorFlow op name
    (Horovod matches collectives across ranks by this name)."""
    return f"hvdc.{plan.index}.{re.sub(r'[^A-Za-z0-9_.-]', '_', plan.name)}"


def codes_name(plan):
    """The name of the collective, or fusion group member, of ``plan``'s codes."""
    return collective_name(plan) + ".codes"


class Meter(layout.Meter):
    """``hvd_compress.exchange.Meter`` in tensors (payload lengths of the Elias wire and of
    sparse messages are only known at run time): ``take`` in all, ``by_tensor``. ``clock``
    holds (``time.perf_counter()``, elements) of each hand: run eagerly, the moment the
    tensor was ready and its collective not yet begun, which the adaptive mode's timing
    pass reads (traced, only the moment of tracing)."""

    def __init__(self):
        super().__init__()
        self.counts = []
        self.by_tensor = {}
        self.clock = []

    def hand(self, tensor):
        nbytes = tf.size(tensor, out_type=tf.int64) * tensor.dtype.size
        self.counts.append(nbytes)
        self.clock.append((time.perf_counter(), tensor.shape.num_elements() or 0))
        self.by_tensor[self.tensor] = self.by_tensor.get(self.tensor, 0) + nbytes
        return tensor

    def take(self):
        """The bytes counted since the last ``take`` (``by_tensor`` starts over too)."""
        total = tf.add_n(self.counts) if self.counts else tf.constant(0, tf.int64)
        self.counts, self.by_tensor, self.clock = [], {}, []
        return total


# process set id -> ``watchdog.Peers`` of its ranks, from the agreement (``meet``).
_peers = {}
# The thread that ends a step whose exchange outlasts the watchdog's bound, started by the
# first exchange, and the process set of the exchange it watches.
_monitor = None
_watched_set = None


def meet(process_set, addresses, rank):
    """Takes the watchdog addresses of ``process_set``'s ranks (gathered by the
    agreement), which the monitor asks when its bound runs out."""
    _peers[process_set.process_set_id] = watchdog.Peers(addresses, rank)


def waiting(kind, name, process_set):
    """Marks this process as waiting in the collective ``name`` of ``process_set`` for the
    watchdog's monitor (``watchdog.Monitor``), which shuts Horovod down, failing the wait
    on every rank, if it outlasts ``watchdog.timeout()``. Eager: around a collective that
    runs as it is called."""
    global _monitor, _watched_set
    _watched_set = process_set.process_set_id
    watchdog.WAITS.enter(kind, name)
    if _monitor is None:
        _monitor = watchdog.Monitor(lambda: _peers.get(_watched_set), hvd.shutdown)


def waited():
    """Marks the end of ``waiting``'s wait."""
    watchdog.WAITS.leave()


@contextlib.contextmanager
def watched(kind, name, process_set):
    """``waiting`` around an eager collective of ``process_set``, ``waited`` when it
    returns or raises."""
    waiting(kind, name, process_set)
    try:
        yield
    finally:
        waited()


def mark_exchange_start(step, process_set):
    """An op that marks the start of step ``step``'s exchange for the watchdog: built
    before the step's collectives, it has no input but the step, so a traced step runs it
    as the step starts. A traced step's collectives run inside the graph, where Python
    cannot poll them. None where the watchdog is off (``HVD_COMPRESS_TIMEOUT=0`` when the
    step is traced)."""
    if watchdog.timeout() is None:
        return
    tf.numpy_function(
        lambda value: waiting("gradient exchange", f"hvdc.step.{value}", process_set),
        [step],
        [],
        stateful=True,
    )


def mark_exchange_end(outputs):
    """An op that marks the end of the exchange (``mark_exchange_start``) once every one
    of ``outputs`` (its gradients) is ready; none where the watchdog is off."""
    if watchdog.timeout() is None:
        return
    with tf.control_dependencies(tf.nest.flatten(outputs, expand_composites=True)):
        tf.numpy_function(waited, [], [], stateful=True)


def _bytes(floats):
    """float32 values as their raw bytes, flat."""
    return tf.reshape(tf.bitcast(tf.cast(floats, tf.float32), tf.uint8), [-1])


def _gather_rows(row, name, process_set):
    """Every worker's ``row`` (one per rank of ``process_set``, all of the same static
    length), as rows."""
    rows = hvd.allgather(row[None], name=name, ignore_name_scope=True, process_set=process_set)
    # Horovod's shape function leaves the gathered axes unknown; the codes need them.
    return tf.reshape(rows, [process_set.size(), row.shape[0]])


def _gather_with_sizes(payload, name, meter, process_set):
    """Every worker's flat byte ``payload``, whose length differs between workers, in rank
    order: one allgather of the payloads and one of their lengths to split them apart."""
    data = hvd.allgather(
        meter.hand(payload), name=name, ignore_name_scope=True, process_set=process_set
    )
    size = meter.hand(tf.size(payload, out_type=tf.int64)[None])
    sizes = hvd.allgather(
        size, name=f"{name}.size", ignore_name_scope=True, process_set=process_set
    )
    return tf.split(data, sizes, num=process_set.size())


class _Exchange(layout.Exchange):
    """``hvd_compress.exchange.Exchange`` in TensorFlow, over Horovod's global process set
    unless told another; ``finite`` is a boolean tensor, ``selected`` [k, 1] int64
    indices."""

    def __init__(self, *args, process_set=hvd.global_process_set, **kwargs):
        super().__init__(*args, process_set=process_set, **kwargs)

    def _fused(self, scale):
        """Whether the kernels decode codes under ``scale`` (None for unscaled codecs)."""
        return scale is not None and fused.applies(self.codec, scale)

    def payload(self) -> tf.TensorSpec:
        """The format this exchange hands over one worker's codes in, for a kernel to
        encode into (``fused.encode``; ``start_packed`` sends it)."""
        return tf.TensorSpec([self.codec.code_space.packed_nbytes(self.numel)], tf.uint8)

    def _servers_signs(self, packed, scales, length):
        """The first ``length`` signs of each server's row of ``packed`` times that server's
        one scale (``scales``, one per row). Every value is +-its server's scale, NaN for a
        non-finite one, so ``finite`` is read off the scales (a tensor: nothing waits for
        the device, which is why every device gets it here, unlike in the PyTorch port)."""
        self.finite = tf.reduce_all(tf.math.is_finite(scales))
        if self._fused(scales):
            return fused.scaled_signs(packed, scales, length)
        signs = unpack(packed, self.codec.code_space, length)
        return self.codec.decode(signs, tf.reshape(scales, [-1, 1]), 1)


class Allreduce(_Exchange):
    """Code values summed by one allreduce, in the narrowest carrier that cannot overflow."""

    name = "allreduce"

    def __init__(self, codec, numel, world_size, meter, count, server=None, fusion=None, **options):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.carrier = tf.as_dtype(
            codec.value_space.allreduce_carrier(world_size, TF_ALLREDUCE_DTYPES)
        )

    def payload(self) -> tf.TensorSpec:
        """The codes' values in the carrier."""
        return tf.TensorSpec([self.numel], self.carrier)

    def packed(self, codes):
        """``codes`` as ``payload`` holds them: their values in the carrier."""
        return tf.cast(self.codec.values(codes), self.carrier)

    def start(self, codes, scale, name):
        return self.start_packed(self.packed(codes), scale, name)

    def start_packed(self, payload, scale, name):
        """``start`` for values already in the carrier (``fused``)."""
        total = hvd.allreduce(
            self.meter.hand(payload),
            op=hvd.Sum,
            name=name,
            ignore_name_scope=True,
            process_set=self.process_set,
        )
        return total, scale

    def finish(self, pending):
        total, scale = pending
        receiving = fused if self._fused(scale) else decoding
        return receiving.decoded_totals(self.codec, total, scale, self.count)


class Allgather(layout.Allgather, _Exchange):
    """Every worker's packed codes (and own scales, if it has them) reach every worker.

    Variable-length payloads (``wire="elias"``) travel as one flat byte tensor per worker,
    with a second allgather of their lengths to split them apart.
    """

    def packed(self, codes):
        """``codes`` packed as ``payload`` holds them (fixed-width codes only)."""
        return tf.reshape(pack(codes[None], self.codec.code_space), [-1])

    def start(self, codes, scale, name):
        payload = elias.encode(codes) if self.elias else self.packed(codes)
        return self.start_packed(payload, scale, name)

    def start_packed(self, payload, scale, name):
        """``start`` for codes already packed (``fused``)."""
        if self.own_scale:
            payload = tf.concat([_bytes(scale), payload], axis=0)
        if self.elias:
            return _gather_with_sizes(payload, name, self.meter, self.process_set), scale
        return _gather_rows(self.meter.hand(payload), name, self.process_set), scale

    def _codes(self, gathered):
        """Each worker's codes (rows) and own scales, from the gathered payloads."""
        if self.elias:
            codes = tf.stack([elias.decode(c[self.scale_bytes :], self.numel) for c in gathered])
            heads = tf.stack([c[: self.scale_bytes] for c in gathered])
        else:
            codes = unpack(gathered[:, self.scale_bytes :], self.codec.code_space, self.numel)
            heads = gathered[:, : self.scale_bytes]
        return codes, float_rows(heads) if self.own_scale else None

    def finish(self, pending):
        gathered, scale = pending
        if self.server is not None and self.scale_bytes == 4 and self._fused(scale):
            # The replicated server of one block per tensor.
            packed, server_scale = fused.server_step(
                self.server, self.codec, gathered, self.scale_bytes, 0, self.count, self.numel
            )
            return self._servers_signs(packed[None], server_scale, self.numel)[0]
        if not self.elias and not self.own_scale:
            receiving = fused if self._fused(scale) else decoding
            return receiving.decoded_sums(self.codec, gathered, scale, self.count, self.numel)
        if not self.elias and self.server is None and self._fused(scale):
            return fused.decoded_own_scales(
                self.codec, gathered, self.scale_bytes, self.count, self.numel
            )
        codes, own_scales = self._codes(gathered)
        values = self.codec.values(codes)
        if not self.own_scale:
            return self.codec.decode(sum_rows(values), scale, self.count)
        if self.server is None:
            return tf.reduce_sum(self.codec.decode(values, own_scales, self.count), axis=0)
        # Replicated server: every rank runs the same server step on every worker's message,
        # averaged as the sharded server averages its shard (sum, then divide).
        average = divide(
            tf.reduce_sum(self.codec.decode(values, own_scales, 1), axis=0), self.count
        )
        return self.server(self.codec, average)[2]


class Sharded(layout.Sharded, _Exchange):
    """Reduce-scatter by alltoall, then allgather of the packed partial sums.

    Rank k receives shard k of every worker's codes, sums their values and packs the sum in
    the narrowest width that holds it (``value_space.summed(world_size)``); an allgather
    returns all summed shards to everyone. Bytes per worker stay nearly flat as the world
    grows.
    """

    def payload(self) -> tf.TensorSpec:
        """The codes of all shards, padded with 0 to ``world_size`` shards."""
        return tf.TensorSpec(
            [self.codec.code_space.packed_nbytes(self.world_size * self.length)], tf.uint8
        )

    def packed(self, codes):
        """``codes`` as ``payload`` holds them: padded to ``world_size`` shards, packed."""
        padded = tf.pad(codes, [[0, self.world_size * self.length - self.numel]])
        shards = pack(tf.reshape(padded, [self.world_size, self.length]), self.codec.code_space)
        return tf.reshape(shards, [-1])

    def start(self, codes, scale, name):
        return self.start_packed(self.packed(codes), scale, name)

    def start_packed(self, packed, scale, name):
        """``start`` for codes already packed (``fused``): ``payload``'s format."""
        shards = tf.reshape(packed, [self.world_size, -1])
        return self.fusion.send(name, self.meter.hand(shards)), scale, name

    def finish(self, pending):
        fusion, scale, name = pending
        received = fusion.receive(name)
        receiving = fused if self._fused(scale) else decoding
        payload = receiving.summed_codes(self.codec, received, self.length, self.total_space)
        rows = _gather_rows(self.meter.hand(payload), f"{name}.sum", self.process_set)
        return receiving.decoded_segments(
            self.codec, rows, self.total_space, self.length, scale, self.count, self.numel
        )


class ShardedServer(layout.ShardedServer, _Exchange):
    def start(self, codes, scale, name):
        return self.start_packed(self.packed(codes), scale, name)

    def start_packed(self, packed, scale, name):
        """``start`` for codes already packed (``fused``)."""
        # The framing stays in graph ops, unlike the PyTorch port's kernel calls: a
        # tf.numpy_function per tensor costs more than the ops it would replace.
        shards = self._shards(packed, self.world_size)
        heads = tf.tile(_bytes(scale)[None], [self.world_size, 1])
        return self.fusion.send(name, self.meter.hand(tf.concat([heads, shards], axis=1))), name

    def finish(self, pending):
        fusion, name = pending
        received = fusion.receive(name)
        rank = self.process_set.rank()
        scales = float_rows(received[:, : self.scale_bytes])
        start, valid = rank * self.length, self.valid(rank)
        block_length = self.codec.bucket_length(self.numel)
        first_block = start // block_length
        one_block = valid and (start + valid - 1) // block_length == first_block
        if one_block and self._fused(scales):
            packed, server_scale = fused.server_step(
                self.server, self.codec, received, self.scale_bytes, first_block, self.count, valid
            )
        else:
            signs = unpack(received[:, self.scale_bytes :], self.codec.code_space, self.length)
            # Every worker's scales of the blocks this shard's elements are in: N x numel / N
            # of them, not every block's scale expanded over the whole tensor (N x numel).
            blocks = tf.range(start, start + valid) // block_length
            average = divide(
                tf.reduce_sum(
                    tf.cast(signs[:, :valid], tf.float32) * tf.gather(scales, blocks, axis=1),
                    axis=0,
                ),
                self.count,
            )
            codes, server_scale, _ = self.server(self.codec, average)
            packed = self.packed(codes)
        padded_scale = tf.pad(
            server_scale, [[0, self.server_scale_bytes // 4 - self.codec.buckets(valid)]]
        )
        message = tf.concat(
            [_bytes(padded_scale), tf.reshape(self._shards(packed, 1), [-1])], axis=0
        )
        rows = _gather_rows(self.meter.hand(message), f"{name}.server", self.process_set)
        server_scales = float_rows(rows[:, : self.server_scale_bytes])
        if self.server_scale_bytes == 4:  # one block per shard
            decoded = self._servers_signs(rows[:, 4:], server_scales, self.length)
            return tf.reshape(decoded, [-1])[: self.numel]
        signs = unpack(rows[:, self.server_scale_bytes :], self.codec.code_space, self.length)
        return tf.concat(
            [
                self.codec.decode(signs[k, : self.valid(k)], server_scales[k], 1)
                for k in range(self.world_size)
            ],
            axis=0,
        )

    def packed(self, codes):
        """``codes`` packed flat, as ``start_packed`` takes them."""
        return tf.reshape(pack(codes[None], self.codec.code_space), [-1])

    def _shards(self, packed, count):
        """Packed codes as ``count`` shards (rows) of ``self.length`` codes. Shards start
        on byte boundaries, so the codes are packed once and the bytes padded with zero
        bits: codes +1 past the tensor's end, as in the PyTorch port, which every receiver
        cuts off."""
        nbytes = count * self.shard_bytes
        if packed.shape[0] < nbytes:  # most layers' codes fill their shards exactly
            packed = tf.pad(packed, [[0, nbytes - packed.shape[0]]])
        return tf.reshape(packed, [count, -1])


class SparseAllgather(layout.SparseAllgather, _Exchange):
    def __call__(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        selected = self.codec.select(compensated, grad, self.bin_length)
        message = self.codec.encode_message(compensated, selected, self.bin_length)
        own_values = self.codec.decode_message(message, self.numel, self.bin_length)
        self.memory.update(self.key, compensated, own_values)
        self.sent_elements = tf.reduce_sum(tf.cast(selected, tf.int64))
        # This rank's message comes back among the others: its values are decoded already.
        own = self.process_set.rank()
        values = [
            own_values
            if rank == own
            else self.codec.decode_message(chunk, self.numel, self.bin_length)
            for rank, chunk in enumerate(
                _gather_with_sizes(message, name, self.meter, self.process_set)
            )
        ]
        return divide(tf.reduce_sum(tf.stack(values), axis=0), self.count)


class LeaderAllreduce(layout.LeaderAllreduce, _Exchange):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent_elements = self.codec.k(self.numel)

    def __call__(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        k = self.sent_elements
        leader = tf.cast(self.codec.leader(self.step, self.world_size), tf.int32)
        indices = tf.cond(
            tf.equal(leader, self.process_set.rank()),
            lambda: self.codec.top_k(compensated, k),
            lambda: tf.zeros([k], tf.int32),
        )
        self.meter.hand(indices)
        # Horovod's broadcast takes its root as a Python int, and inside a tf.function the
        # leader is a tensor (it follows the step variable): one branch per possible root,
        # the same on every rank, so exactly one broadcast runs. An allreduce of the
        # leader's indices (zeros elsewhere) would need no branches but would put twice the
        # bytes on the wire and break the cost model's broadcast.
        indices = tf.switch_case(
            leader,
            [
                # Horovod's broadcasts take the root's global rank, in a process set too.
                lambda root=root: hvd.broadcast(
                    indices,
                    root_rank=self.process_set.ranks[root],
                    name=f"{name}.indices",
                    ignore_name_scope=True,
                    process_set=self.process_set,
                )
                for root in range(self.world_size)
            ],
        )
        indices = tf.reshape(tf.cast(indices, tf.int64), [k, 1])
        values = tf.gather_nd(compensated, indices)
        self.memory.update_unsent(self.key, compensated, indices, self.codec.beta)
        total = hvd.allreduce(
            self.meter.hand(values),
            op=hvd.Sum,
            name=name,
            ignore_name_scope=True,
            process_set=self.process_set,
        )
        return tf.scatter_nd(indices, divide(tf.cast(total, tf.float32), self.count), [self.numel])


class TopKAllgather(layout.TopKAllgather, _Exchange):
    def __call__(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        k = self.sent_elements = self.codec.k(self.numel, self.step)
        indices = self.codec.top_k(compensated, k)
        self.selected = tf.reshape(tf.cast(indices, tf.int64), [-1, 1])
        values = tf.gather_nd(compensated, self.selected)
        self.memory.update_unsent(self.key, compensated, self.selected)
        gathered_indices, gathered_values = (
            hvd.allgather(
                self.meter.hand(tensor),
                name=f"{name}.{part}",
                ignore_name_scope=True,
                process_set=self.process_set,
            )
            for part, tensor in (("indices", indices), ("values", values))
        )
        total = tf.zeros([self.numel])
        for rank in range(self.world_size):  # in rank order: the same bits on every rank
            part = tf.cast(gathered_indices[rank * k : (rank + 1) * k], tf.int64)
            total = tf.tensor_scatter_nd_add(
                total, tf.reshape(part, [-1, 1]), gathered_values[rank * k : (rank + 1) * k]
            )
        return divide(total, self.count)


class LowRankAllreduce(layout.LowRankAllreduce, _Exchange):
    def _allreduce(self, factor, name):
        return hvd.allreduce(
            self.meter.hand(factor),
            op=hvd.Sum,
            name=name,
            ignore_name_scope=True,
            process_set=self.process_set,
        )

    def __call__(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        matrix = tf.reshape(compensated, self.matrix_shape)
        q = self.codec.orthogonalize(self.factors.residuals[self.key])
        p = self.codec.orthogonalize(self._allreduce(matrix @ q, f"{name}.p"))
        q = self._allreduce(tf.transpose(matrix) @ p, f"{name}.q") / self.world_size
        average = tf.reshape(p @ tf.transpose(q), [-1])
        self.memory.update(self.key, compensated, average)
        self.factors.propose(self.key, q)
        return self.delivered(average)


EXCHANGES = {cls.name: cls for cls in (Allreduce, Allgather, Sharded)}
SPARSE_EXCHANGES = {
    cls.message: cls for cls in (SparseAllgather, LeaderAllreduce, TopKAllgather, LowRankAllreduce)
}


def make_exchange(
    name, codec, numel, world_size, meter, count, server=None, fusion=None, **options
):
    """The exchange called ``name`` for ``codec``; a sharded one sends through ``fusion``.
    ``options``: ``process_set``, the ranks that exchange (all by default)."""
    cls = ShardedServer if name == "sharded" and codec.two_way else EXCHANGES[name]
    return cls(codec, numel, world_size, meter, count, server, fusion, **options)


def make_sparse_exchange(codec, plan, world_size, meter, count, memory, step, **options):
    """The exchange of a sparse ``codec`` (by its ``message``), for the tensor of ``plan``.
    ``options``: ``process_set``; ``factors``, the ``FactorMemory`` of PowerSGD."""
    cls = SPARSE_EXCHANGES[codec.message]
    return cls(codec, plan.numel, world_size, meter, count, memory, plan, step, **options)
