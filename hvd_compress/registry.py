"""Codecs by name: ``compression="terngrad"`` anywhere a codec is accepted."""

import ast
import importlib

from .adacomp import AdaComp
from .blocksign import BlockSign
from .codec import FP16, Codec, NoneCodec
from .dgc import DGC
from .powersgd import PowerSGD
from .qsgd import NUQSGD, QSGD, QSGDInf
from .scalecom import CyclicLocalTopK
from .terngrad import TernGrad

CODECS = {
    cls.name: cls
    for cls in (
        NoneCodec,
        FP16,
        TernGrad,
        QSGD,
        QSGDInf,
        NUQSGD,
        BlockSign,
        AdaComp,
        CyclicLocalTopK,
        PowerSGD,
        DGC,
    )
}


def port_codecs(package: str) -> dict:
    """A port's codecs by registry name, in ``CODECS``' order: for each of the core's
    classes, the class of that name in the port ``package``'s module of the same name
    (``hvd_compress.terngrad.TernGrad`` -> ``hvd_compress.pt.terngrad.TernGrad``), as the
    ports mirror the core file for file."""
    return {
        name: getattr(
            importlib.import_module(f"{package}.{cls.__module__.rpartition('.')[2]}"), cls.__name__
        )
        for name, cls in CODECS.items()
    }


# What a wrapper's ``compression`` argument takes (``resolve``): a registry name (with
# hyperparameters), a codec instance, None, or Horovod's Compression.none / .fp16.
Compression = str | Codec | type | None

# Horovod's own compressors (``hvd.Compression.none`` and ``.fp16``, classes of
# horovod.torch.compression and horovod.tensorflow.compression), by class name: code written
# for Horovod's wrappers passes them, and the codecs of the same names do the same.
HOROVOD_COMPRESSORS = {"NoneCompressor": "none", "FP16Compressor": "fp16"}


def resolve(compression, classes=None):
    """Returns a codec instance of the port ``classes`` (name -> class) for ``compression``.

    ``compression`` is a registry name, optionally with hyperparameters for command lines
    (``"ef-sign:max_block_size=256"``, ``"qsgd:bits=2:bucket_size=128"``; values are Python
    literals), a codec instance, ``None`` (no compression) or Horovod's
    ``hvd.Compression.none`` / ``.fp16``. An instance of another port (for example the numpy
    reference) is rebuilt with the same hyperparameters as the matching class of
    ``classes``.
    """
    classes = CODECS if classes is None else classes
    if compression is None:
        compression = "none"
    if (
        isinstance(compression, type)
        and compression.__module__.startswith("horovod.")
        and compression.__name__ in HOROVOD_COMPRESSORS
    ):
        compression = HOROVOD_COMPRESSORS[compression.__name__]
    if isinstance(compression, str):
        name, *settings = compression.split(":")
        if name not in classes:
            raise ValueError(
                f"compression must be one of {sorted(classes)} (optionally "
                f"followed by :hyperparameter=value items) or a codec instance; "
                f"got {compression!r}"
            )
        hyperparameters = dict(_setting(compression, item) for item in settings)
        unknown = set(hyperparameters) - set(classes[name]().params()) - set(classes[name].renamed)
        if unknown:
            raise ValueError(
                f"compression {compression!r}: {name} has no hyperparameter "
                f"{', '.join(sorted(unknown))}; it takes "
                f"{', '.join(classes[name]().params())}"
            )
        return classes[name](**hyperparameters)
    if isinstance(compression, Codec):
        cls = classes.get(compression.name)
        if cls is None:
            raise ValueError(
                f"codec {compression.name!r} is not available here; available: {sorted(classes)}"
            )
        return compression if isinstance(compression, cls) else cls(**compression.params())
    raise TypeError(
        f"compression must be a codec name ({', '.join(sorted(classes))}), a "
        f"codec instance or hvd.Compression.none / .fp16, got {compression!r}"
    )


def _setting(compression, item):
    """(name, value) of a ``name=value`` item of the codec spec ``compression``."""
    key, equals, text = item.partition("=")
    try:
        if not (equals and key.isidentifier()):
            raise ValueError
        return key, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"compression {compression!r}: hyperparameters are name=value items "
            f"with Python literal values, such as max_block_size=256; got "
            f"{item!r}"
        ) from None
