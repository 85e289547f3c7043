"""AdaComp: adaptive residual gradient compression (Chen, Choi, Brand, Agrawal, Zhang and
Gopalakrishnan, "AdaComp: Adaptive Residual Gradient Compression for Data-Parallel Distributed
Training", AAAI 2018).

Per layer and per worker, with G the residue (zero at first) and dW the new gradient:

    G = G + dW                                  # the error-compensated gradient
    H = G + dW                                  # the soft threshold boosts fresh gradient
    cut G (flattened) into bins of L_T elements (the last bin may be shorter)
    g_max[b] = max |G| over bin b
    send k  iff  |H_k| >= g_max[bin(k)]  and  G_k != 0
    Gq_k = sign(G_k) * scale for every sent k, 0 elsewhere
    G = G - Gq                                  # nothing is lost: it waits in the residue

so sum_t Gq_t + G_T = sum_t dW_t exactly. No sort and no fixed k: how many elements a bin sends
adapts to how the gradient moves in it (the one new hyperparameter is L_T).

What the paper's text settles and what it does not. Only the abstract was at hand (AAAI
proceedings page and arXiv 1712.02679): localized selection of residues in bins, a
self-adjusting soft threshold, sparsity and quantization together, one new hyperparameter,
end-to-end compression of ~40x for convolution layers and ~200x for fully connected and
recurrent layers. The rule above and L_T = 50 (convolutions) / 500 (fully connected, LSTM) are
from the project's design notes (docs/algorithms.md, AdaComp). Our choices
where the text was not available:

* Scale: ``scale = mean |G_k|`` over the sent k, one float32 per layer (per tensor), summed in
  float64. It is the scale that minimizes ||G_S - scale * sign(G_S)||^2; the residue keeps
  whatever the ternary value over- or undershoots. A tensor where nothing is selected sends
  scale 0.
* ``G_k != 0``: in an all-zero bin every |H_k| >= 0 = g_max, which would send zeros; the
  rule excludes them, so an all-zero bin sends nothing.
* Wire format: one message per tensor per worker, four byte-aligned sections:

      scale      float32, little-endian
      counts     elements sent in each bin, ceil(n / L_T) fields of w bits
      offsets    position of each sent element within its bin, ascending, w bits each
      signs      one bit per sent element, 1 for negative (``codes.SignCodes``)

  with w = bits of L_T (``codes.FieldCodes.holding(L_T)``: 6 for 50, 9 for 500), the fewest
  bits that hold every offset and every count. The counts tell which bin each offset belongs
  to; they cost w / L_T bits per element (0.12 at L_T = 50, 0.018 at 500) whatever the
  density, and the message has exactly one offset and one sign per sent element.
* Layer types: convolution kernels get L_T = 50; fully connected, recurrent and embedding
  weights 500; vectors ("other": biases, norms, when the model is not known) 50. The kind
  comes from the module that owns each parameter when the codec is built with
  ``hvd_compress.pt.AdaComp.for_model(model)`` (or ``hvd_compress.tf.AdaComp.for_model`` for
  a Keras model); otherwise from the parameter's name and shape (``codec.layer_kind``), which
  gives the same bin lengths but cannot tell embeddings from linear layers.
* Tensors under 1024 elements (biases, norms) are sent whole by default, the classifier is
  compressed. On the MNIST-1D CNN (2 workers, 3000 steps) compressing every tensor, biases
  included, ended at 94.40% against 96.70% uncompressed; they are 0.3% of the elements.
* Non-finite gradients: a NaN or Inf anywhere in G makes the scale NaN, and a message with a
  non-finite scale decodes to all NaN, so every rank sees the overflow (as with TernGrad).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import buckets
from .codec import LAYER_KINDS, Codec
from .codes import FieldCodes, IntCodes, SignCodes
from .packing import pack, unpack
from .validation import check_choice, check_int

DEFAULT_BIN_LENGTHS = {"conv": 50, "linear": 500, "recurrent": 500, "embedding": 500, "other": 50}


class AdaComp(Codec):
    """Adaptive residual compression: per bin of L_T elements, the residues that the soft
    threshold lets through, as ternary values under one scale per layer.

    Args:
        bin_lengths (dict or None): L_T by layer kind (``"conv"``, ``"linear"``,
            ``"recurrent"``, ``"embedding"``, ``"other"``), merged over the defaults 50, 500,
            500, 500 and 50. Longer bins send fewer elements (roughly a few per bin).
        named_bin_lengths (dict or None): L_T for single parameters by name; these win over
            ``bin_lengths``.
        layers (dict or None): the layer kind of each parameter name. Built from the model by
            ``AdaComp.for_model(model)`` of either port; parameters missing from it are
            classified by name and shape.
        min_size (int): tensors with fewer elements are sent whole. Default 1024: biases
            and norms, a small share of the bytes that cost accuracy when compressed.
        compress_classifier (bool): compress the classifier layer too. Default True.
    """

    name = "adacomp"
    adam_remedy = True  # hvd_compress.remedies
    code_space = IntCodes(1)  # the ternary values sign(G) * scale / scale
    sparse = True
    message = "bins"
    error_feedback_default = True
    default_min_size = 1024

    def __init__(
        self,
        bin_lengths: Mapping[str, int] | None = None,
        *,
        named_bin_lengths: Mapping[str, int] | None = None,
        layers: Mapping[str, str] | None = None,
        min_size: int | None = None,
        compress_classifier: bool | None = None,
    ) -> None:
        super().__init__(min_size=min_size, compress_classifier=compress_classifier)
        owner = type(self).__name__
        bin_lengths = dict(bin_lengths or {})
        for kind in bin_lengths:
            check_choice(owner, "a bin_lengths key", kind, LAYER_KINDS)
        self.bin_lengths = {
            kind: check_int(owner, f"bin_lengths[{kind!r}] (L_T)", length, low=1)
            for kind, length in {**DEFAULT_BIN_LENGTHS, **bin_lengths}.items()
        }
        self.named_bin_lengths = {
            name: check_int(owner, f"named_bin_lengths[{name!r}] (L_T)", length, low=1)
            for name, length in (named_bin_lengths or {}).items()
        }
        self.layers = {
            name: check_choice(owner, f"layers[{name!r}]", kind, LAYER_KINDS)
            for name, kind in (layers or {}).items()
        }

    def __hash__(self):
        # The dictionaries cannot be hashed; equal codecs still hash equal.
        return hash((self.name, self.min_size))

    def layer_kind(self, name, shape):
        return self.layers.get(name) or super().layer_kind(name, shape)

    def bin_length(self, name, kind):
        """L_T of the parameter ``name`` in a layer of ``kind``."""
        return self.named_bin_lengths.get(name, self.bin_lengths[kind])

    # ----- numpy reference math; the PyTorch port overrides these with torch ops -----

    def select(self, compensated, grad, bin_length):
        """The selection rule on the flattened residue G (``compensated``, which already
        includes ``grad``, dW): a boolean mask of the elements to send."""
        residue = compensated.ravel()
        # In float16, H = G + dW may overflow to inf. That changes no selection: an exact |H|
        # past float16's largest value is above every (finite) bin max as well.
        with np.errstate(over="ignore"):
            threshold = residue + grad.ravel()
        bin_max = buckets.reduce(np.abs(residue), bin_length, np.max)
        return (np.abs(threshold) >= buckets.expand(bin_max, residue.size, bin_length)) & (
            residue != 0
        )

    def encode_message(self, compensated, selected, bin_length):
        """The message (``uint8``) that sends the ``selected`` elements of ``compensated``."""
        residue = compensated.ravel()
        positions = np.flatnonzero(selected)
        if not np.isfinite(residue).all():
            scale = np.float32(np.nan)
        else:
            magnitudes = np.abs(residue[positions]).astype(np.float64)
            scale = np.float32(magnitudes.sum() / max(positions.size, 1))
        fields = FieldCodes.holding(bin_length)
        counts = buckets.reduce(selected.ravel().astype(np.int64), bin_length, np.sum)
        return np.concatenate(
            [
                np.array([scale], "<f4").view(np.uint8),
                pack(counts, fields),
                pack(positions % bin_length, fields),
                pack(residue[positions], SignCodes()),
            ]
        )

    def decode_message(self, message, numel, bin_length):
        """One worker's sent values Gq (float32, ``numel`` elements) from its message."""
        fields = FieldCodes.holding(bin_length)
        bins = buckets.count(numel, bin_length)
        scale = np.frombuffer(message[:4].tobytes(), "<f4")[0]
        start = 4 + fields.packed_nbytes(bins)
        counts = unpack(message[4:start], fields, bins)
        sent = int(counts.sum())
        end = start + fields.packed_nbytes(sent)
        offsets = unpack(message[start:end], fields, sent)
        signs = unpack(message[end:], SignCodes(), sent)
        values = np.zeros(numel, np.float32)
        values[np.repeat(np.arange(bins) * bin_length, counts) + offsets] = signs * scale
        return values if np.isfinite(scale) else np.full(numel, np.nan, np.float32)

    def message_nbytes(self, numel, bin_length, sent):
        """Bytes of a message of ``sent`` elements of a tensor of ``numel``."""
        fields = FieldCodes.holding(bin_length)
        return (
            4
            + fields.packed_nbytes(buckets.count(numel, bin_length))
            + fields.packed_nbytes(sent)
            + SignCodes().packed_nbytes(sent)
        )
