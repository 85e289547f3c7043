"""hvd_compress: gradient compression for Horovod.

This package is the framework-neutral core (numpy only): the codecs' hyperparameters,
validation, wire formats and numpy reference math, the registry of names, the byte-count cost
model and the N-worker reference simulation. The framework ports are ``hvd_compress.pt``
(PyTorch) and ``hvd_compress.tf`` (TensorFlow).
"""

from .adacomp import AdaComp
from .adaptive import Adaptive
from .blocksign import BlockSign
from .codec import FP16, Codec, NoneCodec
from .codes import FloatCodes, IntCodes
from .dgc import DGC
from .powersgd import PowerSGD
from .qsgd import NUQSGD, QSGD, QSGDInf
from .registry import CODECS, resolve
from .scalecom import CyclicLocalTopK
from .terngrad import TernGrad

__all__ = [
    "AdaComp",
    "Adaptive",
    "BlockSign",
    "CODECS",
    "Codec",
    "CyclicLocalTopK",
    "DGC",
    "FP16",
    "FloatCodes",
    "IntCodes",
    "NUQSGD",
    "NoneCodec",
    "QSGD",
    "PowerSGD",
    "QSGDInf",
    "TernGrad",
    "resolve",
]
__version__ = "0.2.0"
