"""The codec contract, and the two codecs that need no state: ``NoneCodec`` and ``FP16``.

A codec is the pure, local math of one algorithm on one gradient tensor. Its methods here
are the numpy reference; the framework ports (``hvd_compress.pt``, ``hvd_compress.tf``)
subclass each codec and override the same methods with the same signatures in framework
ops, so the reference and the ports are interchangeable in tests.

One worker's step for a scaled quantizer (TernGrad, QSGD, NUQSGD):

    scale = codec.local_scale(g)          # one float32 per bucket of the flattened tensor
    scale = max over workers of scale     # only if codec.shares_scale(exchange)
    codes = codec.encode(g, scale, u)     # u: uniform draws in [0, 1), if codec.stochastic

and then either the codes' additive values are summed over workers and decoded once,

    g_hat = codec.decode(sum of codec.values(codes), scale, n)

(n is the world size for an average, 1 for a sum), or, with per-worker scales, every worker's
codes are decoded with that worker's scales and the results summed.

Sparse codecs (``sparse = True``: AdaComp, ScaleCom's CLT-k) decide *which* elements travel,
from the error-compensated vector (and, for AdaComp, the new gradient too), so they always
keep a worker memory and their exchanges run the compensate -> select -> update steps
themselves (``hvd_compress.pt.exchange``): variable-length messages on an allgather with
sizes (not ``summable``), or values at indices every worker shares on an allreduce
(``summable``). Their ``code_space`` is the alphabet of the values they send.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from .codes import FieldCodes, FloatCodes, IntCodes, SignCodes
from .validation import check_int


@functools.cache
def _hyperparameter_names(cls) -> tuple:
    """The keyword arguments of the constructors along ``cls``'s MRO, once per class: a
    codec is hashed wherever it keys a cache (the kernels' value tables, on every decode),
    and ``inspect.signature`` of three constructors took ~0.3 ms each time."""
    names = [
        name
        for base in cls.__mro__
        if "__init__" in vars(base)
        for name, p in inspect.signature(base.__init__).parameters.items()
        if p.kind is p.KEYWORD_ONLY or (name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)
    ]
    return tuple(name for name in dict.fromkeys(names) if name not in cls.renamed)


class Codec:
    """Base class of every codec.

    Class attributes a subclass declares:
        name: the registry name (``hvd_compress.registry``).
        code_space: the wire format of one worker's codes (``codes.IntCodes`` or
            ``codes.FloatCodes``); None for a codec that does not compress.
        value_space: the space of ``values(codes)``, which sum exactly across workers; the
            code space unless the codes are indices of nonuniform levels.
        summable: True if the workers' code values can be summed elementwise (so an
            allreduce or the sharded exchange can carry them).
        scaled: True if codes are relative to one float32 scale per bucket.
        bucket_size: elements per bucket of the flattened tensor, None for one bucket per
            tensor (a hyperparameter of the codecs that have buckets).
        two_way: True if the exchange compresses the aggregate again, with a server-side
            error feedback, before sending it back (dist-EF-blockSGD).
        error_feedback_default: whether workers keep an error-feedback residual unless the
            user says otherwise (biased codecs need one).
        wire: ``"fixed"`` (codes packed at a fixed width, ``codes.py``) or ``"elias"``
            (nonzero codes Elias-omega coded, ``elias.py``; variable length).
        stochastic: True if ``encode`` consumes one uniform draw per element.
        compress_classifier_default: whether the final classifier layer is compressed unless
            the user says otherwise.
        sparse: True if the codec's exchange runs the worker's error feedback itself: it
            selects a data-dependent subset of elements from an error-compensated vector
            (see the module docstring), or sends low-rank factors of it.
        message: what a sparse codec's worker sends, which chooses its exchange:
            ``"bins"`` (AdaComp's variable-length bins), ``"shared_indices"`` (values at
            indices every worker shares, CLT-k), ``"own_indices"`` (each worker's own
            top-k indices and values, DGC) or ``"factors"`` (low-rank factors, PowerSGD,
            whose sizes follow a tensor's shape).
        uncompressed_steps: steps at the start of training that send every tensor whole.
        worker_momentum_default: whether the wrappers apply an SGD's momentum on the worker,
            before compression, unless the user says otherwise (dist-EF-blockSGDM, DGC's
            momentum correction).
        adam_remedy: whether the codec trains worse under Adam and AdamW unless it
            compresses Adam's momentum rather than its gradients, so that the wrappers turn
            compressed Adam on for it (``hvd_compress.remedies``).
        nesterov_remedy: whether the codec trains worse when its worker momentum takes a
            heavy-ball SGD's form than Nesterov's, so that the wrappers choose Nesterov's
            form under a heavy-ball SGD (``hvd_compress.remedies``).

    Args:
        min_size (int): tensors with fewer elements than this are sent uncompressed by a
            plain allreduce. Small tensors (biases, norms) carry little traffic and compress
            badly; each codec's default follows its paper.
        compress_classifier (bool or None): compress the final classifier layer too. None
            takes the codec's default.
    """

    name: str | None = None
    code_space: IntCodes | SignCodes | FieldCodes | FloatCodes | None = None
    summable = False
    scaled = False
    bucket_size: int | None = None
    two_way = False
    error_feedback_default = False
    wire = "fixed"
    stochastic = False
    default_min_size = 0
    compress_classifier_default = True
    sparse = False
    message: str | None = None
    uncompressed_steps = 0
    worker_momentum_default = False
    adam_remedy = False
    nesterov_remedy = False
    # Former names of keyword arguments, each to its current name: still taken, with a
    # DeprecationWarning, and no hyperparameter of their own (``params``).
    renamed: dict[str, str] = {}

    def __init__(
        self, *, min_size: int | None = None, compress_classifier: bool | None = None
    ) -> None:
        owner = type(self).__name__
        self.min_size = check_int(
            owner, "min_size", self.default_min_size if min_size is None else min_size, low=0
        )
        if compress_classifier is None:
            compress_classifier = self.compress_classifier_default
        if not isinstance(compress_classifier, bool):
            raise TypeError(
                f"{owner}: compress_classifier must be True, False or None, "
                f"got {compress_classifier!r}"
            )
        self.compress_classifier = compress_classifier

    @property
    def value_space(self):
        return self.code_space

    def params(self):
        """The hyperparameters, as keyword arguments that rebuild this codec."""
        return {name: getattr(self, name) for name in _hyperparameter_names(type(self))}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return (
            isinstance(other, Codec) and other.name == self.name and other.params() == self.params()
        )

    def __hash__(self):
        return hash((self.name, tuple(sorted(self.params().items()))))

    def compresses(self, numel):
        """Whether a tensor of ``numel`` elements goes through this codec at all."""
        return self.code_space is not None and numel >= self.min_size and numel > 0

    def why_not_horovod(self):
        """Why Horovod's own wrappers, which sum whatever a ``Compressor`` returns with an
        allreduce, cannot carry this codec; None if they can."""
        if self.code_space is None:
            return None  # nothing to encode
        if self.sparse:
            return (
                "each worker sends what its own error-feedback memory chooses, and only "
                "hvd_compress's exchanges keep that memory"
            )
        if not self.summable or self.scaled:
            return (
                "its codes are only summable after the workers agree on a scale, which "
                "Horovod's compression hook cannot do"
            )
        return None

    def why_whole(self, shape):
        """Why a floating-point tensor of ``shape`` is sent whole rather than through this
        codec; None if it goes through the codec."""
        numel = int(np.prod(shape, dtype=np.int64))
        if self.code_space is None:
            return f"codec {self.name}"
        if not self.compresses(numel):
            return f"{numel} < min_size {self.min_size}"
        return None

    @property
    def bucketable(self) -> bool:
        """Whether tensors of this codec can share gradient buckets (``bucketing``): a
        quantizer whose scales are per tensor or per block, packed at a fixed width."""
        return self.scaled and not self.sparse and self.wire == "fixed"

    def bucket_length(self, numel):
        """Elements per bucket of a tensor of ``numel`` elements."""
        return max(numel, 1) if self.bucket_size is None else self.bucket_size

    def buckets(self, numel):
        """Number of scales (buckets) of a tensor of ``numel`` elements."""
        return -(-numel // self.bucket_length(numel)) if self.scaled else 0

    def layer_kind(self, name, shape):
        """The kind of layer (one of ``LAYER_KINDS``) that owns the parameter ``name``; the
        statistics are kept per kind. Guessed from the name and shape (``layer_kind``)
        unless a codec is told the model's layers."""
        return layer_kind(name, shape)

    def shares_scale(self, exchange):
        """Whether the workers agree on the scales (Max-allreduce) before encoding, when
        the codes travel by ``exchange``. Summing codes needs a shared scale; an allgather
        can carry each worker's own scales instead."""
        return False

    # ----- numpy reference math; ports override these with framework ops -----

    def local_clip(self, grad, world_size):
        """The gradient a worker compresses, before any momentum: ``grad`` itself but for
        codecs that clip locally (DGC)."""
        return grad

    def local_scale(self, grad):
        """This worker's scales for ``grad``: float32, one per bucket."""
        raise NotImplementedError(f"{type(self).__name__} has no scales")

    def encode(self, grad, scale, uniforms):
        """Codes for ``grad`` (flattened) in ``code_space``; ``scale`` is None for an
        unscaled codec."""
        raise NotImplementedError

    def values(self, codes):
        """The additive integer values of ``codes``, in ``value_space``."""
        return codes

    def decode(self, total, scale, averaged_over):
        """The float32 gradient from ``total``, a sum of code values (or one worker's), under
        ``scale``, averaged over ``averaged_over`` workers (1: the sum itself). Leading axes
        of ``total`` and ``scale`` broadcast, so a batch of workers decodes at once."""
        raise NotImplementedError


LAYER_KINDS = ("conv", "linear", "recurrent", "embedding", "other")

# The parameter names PyTorch gives the weights and biases of nn.RNN, nn.LSTM, nn.GRU and
# their cells (``weight_ih_l0``, ``bias_hh_l1_reverse``, ...).
_RECURRENT_PARAMETERS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def layer_kind(name, shape):
    """The kind of layer of a parameter when the model is not at hand: recurrent by
    PyTorch's names for recurrent weights, convolution for kernels of three or more
    dimensions, linear for the other matrices (embedding tables cannot be told from linear
    weights by shape), other for vectors (biases, norms)."""
    if name.rsplit(".", 1)[-1].startswith(_RECURRENT_PARAMETERS):
        return "recurrent"
    if len(shape) >= 3:
        return "conv"
    return "linear" if len(shape) == 2 else "other"


class NoneCodec(Codec):
    """No compression: every tensor goes through Horovod's plain allreduce."""

    name = "none"


class FP16(Codec):
    """Half-precision values (Horovod's ``Compression.fp16``), 16 bits per element.

    Summable as it is: no scale, no random draws. Sums are accumulated in float32 wherever
    this package does the summing (allgather and sharded exchanges).
    """

    name = "fp16"
    code_space = FloatCodes("float16")
    summable = True

    def encode(self, grad, scale, uniforms):
        return grad.astype(np.float16)

    def decode(self, total, scale, averaged_over):
        return total.astype(np.float32) / np.float32(averaged_over)
