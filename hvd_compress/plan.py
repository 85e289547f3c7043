"""How each gradient of a model travels, decided once when a pipeline is built; both ports
plan alike from here."""

import dataclasses
import math

from .accounting import HALF, UNCOMPRESSED


@dataclasses.dataclass
class TensorPlan:
    """How one parameter's (or variable's) gradient travels; fixed at construction but for
    ``exchange``, which ``exchange="auto"`` chooses again for a new world, and ``path``."""

    name: str
    index: int  # its position in the pipeline's order, the same on every rank
    numel: int
    exchange: str  # UNCOMPRESSED or the name of a compressed exchange
    reason: str  # why it is, or is not, compressed
    layer: str = "other"  # the kind of layer that owns it (``codec.layer_kind``)
    shape: tuple = ()  # a compressed tensor's shape, which low-rank codecs factor
    # A compressed tensor's path this step (``hvd_compress.adaptive.PATHS``); only the
    # PyTorch port's adaptive mode sends one by another path than its codec.
    path: str = "codec"
    # Whether the port's ``fused`` kernels do its codec's and its memories' work (a CPU
    # float32 tensor of a codec they cover), where it is decided once: in TensorFlow, whose
    # variables keep their device and dtype. PyTorch asks each gradient as it comes
    # (``CompressionPipeline.on_kernels``): a model may be moved or cast after wrapping.
    kernels: bool = False

    @property
    def route(self) -> str:
        """How the gradient travels this step: the codec's exchange, or an allreduce."""
        if self.exchange == UNCOMPRESSED or self.path == "fp32":
            return UNCOMPRESSED
        return HALF if self.path == "fp16" else self.exchange


def plan_tensor(
    codec,
    name: str,
    index: int,
    shape: tuple,
    floating: bool,
    exchange: str,
    whole: bool,
    kernels: bool = False,
) -> TensorPlan:
    """The plan of the gradient of tensor ``name`` (``index`` in the pipeline's order, of
    ``shape``): sent whole if the user names it (``whole``), if it is not ``floating`` or if
    ``codec`` keeps it whole (``why_whole``: too small, a layer it skips); else compressed
    by ``exchange``. ``kernels``: whether the port's kernels take tensors like it."""
    numel = math.prod(shape)
    layer = codec.layer_kind(name, shape)
    if whole:
        reason = "excluded"
    elif not floating:
        reason = "not floating point"
    else:
        reason = codec.why_whole(shape)
    if reason is not None:
        return TensorPlan(name, index, numel, UNCOMPRESSED, reason, layer, kernels=kernels)
    return TensorPlan(name, index, numel, exchange, "compressed", layer, shape, kernels=kernels)


def classifier_names(named: list) -> set:
    """The final classifier of (name, parameter or variable) pairs in the model's order: the
    last one with two or more dimensions, and every one after it (its bias). Codecs whose
    papers leave it whole (``compress_classifier=False``) send these uncompressed."""
    last = max((i for i, (_, v) in enumerate(named) if len(v.shape) >= 2), default=None)
    return set() if last is None else {name for name, _ in named[last:]}
