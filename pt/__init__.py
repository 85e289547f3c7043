"""PyTorch port of hvd_compress: codecs as Horovod ``Compressor`` subclasses, and a
``DistributedOptimizer`` that exchanges their codes through Horovod collectives."""

from hvd_compress.adaptive import Adaptive
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

__all__ = [
    "AdaComp",
    "Adaptive",
    "BlockSign",
    "CODECS",
    "CyclicLocalTopK",
    "DGC",
    "Codec",
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
