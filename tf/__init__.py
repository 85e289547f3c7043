"""TensorFlow port of hvd_compress: codecs as Horovod ``Compressor`` subclasses, and a
``DistributedGradientTape`` and a Keras ``DistributedOptimizer`` that exchange their codes
through Horovod's TensorFlow collectives."""

from hvd_compress.registry import port_codecs

from .adacomp import AdaComp
from .blocksign import BlockSign
from .codec import FP16, Codec, NoneCodec
from .dgc import DGC
from .powersgd import PowerSGD
from .qsgd import NUQSGD, QSGD, QSGDInf
from .scalecom import CyclicLocalTopK
from .terngrad import TernGrad

CODECS = port_codecs(globals())

from .local_sgd import LocalClipSGD  # noqa: E402  (needs CODECS)
from .optimizer import DistributedOptimizer  # noqa: E402  (needs CODECS)
from .tape import DistributedGradientTape  # noqa: E402  (needs CODECS)

__all__ = [
    "AdaComp",
    "BlockSign",
    "CODECS",
    "Codec",
    "CyclicLocalTopK",
    "DGC",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "FP16",
    "LocalClipSGD",
    "NUQSGD",
    "NoneCodec",
    "PowerSGD",
    "QSGD",
    "QSGDInf",
    "TernGrad",
]
