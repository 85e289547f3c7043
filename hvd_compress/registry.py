"""Codecs by name: ``compression="terngrad"`` anywhere a codec is accepted."""
from .adacomp import AdaComp
from .blocksign import BlockSign
from .codec import FP16, Codec, NoneCodec
from .qsgd import NUQSGD, QSGD, QSGDInf
from .scalecom import CyclicLocalTopK
from .terngrad import TernGrad

CODECS = {cls.name: cls for cls in (NoneCodec, FP16, TernGrad, QSGD, QSGDInf, NUQSGD,
                                             BlockSign, AdaComp, CyclicLocalTopK)}


def resolve(compression, classes=None):
    """Returns a codec instance of the port ``classes`` (name -> class) for ``compression``.

    ``compression`` is a registry name, a codec instance or ``None`` (no compression). An
    instance of another port (for example the numpy reference) is rebuilt with the same
    hyperparameters as the matching class of ``classes``.
    """
    classes = CODECS if classes is None else classes
    if compression is None:
        compression = "none"
    if isinstance(compression, str):
        if compression not in classes:
            raise ValueError(f"compression must be one of {sorted(classes)} or a codec "
                             f"instance; got {compression!r}")
        return classes[compression]()
    if isinstance(compression, Codec):
        cls = classes.get(compression.name)
        if cls is None:
            raise ValueError(f"codec {compression.name!r} is not available here; "
                             f"available: {sorted(classes)}")
        return compression if isinstance(compression, cls) else cls(**compression.params())
    raise TypeError(f"compression must be a codec name ({', '.join(sorted(classes))}) or a "
                    f"codec instance, got {type(compression).__name__}")
