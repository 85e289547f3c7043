"""The benchmark models' tensor shapes and batch sizes, free of any framework: the PyTorch
models of ``benchmarks.models`` and the TensorFlow ones of ``benchmarks.tf_worker`` are
built from them (a process must not import both frameworks' Horovod: the second import
takes over Horovod's process sets)."""

MODELS = ("cnn", "resnet50")

# (planes, blocks) of ResNet-50's four stages of bottleneck blocks; a bottleneck widens its
# planes EXPANSION times.
RESNET50_STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))
EXPANSION = 4
FEATURES = 2048
CLASSES = 1000


def resnet50_convolutions():
    """(out, in, k) of every convolution of ResNet-50 in torchvision's parameter order
    (per bottleneck: conv1, conv2, conv3, then the downsampling convolution of the first)."""
    convolutions = [(64, 3, 7)]
    inplanes = 64
    for planes, blocks in RESNET50_STAGES:
        for block in range(blocks):
            convolutions += [
                (planes, inplanes, 1),
                (planes, planes, 3),
                (planes * EXPANSION, planes, 1),
            ]
            if block == 0:
                convolutions.append((planes * EXPANSION, inplanes, 1))
            inplanes = planes * EXPANSION
    return convolutions


# The widest convolution's fan-in (512 x 3 x 3): every convolution reads a slice of it.
RESNET50_INPUTS = max(inplanes * k * k for _, inplanes, k in resnet50_convolutions())


# Per-worker batch of the synthetic model: enough arithmetic for the compute to be measurable
# (about 1.2 GFLOP per step), little enough that the 100 Mbit/s steps stay communication-bound.
RESNET50_LOCAL_BATCH = 8
CNN_GLOBAL_BATCH = 100
