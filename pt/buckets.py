"""PyTorch bucket helpers; mirrors ``hvd_compress.buckets``.

Per-bucket scales are applied through a (buckets, bucket_size) view of the elements, so they
broadcast instead of being repeated over every element. Each function keeps the reference's
float32 operations in the reference's order, so the results are bit-identical to it.

Where the functions take a ``bucket_size``, they also take ``Segments``: the blocks of a
gradient bucket (``hvd_compress.bucketing``), whose lengths vary from tensor to tensor.
"""

import torch

from hvd_compress.buckets import count

_SEGMENT_REDUCTIONS = {"amax": "max", "sum": "sum"}


class Segments:
    """Blocks of varying lengths, each with one scale, that tile a flat vector with gaps
    that are no block's: a gradient bucket's members' blocks and the padding after each.
    Its device tensors let one segment reduction, or one repeat, cover every block.

    Args:
        lengths: the length of each segment, blocks and gaps, in order.
        blocks: the indices of the segments that are blocks.
        groups: the number of blocks of each member, in order.
        members: each member's (offset, elements, length with its padding, first block,
            block length), for kernels that work member by member (``programs``).
        device: where the vector is.
    """

    def __init__(
        self, lengths: list, blocks: list, groups: list, members: list, device: torch.device
    ):
        self.numel = sum(lengths)
        self.count = len(blocks)

        def indices(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.lengths = indices(lengths)
        self.blocks = None if len(blocks) == len(lengths) else indices(blocks)
        self.block_lengths = (
            self.lengths if self.blocks is None else indices([lengths[b] for b in blocks])
        )
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        self.starts = indices([starts[b] for b in blocks])  # each block's first element
        self.groups = indices(groups)
        self._members = members
        self.members = indices(members)
        self._programs = {}
        # Where the kernels decode a bucket (``decoding``), made at the first decode: the
        # eager ops never use it.
        self.decoded = None

    def expand(self, scale: torch.Tensor) -> torch.Tensor:
        """Each block's scale (along ``scale``'s last axis) repeated over its elements, 0
        over the gaps."""
        if self.blocks is not None:
            full = scale.new_zeros(scale.shape[:-1] + self.lengths.shape)
            scale = full.index_copy_(-1, self.blocks, scale)
        return torch.repeat_interleave(scale, self.lengths, dim=-1, output_size=self.numel)

    def reduce(self, values: torch.Tensor, reduction: str) -> torch.Tensor:
        """``reduction`` (``"amax"``, ``"sum"``) of each block of the 1-D ``values``."""
        out = torch.segment_reduce(
            values, _SEGMENT_REDUCTIONS[reduction], lengths=self.lengths, unsafe=True
        )
        return out if self.blocks is None else out.index_select(0, self.blocks)

    def programs(self, per_item: int, items: int) -> torch.Tensor:
        """(member, first item) of each program of a kernel that works ``items`` items at a
        time within one member's stretch, an item being ``per_item`` elements (the
        elements of one packed byte, or one): on the device, made once per shape."""
        key = per_item, items
        if key not in self._programs:
            table = [
                (member, first)
                for member, (_, _, length, _, _) in enumerate(self._members)
                for first in range(0, length // per_item, items)
            ]
            self._programs[key] = torch.tensor(table, dtype=torch.int64, device=self.members.device)
        return self._programs[key]

    def decoding(self) -> torch.Tensor:
        """Where the kernels decode the bucket (``triton_fused``): the same tensor each
        step, so that the gradients can be views of it made once (``BucketLayout.members``)."""
        if self.decoded is None:
            self.decoded = torch.zeros(self.numel, dtype=torch.float32, device=self.lengths.device)
        return self.decoded

    def whole_groups(self, flags: torch.Tensor) -> torch.Tensor:
        """Whether any block of each block's member has its flag (a boolean per block)."""
        flagged = torch.segment_reduce(
            flags.to(torch.float32), "max", lengths=self.groups, unsafe=True
        )
        return torch.repeat_interleave(flagged, self.groups, output_size=self.count) > 0


def expand(scale, numel, bucket_size):
    """Each bucket's scale repeated over its elements (along the last axis)."""
    if isinstance(bucket_size, Segments):
        return bucket_size.expand(scale)
    return torch.repeat_interleave(scale.reshape(scale.shape or (1,)), bucket_size, dim=-1)[
        ..., :numel
    ]


def pieces(start, stop, bucket_size):
    """Elements [start, stop) of a flattened tensor cut where buckets begin and end:
    ``(elements, rows, buckets)`` with ``elements`` a slice relative to ``start``, whose
    elements viewed as ``rows`` rows are one bucket per row, the buckets ``buckets``. At most
    three pieces: a partial bucket, the whole buckets, a partial bucket."""
    out = []
    position = start
    while position < stop:
        bucket = position // bucket_size
        full_rows = (stop - position) // bucket_size if position % bucket_size == 0 else 0
        end = (
            position + full_rows * bucket_size
            if full_rows
            else min(stop, (bucket + 1) * bucket_size)
        )
        rows = max(full_rows, 1)
        out.append((slice(position - start, end - start), rows, slice(bucket, bucket + rows)))
        position = end
    return out


def per_bucket_(values, method, scale, bucket_size, start=0):
    """``values.method(s)`` in place, with s the scale of each element's bucket; element i of
    ``values``' last axis is element ``start + i`` of the tensor, and leading axes of
    ``values`` and ``scale`` broadcast."""
    if isinstance(bucket_size, Segments):
        return getattr(values, method)(bucket_size.expand(scale))
    for elements, rows, buckets in pieces(start, start + values.shape[-1], bucket_size):
        piece = values[..., elements].unflatten(-1, (rows, -1))
        getattr(piece, method)(scale[..., buckets, None])
    return values


def reduce(values, bucket_size, reduction):
    """``reduction`` (``"amax"``, ``"sum"``) of each bucket of ``values`` (1-D); the last
    bucket is reduced over its own elements, which for the nonnegative values reduced here
    is what the reference's zero padding gives."""
    if isinstance(bucket_size, Segments):
        return bucket_size.reduce(values, reduction)
    numel = values.shape[-1]
    out = values.new_empty(count(numel, bucket_size))
    for elements, rows, buckets in pieces(0, numel, bucket_size):
        out[buckets] = getattr(torch, reduction)(values[elements].reshape(rows, -1), dim=1)
    return out


# Elements converted to float64 at a time for block sums on a CPU: a cache-sized buffer made
# the block scales of a 25M-parameter model's gradients 3x cheaper than one gradient-sized
# float64 copy. A GPU converts the whole tensor in one launch instead.
_CPU_CHUNK = 1 << 17


def float64_sums(values, bucket_size, transform):
    """sum of ``transform(v)`` over each bucket of the 1-D ``values``, in float64;
    ``transform`` is an in-place tensor method (``torch.Tensor.square_`` for QSGD's L2
    norms, whose float32 squares would overflow above 1.8e19) applied to float64 copies of
    the elements."""
    if isinstance(bucket_size, Segments):
        return bucket_size.reduce(transform(values.to(torch.float64)), "sum")
    numel = values.shape[-1]
    chunk = _CPU_CHUNK if values.device.type == "cpu" else max(numel, 1)
    sums = torch.zeros(count(numel, bucket_size), dtype=torch.float64, device=values.device)
    buffer = torch.empty(min(chunk, numel), dtype=torch.float64, device=values.device)
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        converted = transform(buffer[: stop - start].copy_(values[start:stop]))
        for elements, rows, buckets in pieces(start, stop, bucket_size):
            sums[buckets] += converted[elements].reshape(rows, -1).sum(dim=1)
    return sums


def _float32(scale, device):
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    return scale.reshape(scale.shape or (1,))


def normalized_unclipped(grad, scale, bucket_size):
    """|g| / scale of each element's bucket (float32, unclipped), and 0 where the scale is
    zero or not finite: dividing by +inf there does it without a per-element select (a
    non-finite g gives NaN there, which ``normalized`` maps to 0)."""
    scale = _float32(scale, grad.device)
    usable = (scale > 0) & torch.isfinite(scale)
    divisor = torch.where(usable, scale, torch.full_like(scale, float("inf")))
    # A float32 gradient's abs() is already a new tensor; other dtypes convert first.
    magnitude = grad.abs() if grad.dtype == torch.float32 else grad.to(torch.float32).abs_()
    return per_bucket_(magnitude, "div_", divisor, bucket_size)


def normalized(grad, scale, bucket_size):
    """r = |g| / scale of each element's bucket, clipped to [0, 1]; see the reference."""
    return normalized_unclipped(grad, scale, bucket_size).nan_to_num_(nan=0.0).clamp_(max=1.0)


def rescale(total, scale, bucket_size, divisor):
    """scale * total / divisor per bucket; NaN wherever the scale is not finite."""
    scale = _float32(scale, total.device)
    # NaN times any total is NaN: the non-finite scales mark their buckets in the product.
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    # torch.broadcast_shapes costs ~0.2 ms of Python per call: only asked when it matters.
    lead = (
        total.shape[:-1]
        if total.shape[:-1] == scale.shape[:-1]
        else torch.broadcast_shapes(total.shape[:-1], scale.shape[:-1])
    )
    shape = lead + total.shape[-1:]
    value = torch.empty(shape, dtype=torch.float32, device=total.device)
    value.copy_(total)
    per_bucket_(value, "mul_", scale, bucket_size)
    # Dividing by 1 is exact, so a sum (or one worker's codes) skips that pass.
    return value if divisor == 1 else value.div_(float(divisor))
