"""How one tensor's codes cross the network, built only from Horovod collectives.

Every exchange delivers the same decoded gradient to every rank. Each runs in up to three
calls so that many tensors are in flight at once: ``start`` hands the first collective to
Horovod, ``advance`` waits for it and hands over the second one (sharded only), ``finish``
waits and decodes. A sharded exchange's alltoall goes through an ``AlltoallFusion``
(``hvd_compress.pt.fusion``), with those of other tensors. The byte-count model of each is in
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

import collections
import pickle
import time

import horovod.torch as hvd
import torch

from hvd_compress import exchange as layout
from hvd_compress import watchdog
from hvd_compress.cost import TORCH_ALLREDUCE_DTYPES

from . import elias, fused, triton_fused
from .buckets import per_bucket_
from .packing import pack, unpack, unpack_scaled_signs

# What horovod.torch's allreduce sums: no bfloat16 (nor 8- or 16-bit integers).
ALLREDUCE_DTYPES = frozenset(
    {torch.float16, torch.float32, torch.float64, torch.int32, torch.int64}
)

# Bounds of the sleeps between polls in ``wait``: short enough that a small collective's
# latency hardly grows, long enough that a waiting rank leaves its core to the others.
_FIRST_SLEEP, _LONGEST_SLEEP = 20e-6, 1e-3

# handle -> (kind, name, process set id) of every collective started through
# ``_watched`` and not yet waited for: what ``wait`` names when its bound runs out.
_started = {}
# process set id -> ``watchdog.Peers`` of its ranks, from the agreement (``meet``).
_peers = {}


def _watched(collective):
    """Horovod's ``collective`` (the name of one of its ``*_async`` functions, looked up at
    each call), recording what each handle it returns is, for ``wait``."""
    kind = collective.removesuffix("_").removesuffix("_async")

    def start(*args, name, process_set=hvd.global_process_set, **kwargs):
        handle = getattr(hvd, collective)(*args, name=name, process_set=process_set, **kwargs)
        _started[handle] = (kind, name, process_set.process_set_id)
        return handle

    return start


allgather_async = _watched("allgather_async")
allreduce_async = _watched("allreduce_async")
allreduce_async_ = _watched("allreduce_async_")
alltoall_async = _watched("alltoall_async")
broadcast_async = _watched("broadcast_async")
grouped_allreduce_async = _watched("grouped_allreduce_async")
grouped_allreduce_async_ = _watched("grouped_allreduce_async_")
reducescatter_async = _watched("reducescatter_async")


def codes_name(name: str) -> str:
    """The name of the collective, or fusion group member, of parameter ``name``'s codes."""
    return f"hvdc.{name}.codes"


def sparse_allreduce_async(tensor, name, op, process_set=hvd.global_process_set):
    """Horovod's ``sparse_allreduce_async`` (allgathers of the indices and the values),
    whose result callable waits by ``wait``."""
    indices = allgather_async(
        tensor._indices().transpose(0, 1).contiguous(),
        name=f"{name}.indices",
        process_set=process_set,
    )
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def result():
        gathered = wait(values)
        if op == hvd.Average:
            gathered = gathered / process_set.size()
        return torch.sparse_coo_tensor(wait(indices).transpose(0, 1), gathered, tensor.size())

    return result


def meet(process_set, addresses, rank):
    """Takes the watchdog addresses of ``process_set``'s ranks (gathered by the
    agreement), which ``wait`` asks when its bound runs out."""
    _peers[process_set.process_set_id] = watchdog.Peers(addresses, rank)


def wait(handle, spin=False):
    """``hvd.synchronize(handle)`` without its busy wait (but with ``spin``), and bounded.

    Horovod's synchronize polls in a loop that only yields the core, so a rank waiting for
    the network keeps a core busy; with more ranks than cores (4 on 2 in this project's
    benchmarks) the spinning ranks took the CPU the encoding ranks and Horovod's background
    threads needed, and a step at N = 4 took 2.7x as long. Sleeps that double from 20 us to
    1 ms free the core instead; ``spin`` keeps polling, for timings of the link.

    A wait longer than ``watchdog.timeout()`` raises ``watchdog.CollectiveTimeout`` naming
    the collective and what every rank does, instead of hanging on a rank that failed."""
    kind, name, process_set_id = _started.pop(handle, ("collective", "?", 0))
    bound = watchdog.timeout()
    sleep = _FIRST_SLEEP
    if not hvd.poll(handle):
        watchdog.WAITS.enter(kind, name)
        start = time.monotonic()
        while not hvd.poll(handle):
            if bound is not None and time.monotonic() - start > bound:
                watchdog.WAITS.leave(expired=True)
                raise watchdog.expired(kind, name, bound, _peers.get(process_set_id))
            if not spin:
                time.sleep(sleep)
                sleep = min(2 * sleep, _LONGEST_SLEEP)
        watchdog.WAITS.leave()
    return hvd.synchronize(handle)


def allreducible(tensor):
    """``tensor`` as horovod.torch's allreduce takes it: contiguous (a channels_last
    convolution's gradient is not), and in float32 where Horovod has no sum for its dtype
    (bfloat16). ``tensor`` itself where it already is."""
    if tensor.dtype not in ALLREDUCE_DTYPES:
        tensor = tensor.to(torch.float32)
    return tensor.contiguous()


def grouped_allreduce_in_place(tensors, op, name, meter):
    """Horovod's grouped allreduce of ``tensors`` into them, whatever their dtype and
    layout (through ``allreducible`` copies where needed); waits for it."""
    carried = [allreducible(t) for t in tensors]
    wait(grouped_allreduce_async_([meter.hand(c) for c in carried], op=op, name=name))
    for tensor, result in zip(tensors, carried):
        if result is not tensor:
            tensor.copy_(result)


class Meter(layout.Meter):
    """``hvd_compress.exchange.Meter`` in Python ints: ``bytes`` in all, ``by_tensor``."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_tensor = collections.Counter()

    def hand(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes += nbytes
        self.by_tensor[self.tensor] += nbytes
        return tensor


def _floats(rows):
    """Rows of raw float32 bytes as float32 rows. Slices of gathered payloads are not
    contiguous in memory, and a single row (N = 1) counts as contiguous whatever its stride,
    so the bytes are copied out flat before they are reinterpreted."""
    flat = rows.reshape(-1).clone()
    return flat.view(torch.float32).reshape(rows.shape[0], rows.shape[1] // 4)


def _allgather_with_sizes(payload, name, meter, process_set):
    """Starts allgathers of a flat byte payload whose length differs between workers, and
    of its length (so the gathered bytes can be split apart). The lengths travel as a CPU
    tensor whatever the payload's device: the split needs them on the host, where a CPU
    tensor's are without a wait for the device (a GPU tensor's would cost one to send it and
    one to read the gathered lengths back)."""
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [
        allgather_async(meter.hand(payload), name=name, process_set=process_set),
        allgather_async(meter.hand(size), name=f"{name}.size", process_set=process_set),
    ]


def _gathered_payloads(handles):
    """Every worker's payload, in rank order, from ``_allgather_with_sizes``."""
    data = wait(handles[0])
    return torch.split(data, wait(handles[1]).tolist())


def allgather_object(value, name, process_set):
    """Every rank's picklable ``value``, in the rank order of ``process_set``
    (``hvd.allgather_object`` of horovod.torch takes no process set). Its bytes count in no
    step (a meter of its own)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    chunks = _gathered_payloads(_allgather_with_sizes(payload, name, Meter(), process_set))
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in chunks]


def _sum_rows(rows):
    accumulate = torch.float32 if rows.is_floating_point() else torch.int32
    # Converted first: a sum that converts as it goes takes a slow mixed-type path.
    return rows.to(accumulate).sum(dim=0, dtype=accumulate)


class _Exchange(layout.Exchange):
    """``hvd_compress.exchange.Exchange`` in torch, over Horovod's global process set
    unless told another."""

    def __init__(self, *args, process_set=hvd.global_process_set, **kwargs):
        super().__init__(*args, process_set=process_set, **kwargs)

    def advance(self, pending):
        return pending

    def _fused(self, scale):
        """Whether the kernels decode codes under ``scale`` (None for unscaled codecs)."""
        return scale is not None and fused.applies(self.codec, scale)

    def payload(self, device: torch.device) -> torch.Tensor:
        """An empty tensor on ``device`` in the format this exchange hands over one worker's
        codes in, for a kernel to encode into (``fused.encode``; ``start_packed`` sends
        it)."""
        nbytes = self.codec.code_space.packed_nbytes(self.numel)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _servers_signs(self, packed, scales, length):
        """The first ``length`` signs of each server's row of ``packed`` times that server's
        one scale (``scales``, one per row). Every value is +-its server's scale, NaN for a
        non-finite one, so ``finite`` is read off the scales: on the CPU only, where reading
        it costs nothing; on a GPU it would wait for the device once per tensor, so there it
        stays None and the pipeline's one finiteness check of the step covers this result."""
        self.finite = fused.finite(scales) if scales.device.type == "cpu" else None
        unpack_signs = (
            fused.scaled_signs if fused.applies(self.codec, scales) else unpack_scaled_signs
        )
        return unpack_signs(packed, scales, length)


class Allreduce(_Exchange):
    """Code values summed by one allreduce, in the narrowest carrier that cannot overflow."""

    name = "allreduce"

    def __init__(self, codec, numel, world_size, meter, count, server=None, fusion=None, **options):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.carrier = getattr(
            torch, codec.value_space.allreduce_carrier(world_size, TORCH_ALLREDUCE_DTYPES)
        )

    def payload(self, device: torch.device) -> torch.Tensor:
        """The codes' values in the carrier."""
        return torch.empty(self.numel, dtype=self.carrier, device=device)

    def start(self, codes, scale, name):
        return self.start_packed(self.codec.values(codes).to(self.carrier), scale, name)

    def start_packed(self, payload, scale, name):
        """``start`` for values already in the carrier (``fused``)."""
        handle = allreduce_async(
            self.meter.hand(payload), op=hvd.Sum, name=name, process_set=self.process_set
        )
        return handle, scale

    def finish(self, pending):
        handle, scale = pending
        total = wait(handle)
        if self._fused(scale):
            return fused.decoded_totals(self.codec, total, scale, self.count)
        if not total.is_floating_point():
            total = total.to(torch.int32)
        return self.codec.decode(total, scale, self.count)


class Allgather(layout.Allgather, _Exchange):
    """Every worker's packed codes (and own scales, if it has them) reach every worker.

    Variable-length payloads (``wire="elias"``) travel as one flat byte tensor per worker,
    with a second, concurrent allgather of their lengths to split them apart.
    """

    def start(self, codes, scale, name):
        payload = (
            elias.encode(codes)
            if self.elias
            else pack(codes.reshape(1, -1), self.codec.code_space).reshape(-1)
        )
        return self.start_packed(payload, scale, name)

    def start_packed(self, payload, scale, name):
        """``start`` for codes already packed (``fused``)."""
        if self.own_scale:
            payload = (
                fused.headed(scale, payload)
                if self._fused(scale)
                else torch.cat([scale.to(torch.float32).reshape(-1).view(torch.uint8), payload])
            )
        if self.elias:
            return _allgather_with_sizes(payload, name, self.meter, self.process_set), scale
        # Equal lengths: gathered as rows.
        payload = self.meter.hand(payload.view(1, -1))
        return [allgather_async(payload, name=name, process_set=self.process_set)], scale

    def _codes(self, gathered):
        """Each worker's codes and own scales, one worker at a time in rank order, from
        the ``gathered`` payloads: (codes, scales), each a row. One at a time, the eager
        decode holds a few copies of the tensor, not N."""
        for payload in gathered:
            payload = payload.reshape(1, -1)
            codes = (
                elias.decode(payload[0, self.scale_bytes :], self.numel).reshape(1, -1)
                if self.elias
                else unpack(payload[:, self.scale_bytes :], self.codec.code_space, self.numel)
            )
            yield codes, _floats(payload[:, : self.scale_bytes])

    def _decoded_sum(self, rows, count):
        """The sum over the workers, in rank order, of their codes (``rows`` of codes and
        own scales) decoded under their own scales and ``count``."""
        total = None
        for codes, scales in rows:
            decoded = self.codec.decode(self.codec.values(codes), scales, count).reshape(-1)
            total = decoded if total is None else total.add_(decoded)
        return total

    def finish(self, pending):
        handles, scale = pending
        gathered = _gathered_payloads(handles) if self.elias else wait(handles[0])
        if self.server is not None:  # two-way codecs pack at a fixed width
            return self._serve(gathered, scale)
        return self.decode(gathered, scale)

    def decode(self, gathered, scale):
        """The decoded average (or sum) of every worker's payload: ``gathered`` holds them
        as rows, or for Elias codes as a list; ``scale`` is the shared scale, if any."""
        if not self.elias and self._fused(scale):
            if self.own_scale:
                return fused.decoded_own_scales(
                    self.codec, gathered, self.scale_bytes, self.count, self.numel
                )
            return fused.decoded_sums(self.codec, gathered, scale, self.count, self.numel)
        if self.own_scale:
            return self._decoded_sum(self._codes(gathered), self.count)
        total = None
        for codes, _ in self._codes(gathered):
            values = self.codec.values(codes)
            total = _sum_rows(values) if total is None else total.add_(values[0])
        return self.codec.decode(total, scale, self.count)

    def _serve(self, rows, scale):
        """The replicated server: every rank runs the same server step on every worker's
        message (rows; this worker's ``scale``), averaged as the sharded server averages
        its shard (sum, then divide)."""
        if triton_fused.signs_apply(self.codec, scale):  # a gradient bucket on the device
            decoded, _ = triton_fused.server_step(
                self.server,
                self.codec,
                rows[:, self.scale_bytes :],
                _floats(rows[:, : self.scale_bytes]),
                self.count,
                self.numel,
                decoded=True,
            )
            return decoded
        if self.scale_bytes == 4 and self._fused(scale):  # one block per tensor
            packed, server_scale = fused.server_step(
                self.server, self.codec, rows, self.scale_bytes, 0, self.count, self.numel
            )
            return self._servers_signs(packed.view(1, -1), server_scale, self.numel)[0]
        own_scales = _floats(rows[:, : self.scale_bytes])
        bits = rows[:, self.scale_bytes :]
        rows = (
            (unpack(bits[r : r + 1], self.codec.code_space, self.numel), own_scales[r : r + 1])
            for r in range(bits.shape[0])
        )
        average = self._decoded_sum(rows, 1) / self.count
        return self.server(self.codec, average)[2]


class Sharded(layout.Sharded, _Exchange):
    """Reduce-scatter by alltoall, then allgather of the packed partial sums.

    Rank k receives shard k of every worker's codes, sums their values and packs the sum in
    the narrowest width that holds it (``value_space.summed(world_size)``); an allgather
    returns all summed shards to everyone. Bytes per worker stay nearly flat as the world
    grows.
    """

    def payload(self, device: torch.device) -> torch.Tensor:
        """The codes of all shards, padded with 0 to ``world_size`` shards."""
        nbytes = self.codec.code_space.packed_nbytes(self.world_size * self.length)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start(self, codes, scale, name):
        padded = codes.new_zeros(self.world_size * self.length)
        padded[: self.numel] = codes.reshape(-1)
        return self.start_packed(pack(padded, self.codec.code_space), scale, name)

    def start_packed(self, packed, scale, name):
        """``start`` for codes already packed (``fused``): ``payload``'s format."""
        shards = packed.reshape(self.world_size, -1)
        return self.fusion.send(name, self.meter.hand(shards)), scale, name

    def advance(self, pending):
        fusion, scale, name = pending
        received = fusion.receive(name)
        if self._fused(scale):
            payload = fused.summed_codes(self.codec, received, self.length, self.total_space)
        else:
            values = self.codec.values(unpack(received, self.codec.code_space, self.length))
            payload = pack(_sum_rows(values), self.total_space)
        payload = self.meter.hand(payload.reshape(1, -1))
        return allgather_async(payload, name=f"{name}.sum", process_set=self.process_set), scale

    def finish(self, pending):
        handle, scale = pending
        rows = wait(handle)
        if self._fused(scale):
            return fused.decoded_segments(
                self.codec, rows, self.total_space, self.length, scale, self.count, self.numel
            )
        total = unpack(rows, self.total_space, self.length).reshape(-1)[: self.numel]
        return self.codec.decode(total, scale, self.count)


class ShardedServer(layout.ShardedServer, _Exchange):
    def start(self, codes, scale, name):
        return self.start_packed(self._packed(codes), scale, name)

    def start_packed(self, packed, scale, name):
        """``start`` for codes already packed (``fused``)."""
        if self._fused(scale):
            payload = fused.sharded_messages(scale, packed, self.world_size, self.shard_bytes)
        else:
            shards = self._shards(packed, self.world_size)
            heads = scale.to(torch.float32).reshape(1, -1).view(torch.uint8)
            payload = torch.cat([heads.expand(self.world_size, -1), shards], dim=1)
        return self.fusion.send(name, self.meter.hand(payload)), scale, name

    def advance(self, pending):
        fusion, scale, name = pending
        received = fusion.receive(name)
        rank = self.process_set.rank()
        shard = self.shard(rank)
        valid = shard.stop - shard.start
        # Every worker's signs times its scales of the blocks this shard's elements are in.
        block_length = self.codec.bucket_length(self.numel)
        first_block = shard.start // block_length
        one_block = valid and (shard.stop - 1) // block_length == first_block
        fuses = self._fused(scale)
        if one_block and fuses:
            packed, server_scale = fused.server_step(
                self.server, self.codec, received, self.scale_bytes, first_block, self.count, valid
            )
            payload = fused.server_message(
                server_scale, self.server_scale_bytes, packed, self.shard_bytes
            )
        else:
            scales = _floats(received[:, : self.scale_bytes])
            bits = received[:, self.scale_bytes :]
            if one_block:
                scaled = unpack_scaled_signs(bits, scales[:, first_block], valid)
            else:
                signs = unpack(bits, self.codec.code_space, valid)
                scaled = per_bucket_(
                    signs.to(torch.float32), "mul_", scales, block_length, start=shard.start
                )
            average = scaled.sum(dim=0) / self.count
            codes, server_scale, _ = self.server(self.codec, average)
            packed = self._packed(codes)
            padded_scale = server_scale.new_zeros(self.server_scale_bytes // 4)
            padded_scale[: server_scale.numel()] = server_scale
            payload = torch.cat(
                [padded_scale.view(torch.uint8), self._shards(packed, 1).reshape(-1)]
            ).reshape(1, -1)
        payload = self.meter.hand(payload)
        handle = allgather_async(payload, name=f"{name}.server", process_set=self.process_set)
        return handle, fuses

    def finish(self, pending):
        handle, fuses = pending
        rows = wait(handle)
        if fuses and self.server_scale_bytes == 4:  # the kernels' scales, one per shard
            signs, self.finite = fused.servers_signs(rows, self.length, self.numel)
            return signs
        scales = _floats(rows[:, : self.server_scale_bytes])
        packed = rows[:, self.server_scale_bytes :]
        if scales.shape[1] == 1:  # one block per shard
            return self._servers_signs(packed, scales, self.length).reshape(-1)[: self.numel]
        signs = unpack(packed, self.codec.code_space, self.length)
        # All servers' shards at once: a shard's blocks (bucket_length of its valid length)
        # are those of the whole padded row, as blocks start at the row's start and the
        # elements past the valid ones are cut off.
        decoded = self.codec.decode(signs, scales, 1).reshape(-1)
        return decoded[: self.numel]

    def _packed(self, codes):
        return pack(codes.reshape(1, -1), self.codec.code_space).reshape(-1)

    def _shards(self, packed, count):
        """Packed codes as ``count`` shards (rows) of ``self.length`` codes. Shards start
        on byte boundaries, so the codes are packed once and the bytes padded with zero
        bits: codes +1 past the tensor's end, which every receiver cuts off."""
        nbytes = count * self.shard_bytes
        if packed.numel() < nbytes:  # most layers' codes fill their shards exactly
            packed = torch.nn.functional.pad(packed, (0, nbytes - packed.numel()))
        return packed.reshape(count, -1)


class MemberShardedServer(ShardedServer):
    """``ShardedServer`` of a gradient bucket sharded member by member (``shards``, its
    ``ShardLayout``): rank k serves the k-th shard of every member, with the blocks, codes
    and residuals of the members' own servers; a message holds what the members' own
    messages would, their block scales first."""

    def __init__(
        self, codec, numel, world_size, meter, count, server=None, fusion=None, *, shards, **options
    ):
        super().__init__(codec, numel, world_size, meter, count, server, fusion, **options)
        self.shards = shards
        self.length = shards.length
        self.server_scale_bytes = 4 * shards.head

    def start_packed(self, packed, scale, name):
        heads = scale.to(torch.float32).reshape(1, -1).view(torch.uint8)
        payload = torch.cat([heads.expand(self.world_size, -1), self.shards.rows(packed)], dim=1)
        return self.fusion.send(name, self.meter.hand(payload)), scale, name

    def advance(self, pending):
        fusion, scale, name = pending
        received = fusion.receive(name)
        bits, scales = received[:, self.scale_bytes :], _floats(received[:, : self.scale_bytes])
        on_device = triton_fused.signs_apply(self.codec, scale)
        if on_device:
            packed, server_scale = triton_fused.server_step(
                self.server,
                self.shards.server_codec,
                bits,
                scales,
                self.count,
                self.length,
                blocks=self.shards.worker_blocks,
            )
        else:
            signs = unpack(bits, self.codec.code_space, self.length)
            average = self.shards.worker_average(signs, scales, self.count)
            codes, server_scale, _ = self.server(self.shards.server_codec, average)
            packed = self._packed(codes)
        head = self.shards.server_head(server_scale)
        payload = torch.cat([head.view(torch.uint8), packed]).reshape(1, -1)
        handle = allgather_async(
            self.meter.hand(payload), name=f"{name}.server", process_set=self.process_set
        )
        return handle, on_device

    def finish(self, pending):
        handle, on_device = pending
        rows = wait(handle)
        bits = rows[:, self.server_scale_bytes :]
        heads = _floats(rows[:, : self.server_scale_bytes])
        if on_device:
            return triton_fused.decoded_shards(
                self.codec,
                bits,
                heads.reshape(-1),
                self.shards.server_blocks,
                self.shards.order,
                self.length,
                self.numel,
            )
        return self.shards.decoded(unpack(bits, self.codec.code_space, self.length), heads)


class SparseAllgather(layout.SparseAllgather, _Exchange):
    def start(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        selected = self.codec.select(compensated, grad, self.bin_length)
        message = self.codec.encode_message(compensated, selected, self.bin_length)
        self.own_values = self.codec.decode_message(message, self.numel, self.bin_length)
        self.memory.update(self.key, compensated, self.own_values)
        self.sent_elements = selected.sum()
        return _allgather_with_sizes(message, name, self.meter, self.process_set)

    def finish(self, handles):
        # This rank's message comes back among the others: its values are decoded already.
        own = self.process_set.rank()
        values = [
            self.own_values
            if rank == own
            else self.codec.decode_message(message, self.numel, self.bin_length)
            for rank, message in enumerate(_gathered_payloads(handles))
        ]
        return torch.stack(values).sum(dim=0) / self.count


class LeaderAllreduce(layout.LeaderAllreduce, _Exchange):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.leader = self.codec.leader(self.step, self.world_size)
        self.sent_elements = self.codec.k(self.numel)

    def start(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad, lr_ratio)
        if self.process_set.rank() == self.leader:
            indices = self.codec.top_k(compensated, self.sent_elements)
        else:
            indices = torch.zeros(self.sent_elements, dtype=torch.int32, device=grad.device)
        # Horovod's broadcasts take the root's global rank, in a process set too.
        handle = broadcast_async(
            self.meter.hand(indices),
            root_rank=self.process_set.ranks[self.leader],
            name=f"{name}.indices",
            process_set=self.process_set,
        )
        return handle, compensated, name

    def advance(self, pending):
        handle, compensated, name = pending
        indices = wait(handle).to(torch.int64)
        values = compensated[indices]
        self.memory.update_unsent(self.key, compensated, indices, self.codec.beta)
        handle = allreduce_async(
            self.meter.hand(allreducible(values)),
            op=hvd.Sum,
            name=name,
            process_set=self.process_set,
        )
        return handle, indices

    def finish(self, pending):
        handle, indices = pending
        total = wait(handle)
        average = torch.zeros(self.numel, dtype=torch.float32, device=total.device)
        average[indices] = total.to(torch.float32) / self.count
        return average


class TopKAllgather(layout.TopKAllgather, _Exchange):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent_elements = self.codec.k(self.numel, self.step)

    def start(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad.to(torch.float32), lr_ratio)
        indices = self.codec.top_k(compensated, self.sent_elements)
        self.selected = indices.to(torch.int64)
        values = compensated[self.selected]
        self.memory.update_unsent(self.key, compensated, self.selected)
        return [
            allgather_async(
                self.meter.hand(tensor), name=f"{name}.{part}", process_set=self.process_set
            )
            for part, tensor in (("indices", indices), ("values", values))
        ]

    def finish(self, handles):
        indices, values = (wait(handle) for handle in handles)
        k = self.sent_elements
        total = torch.zeros(self.numel, dtype=torch.float32, device=values.device)
        for rank in range(self.world_size):  # in rank order: the same bits on every rank
            part = slice(rank * k, (rank + 1) * k)
            total.index_add_(0, indices[part].to(torch.int64), values[part])
        return total / self.count


class LowRankAllreduce(layout.LowRankAllreduce, _Exchange):
    def _allreduce(self, factor, name):
        return allreduce_async(
            self.meter.hand(factor), op=hvd.Sum, name=name, process_set=self.process_set
        )

    def start(self, grad, lr_ratio, name):
        compensated = self.memory.compensate(self.key, grad.to(torch.float32), lr_ratio)
        matrix = compensated.view(self.matrix_shape)
        # Q is made at wrapping, on the parameter's device then: it follows the gradient's.
        q = self.codec.orthogonalize(self.factors.residuals[self.key].to(matrix.device))
        return self._allreduce(matrix @ q, f"{name}.p"), matrix, name

    def advance(self, pending):
        handle, matrix, name = pending
        p = self.codec.orthogonalize(wait(handle))
        return self._allreduce(matrix.T @ p, f"{name}.q"), matrix, p

    def finish(self, pending):
        handle, matrix, p = pending
        q = wait(handle) / self.world_size
        average = (p @ q.T).view(-1)
        self.memory.update(self.key, matrix.view(-1), average)
        self.factors.propose(self.key, q)
        return self.delivered(average)


EXCHANGES = {cls.name: cls for cls in (Allreduce, Allgather, Sharded)}
SPARSE_EXCHANGES = {
    cls.message: cls for cls in (SparseAllgather, LeaderAllreduce, TopKAllgather, LowRankAllreduce)
}


def make_exchange(
    name, codec, numel, world_size, meter, count, server=None, fusion=None, shards=None, **options
):
    """The exchange called ``name`` for ``codec``; a sharded one sends through ``fusion``,
    a gradient bucket sharded member by member by its ``shards`` (``ShardLayout``).
    ``options``: ``process_set``, the ranks that exchange (all by default)."""
    if shards is not None:
        options["shards"] = shards
        cls = MemberShardedServer
    else:
        cls = ShardedServer if name == "sharded" and codec.two_way else EXCHANGES[name]
    return cls(codec, numel, world_size, meter, count, server, fusion, **options)


def make_sparse_exchange(codec, plan, world_size, meter, count, memory, step, **options):
    """The exchange of a sparse ``codec`` (by its ``message``), for the tensor of ``plan``.
    ``options``: ``process_set``; ``factors``, the ``FactorMemory`` of PowerSGD."""
    cls = SPARSE_EXCHANGES[codec.message]
    return cls(codec, plan.numel, world_size, meter, count, memory, plan, step, **options)
