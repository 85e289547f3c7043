"""AdaComp in PyTorch ops, and the layer kinds of a model's parameters; the algorithm, its
wire format and the numpy reference are in ``hvd_compress.adacomp``."""

import torch
from torch import nn

from hvd_compress import adacomp as reference
from hvd_compress.buckets import count
from hvd_compress.codes import FieldCodes, SignCodes

from .buckets import expand, reduce
from .codec import Codec
from .packing import pack, unpack

# Module classes whose own parameters form each layer kind; modules of other classes
# (norms, custom modules) own "other" parameters.
MODULE_KINDS = (
    (
        (
            nn.Conv1d,
            nn.Conv2d,
            nn.Conv3d,
            nn.ConvTranspose1d,
            nn.ConvTranspose2d,
            nn.ConvTranspose3d,
        ),
        "conv",
    ),
    ((nn.Linear, nn.Bilinear), "linear"),
    ((nn.RNNBase, nn.RNNCellBase), "recurrent"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
)


def layer_kinds(model):
    """{parameter name: layer kind} from the module that owns each parameter, with the names
    of ``model.named_parameters()``."""
    kinds = {}
    for prefix, module in model.named_modules():
        kind = next(
            (kind for classes, kind in MODULE_KINDS if isinstance(module, classes)), "other"
        )
        for name, _ in module.named_parameters(recurse=False):
            kinds[f"{prefix}.{name}" if prefix else name] = kind
    return kinds


class AdaComp(reference.AdaComp, Codec):
    __doc__ = reference.AdaComp.__doc__

    @classmethod
    def for_model(cls, model, **hyperparameters):
        """AdaComp with the layer kind of every parameter of ``model`` taken from the module
        that owns it: ``compression=hc.AdaComp.for_model(model)``."""
        return cls(layers=layer_kinds(model), **hyperparameters)

    def select(self, compensated, grad, bin_length):
        residue = compensated.reshape(-1)
        threshold = residue + grad.reshape(-1)
        bin_max = reduce(residue.abs(), bin_length, "amax")
        return (threshold.abs() >= expand(bin_max, residue.numel(), bin_length)) & (residue != 0)

    def encode_message(self, compensated, selected, bin_length):
        residue = compensated.reshape(-1)
        # The one read of the device per message: its length is the number selected, which
        # the host needs to hand it to the allgather.
        positions = torch.nonzero(selected).reshape(-1)
        magnitudes = residue[positions].abs().to(torch.float64)
        scale = (magnitudes.sum() / max(positions.numel(), 1)).to(torch.float32)
        scale = torch.where(torch.isfinite(residue).all(), scale, torch.nan)
        fields = FieldCodes.holding(bin_length)
        counts = reduce(selected.to(torch.int64), bin_length, "sum")
        return torch.cat(
            [
                scale.reshape(1).view(torch.uint8),
                pack(counts, fields),
                pack(positions % bin_length, fields),
                pack(residue[positions], SignCodes()),
            ]
        )

    def decode_message(self, message, numel, bin_length):
        fields = FieldCodes.holding(bin_length)
        bins = count(numel, bin_length)
        # A copy: a slice of a gathered buffer may not be aligned for float32.
        scale = message[:4].clone().view(torch.float32)
        start = 4 + fields.packed_nbytes(bins)
        counts = unpack(message[4:start], fields, bins)
        # The one read of the device per message: the number of records sizes the slices.
        sent = int(counts.sum())
        end = start + fields.packed_nbytes(sent)
        offsets = unpack(message[start:end], fields, sent)
        signs = unpack(message[end:], SignCodes(), sent)
        starts = torch.arange(bins, device=message.device) * bin_length
        values = torch.zeros(numel, dtype=torch.float32, device=message.device)
        values[torch.repeat_interleave(starts, counts, output_size=sent) + offsets] = signs * scale
        return torch.where(torch.isfinite(scale), values, torch.nan)
