"""Trains a GRU on MNIST-1D sequences with Horovod: synchronous clipped SGD or CELGC local SGD.

    horovodrun -np 4 -H localhost:4 --gloo python examples/mnist1d_gru_torch.py --mode local
    horovodrun -np 4 -H localhost:4 --gloo python examples/mnist1d_gru_torch.py --mode sync

``--mode sync`` averages the gradients every step (``hvd_compress.pt.DistributedOptimizer``
with ``--compression``) and clips them on the norm of the average, the CELGC paper's
baseline. ``--mode local`` runs ``hvd_compress.pt.LocalClipSGD``: each worker clips its own
steps and the workers average their models every ``--sync-every`` steps (``--compression``
then compresses those rounds). Both use the step size min(eta_t, gamma_t / ||g||) with
gamma_t / eta_t = ``--clip`` / ``--lr`` under a cosine decay. Rank 0 prints the test
accuracy, the bytes handed to Horovod per worker per step and the compression ratio against
synchronous SGD's plain allreduce; ``--out`` also writes them as JSON, with the keys of
``examples/mnist1d_torch.py``.
"""

import argparse
import time

import horovod.torch as hvd
import torch
from torch import nn

import hvd_compress.pt as hc
from hvd_compress.examples.datasets import load_mnist1d
from hvd_compress.examples.report import RunRecord, publish
from hvd_compress.pt.device import rank_device


class GRUClassifier(nn.Module):
    """A GRU reads the 40 samples of a signal one at a time (one feature per time step); a
    linear layer classifies the mean of its hidden states over time. Recurrent networks are
    where gradients explode and CELGC's clipping matters. (Classified from the last hidden
    state alone, the GRU stayed at chance for 600 steps of SGD: the gradient has to cross
    all 40 steps.)"""

    def __init__(self, hidden=64):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.classifier = nn.Linear(hidden, 10)

    def forward(self, x):
        states, _ = self.gru(x.unsqueeze(-1))
        return self.classifier(states.mean(dim=1))


def build_optimizer(args, model):
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.mode == "local":
        return hc.LocalClipSGD(
            sgd,
            model,
            clip=args.clip,
            sync_every=args.sync_every,
            compression=args.compression,
            seed=args.seed,
        )
    return hc.DistributedOptimizer(
        sgd, model.named_parameters(), compression=args.compression, seed=args.seed
    )


def train_step(args, model, optimizer, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if args.mode == "local":
        optimizer.step()
        return
    optimizer.synchronize()
    # Clipping the averaged gradient to gamma / eta_0 gives the step min(eta_t, gamma_t /
    # ||g_bar||) at every eta_t of the schedule (gamma_t / eta_t stays gamma / eta_0).
    nn.utils.clip_grad_norm_(model.parameters(), args.clip / args.lr)
    with optimizer.skip_synchronize():
        optimizer.step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode",
        choices=("sync", "local"),
        default="local",
        help="sync: gradients averaged every step; local: LocalClipSGD",
    )
    parser.add_argument(
        "--compression",
        default="none",
        help="codec name: of the gradients (sync) or of the rounds (local)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=8,
        help="I, local steps between averaging rounds (local mode)",
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=3.0, help="peak learning rate eta_0")
    parser.add_argument("--clip", type=float, default=1.0, help="gamma at eta_0")
    parser.add_argument("--hidden", type=int, default=64, help="GRU hidden size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results of rank 0 as JSON here")
    args = parser.parse_args(argv)
    if args.mode == "local" and args.steps % args.sync_every:
        parser.error(
            "--steps must be a multiple of --sync-every, so that training ends on "
            "an averaging round and every rank holds the model evaluated"
        )

    hvd.init()
    torch.manual_seed(args.seed)
    device = rank_device()
    x_train, y_train, x_test, y_test = (torch.from_numpy(a).to(device) for a in load_mnist1d())
    # Each worker trains on its own shard of the training set.
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    model = GRUClassifier(args.hidden).to(device)
    optimizer = build_optimizer(args, model)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    local_batch = args.batch_size // hvd.size()
    generator = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    record = RunRecord()
    for _ in range(args.steps):
        index = torch.randint(len(x_train), (local_batch,), generator=generator).to(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        train_step(args, model, optimizer, x_train[index], y_train[index])
        schedule.step()
        record.record(time.perf_counter() - start, optimizer.compression_stats())

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        train_loss = nn.functional.cross_entropy(model(x_train), y_train).item()
    local = args.mode == "local"
    result = record.result(
        optimizer.compression_stats(),
        varying=local,
        mode=args.mode,
        sync_every=args.sync_every if local else 1,
        compression=args.compression,
        workers=hvd.size(),
        steps=args.steps,
        test_accuracy=accuracy,
        train_loss=train_loss,
    )
    publish(result, hvd.rank(), args.out, label=f"{args.mode} {args.compression}")
    return result


if __name__ == "__main__":
    main()
