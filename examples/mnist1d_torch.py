"""Trains a 1-D CNN on MNIST-1D with Horovod and a compressed DistributedOptimizer.

    horovodrun -np 2 -H localhost:2 --gloo python examples/mnist1d_torch.py --compression terngrad

Rank 0 prints the test accuracy, the bytes handed to Horovod per worker per step, the
compression ratio (also per layer type, with the density of sparse codecs), the median step
time and which tensors were compressed; ``--out`` also writes them as JSON.
"""

import time

import horovod.torch as hvd
import torch
from torch import nn

import hvd_compress.pt as hc
from hvd_compress.examples.args import WORKER_MOMENTUM, cnn_parser
from hvd_compress.examples.datasets import load_mnist1d
from hvd_compress.examples.report import RunRecord, publish
from hvd_compress.pt.device import rank_device


class CNN(nn.Module):
    """Three convolutions and two linear layers, 208K parameters: wide enough that the
    convolution and hidden weights exceed TernGrad's min_size (9,217) and really are
    compressed. The MNIST-1D paper's 5K-parameter CNN would be sent whole."""

    def __init__(self, channels=64, hidden=256):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, padding=2)
        self.conv2 = nn.Conv1d(channels, channels, 5, stride=2, padding=2)
        self.conv3 = nn.Conv1d(channels, channels, 5, stride=2, padding=2)
        self.fc1 = nn.Linear(channels * 10, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = x.unsqueeze(1)
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def main(argv=None):
    args = cnn_parser(__doc__.splitlines()[0]).parse_args(argv)

    hvd.init()
    torch.manual_seed(args.seed)
    device = rank_device()
    x_train, y_train, x_test, y_test = (torch.from_numpy(a).to(device) for a in load_mnist1d())
    # Each worker trains on its own shard of the training set.
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    model = CNN().to(device)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=args.lr,
            momentum=0.9,
            nesterov=args.optimizer == "nesterov",
            weight_decay=args.weight_decay,
        )
    optimizer = hc.DistributedOptimizer(
        optimizer,
        model.named_parameters(),
        compression=args.compression,
        exchange=args.exchange,
        seed=args.seed,
        adaptive=args.adaptive,
        worker_momentum=WORKER_MOMENTUM[args.worker_momentum],
    )
    # Cosine decay: the quantization noise of compressed gradients matters less as the
    # learning rate falls, which is where the final accuracy is decided.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    local_batch = args.batch_size // hvd.size()
    generator = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    record = RunRecord()
    for _step in range(args.steps):
        index = torch.randint(len(x_train), (local_batch,), generator=generator).to(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[index]), y_train[index])
        loss.backward()
        optimizer.step()
        schedule.step()
        record.record(time.perf_counter() - start, optimizer.compression_stats())

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        train_loss = nn.functional.cross_entropy(model(x_train), y_train).item()
    result = record.result(
        optimizer.compression_stats(),
        compression=args.compression,
        workers=hvd.size(),
        steps=args.steps,
        test_accuracy=accuracy,
        train_loss=train_loss,
    )
    publish(result, hvd.rank(), args.out)
    return result


if __name__ == "__main__":
    main()
