"""TensorFlow port of hvd_compress: codecs as Horovod ``Compressor`` subclasses, and a
``DistributedGradientTape`` and a Keras ``DistributedOptimizer`` that exchange their codes
through Horovod's TensorFlow collectives."""

from hvd_compress.adaptive import Adaptive

from .adacomp import AdaComp
from .blocksign import BlockSign
from .codec import FP16, Codec, NoneCodec
from .codecs import CODECS
from .dgc import DGC
from .local_sgd import LocalClipSGD
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGD
from .qsgd import NUQSGD, QSGD, QSGDInf
from .scalecom import CyclicLocalTopK
from .tape import DistributedGradientTape
from .terngrad import TernGrad

__all__ = [
    "AdaComp",
    "Adaptive",
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
