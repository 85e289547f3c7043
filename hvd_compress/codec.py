"""The codec contract, and the two codecs that need no state: ``NoneCodec`` and ``FP16``.

A codec is the pure, local math of one algorithm on one gradient tensor. Its methods here
are the numpy reference; the framework ports (``hvd_compress.pt``, ``hvd_compress.tf``)
subclass each codec and override the same methods with the same signatures in framework
ops, so the reference and the ports are interchangeable in tests.

One worker's step, for a codec whose codes are summable across workers:

    scale = codec.local_scale(g)          # only if codec.shares_scale
    scale = max over workers of scale     # one Max-allreduce, done by the exchange layer
    codes = codec.encode(g, scale, u)     # u: uniform draws in [0, 1), if codec.stochastic
    total = sum over workers of codes     # allreduce, allgather or sharded (see cost.py)
    g_hat = codec.decode(total, scale, n) # n = world size for an average, 1 for a sum
"""
import inspect

import numpy as np

from .codes import FloatCodes
from .validation import check_int


class Codec:
    """Base class of every codec.

    Class attributes a subclass declares:
        name: the registry name (``hvd_compress.registry``).
        code_space: the wire format of one worker's codes (``codes.IntCodes`` or
            ``codes.FloatCodes``); None for a codec that does not compress.
        summable: True if the codes of all workers can be summed elementwise (so an
            allreduce can carry them).
        shares_scale: True if a per-tensor scale is agreed on (Max over workers) before
            encoding; that is what makes scaled integer codes summable.
        stochastic: True if ``encode`` consumes one uniform draw per element.
        compress_classifier_default: whether the final classifier layer is compressed unless
            the user says otherwise.

    Args:
        min_size (int): tensors with fewer elements than this are sent uncompressed by a
            plain allreduce. Small tensors (biases, norms) carry little traffic and compress
            badly; each codec's default follows its paper.
        compress_classifier (bool or None): compress the final classifier layer too. None
            takes the codec's default.
    """

    name = None
    code_space = None
    summable = False
    shares_scale = False
    stochastic = False
    default_min_size = 0
    compress_classifier_default = True

    def __init__(self, *, min_size=None, compress_classifier=None):
        owner = type(self).__name__
        self.min_size = check_int(owner, "min_size",
                                  self.default_min_size if min_size is None else min_size,
                                  low=0)
        if compress_classifier is None:
            compress_classifier = self.compress_classifier_default
        if not isinstance(compress_classifier, bool):
            raise TypeError(f"{owner}: compress_classifier must be True, False or None, "
                            f"got {compress_classifier!r}")
        self.compress_classifier = compress_classifier

    def params(self):
        """The hyperparameters, as keyword arguments that rebuild this codec."""
        names = [name for cls in type(self).__mro__ if "__init__" in vars(cls)
                 for name, p in inspect.signature(cls.__init__).parameters.items()
                 if p.kind is p.KEYWORD_ONLY or (name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)]
        return {name: getattr(self, name) for name in dict.fromkeys(names)}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return isinstance(other, Codec) and other.name == self.name and \
            other.params() == self.params()

    def __hash__(self):
        return hash((self.name, tuple(sorted(self.params().items()))))

    def compresses(self, numel):
        """Whether a tensor of ``numel`` elements goes through this codec at all."""
        return self.code_space is not None and numel >= self.min_size and numel > 0

    # ----- numpy reference math; ports override these with framework ops -----

    def local_scale(self, grad):
        """This worker's scale for ``grad`` (a float32 scalar), for ``shares_scale`` codecs."""
        raise NotImplementedError(f"{type(self).__name__} does not share a scale")

    def encode(self, grad, scale, uniforms):
        """Codes for ``grad`` in ``code_space``; ``scale`` is the shared scale or None."""
        raise NotImplementedError

    def decode(self, total, scale, count):
        """The float32 gradient from ``total``, a sum of codes, divided by ``count``."""
        raise NotImplementedError


class NoneCodec(Codec):
    """No compression: every tensor goes through Horovod's plain allreduce."""

    name = "none"


class FP16(Codec):
    """Half-precision values (Horovod's ``Compression.fp16``), 16 bits per element.

    Summable as it is: no shared scale, no random draws. Sums are accumulated in float32
    wherever this package does the summing (allgather and sharded exchanges).
    """

    name = "fp16"
    code_space = FloatCodes("float16")
    summable = True

    def encode(self, grad, scale, uniforms):
        return grad.astype(np.float16)

    def decode(self, total, scale, count):
        return total.astype(np.float32) / np.float32(count)
