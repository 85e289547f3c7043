"""The benchmark's models and their batches.

``cnn``: the MNIST-1D CNN of ``examples/mnist1d_torch.py`` (208K parameters) on MNIST-1D,
global batch 100 as in the demo. ``resnet50``: a synthetic model with exactly the parameter
tensors of torchvision's ResNet-50 (161 tensors, 25,557,032 parameters, same sizes, same
order), for communication-bound timing without paying for convolutions on a 2-core CPU:
each convolution becomes a matrix of shape (out, in x k x k) applied to a slice of the
input, followed by its batch-norm scale and shift, and the outputs are summed into the 2048
features the classifier reads. ``layers``: a stack of ``LAYERS`` small linear layers, as
many tensors as a deep transformer has, each of 10K elements, where what the pipeline costs
per tensor (not per element) decides its CPU time (``benchmarks/step_cpu.py``).
"""

import dataclasses

import torch
from torch import nn

from examples.mnist1d_torch import CNN
from hvd_compress.examples.datasets import load_mnist1d

from .shapes import (
    CLASSES,
    CNN_GLOBAL_BATCH,
    FEATURES,
    RESNET50_INPUTS,
    RESNET50_LOCAL_BATCH,
    resnet50_convolutions,
)


class ConvAsMatrix(nn.Module):
    """A convolution's weight as an (out, in x k x k) matrix, then batch norm's affine."""

    def __init__(self, out_channels, in_channels, kernel):
        super().__init__()
        self.fan_in = in_channels * kernel * kernel
        self.weight = nn.Parameter(torch.randn(out_channels, self.fan_in) / self.fan_in**0.5)
        self.bn_weight = nn.Parameter(torch.ones(out_channels))
        self.bn_bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x):
        return x[:, : self.fan_in] @ self.weight.t() * self.bn_weight + self.bn_bias


class SyntheticResNet50(nn.Module):
    """ResNet-50's parameter tensors (see the module docstring); input (batch,
    RESNET50_INPUTS)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(ConvAsMatrix(*c) for c in resnet50_convolutions())
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        features = x.new_zeros(x.shape[0], FEATURES)
        for conv in self.convs:
            out = conv(x)
            features = features + nn.functional.pad(out, (0, FEATURES - out.shape[1]))
        return self.fc(torch.relu(features))


# The ``layers`` model: LAYERS linear layers of LAYER_WIDTH inputs and outputs, no biases.
LAYERS, LAYER_WIDTH = 600, 100


def layers():
    """The ``layers`` model (see the module docstring); input (batch, LAYER_WIDTH), and
    LAYER_WIDTH classes."""
    return nn.Sequential(*(nn.Linear(LAYER_WIDTH, LAYER_WIDTH, bias=False) for _ in range(LAYERS)))


@dataclasses.dataclass
class Workload:
    """A model factory and where its batches come from, for one rank."""

    name: str
    build: object  # () -> nn.Module, the same weights on every rank
    local_batch: int
    inputs: torch.Tensor  # this rank's training inputs
    targets: torch.Tensor
    test_inputs: torch.Tensor = None
    test_targets: torch.Tensor = None

    def batches(self, seed):
        """Endless random batches of this rank's data."""
        generator = torch.Generator().manual_seed(seed)
        while True:
            index = torch.randint(len(self.inputs), (self.local_batch,), generator=generator)
            yield self.inputs[index], self.targets[index]


def flush_subnormals():
    """Flushes subnormal floats to zero in this thread's arithmetic, as TensorFlow's CPU
    kernels do (a GPU computes with them at full speed). Without it, the synthetic
    ResNet-50's backward pass meets subnormals once its weights have moved for a few steps,
    and on x86 every product that meets one takes microcode's slow path: how much depends
    on the weights each method's trajectory reached, not on its exchange, so two methods
    sending the same bytes would time differently. Torch's backward runs on the calling
    thread with ``OMP_NUM_THREADS=1``, so the main thread is the one to set."""
    torch.set_flush_denormal(True)


def _seeded(factory, seed):
    def build():
        torch.manual_seed(seed)
        return factory()

    return build


def workload(name, rank, world_size, seed=0):
    """The ``Workload`` called ``name`` (``cnn``, ``resnet50`` or ``layers``) for ``rank``."""
    if name == "cnn":
        x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_mnist1d())
        # Each worker trains on its own shard of the training set, as in the example.
        return Workload(
            name,
            _seeded(CNN, seed),
            CNN_GLOBAL_BATCH // world_size,
            x_train[rank::world_size],
            y_train[rank::world_size],
            x_test,
            y_test,
        )
    if name == "resnet50":
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        inputs = torch.randn(4 * RESNET50_LOCAL_BATCH, RESNET50_INPUTS, generator=generator)
        targets = torch.randint(CLASSES, (len(inputs),), generator=generator)
        return Workload(
            name, _seeded(SyntheticResNet50, seed), RESNET50_LOCAL_BATCH, inputs, targets
        )
    if name == "layers":
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        inputs = torch.randn(4 * RESNET50_LOCAL_BATCH, LAYER_WIDTH, generator=generator)
        targets = torch.randint(LAYER_WIDTH, (len(inputs),), generator=generator)
        return Workload(name, _seeded(layers, seed), RESNET50_LOCAL_BATCH, inputs, targets)
    raise ValueError(f"model must be 'cnn', 'resnet50' or 'layers', got {name!r}")
