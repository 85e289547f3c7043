"""Trains a byte-level transformer language model with AdamW and a compressed
DistributedOptimizer on the Python standard library's source (``hvd_compress.examples.corpus``).

    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_torch.py --compression terngrad

A decoder-only transformer (3 layers, width 192, 4 heads, 64-byte context, 1.4M parameters,
the embedding tied to the output layer) trained the way transformers are: AdamW with
decoupled weight decay on the matrices, a linear warm-up then cosine decay of the learning
rate, and the global gradient norm clipped after the exchange (``synchronize()`` before
``clip_grad_norm_``, as with Horovod's own optimizer). Rank 0 prints the validation loss in
bits per byte, the bytes handed to Horovod per worker per step and the compression ratio;
``--out`` also writes them as JSON.
"""

import math
import time

import horovod.torch as hvd
import numpy as np
import torch
from torch import nn

import hvd_compress.pt as hc
from hvd_compress.examples import corpus
from hvd_compress.examples.args import lm_parser
from hvd_compress.examples.report import RunRecord, language_model_result, publish
from hvd_compress.pt.device import rank_device


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    def __init__(self, context=64, width=192, layers=3, heads=4):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.norm(self.blocks(x)) @ self.embed.weight.t()  # tied output layer


def next_byte_loss(model, inputs, targets):
    """The mean cross-entropy, in nats, of the model's prediction of every next byte."""
    return nn.functional.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1))


def validation_loss(model, validation, context, device):
    """The model's mean next-byte loss, in nats, on the validation windows."""
    inputs, targets = map(torch.from_numpy, corpus.validation_windows(validation, context))
    with torch.no_grad():
        return next_byte_loss(model, inputs.to(device), targets.to(device)).item()


def main(argv=None):
    args = lm_parser(__doc__.splitlines()[0]).parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    device = rank_device()
    train, validation = corpus.load_stdlib_text()
    model = ByteLM(context=args.context).to(device)
    # Decoupled weight decay on the matrices only, as transformers are trained.
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": args.weight_decay},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=args.lr,
    )
    optimizer = hc.DistributedOptimizer(
        optimizer,
        model.named_parameters(),
        compression=args.compression,
        exchange=args.exchange,
        seed=args.seed,
        compressed_adam=args.compressed_adam,
    )

    def rate(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    initial_nats = validation_loss(model, validation, args.context, device)

    local_batch = args.batch_size // hvd.size()
    rng = np.random.default_rng(args.seed * 1000 + hvd.rank())
    record = RunRecord()
    for _step in range(args.steps):
        offsets = rng.integers(0, train.size - args.context - 1, local_batch)
        inputs, targets = map(torch.from_numpy, corpus.windows(train, offsets, args.context))
        start = time.perf_counter()
        optimizer.zero_grad()
        next_byte_loss(model, inputs.to(device), targets.to(device)).backward()
        optimizer.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            optimizer.step()
        schedule.step()
        record.record(time.perf_counter() - start, optimizer.compression_stats())

    result = language_model_result(
        record,
        optimizer.compression_stats(),
        args,
        hvd.size(),
        validation_loss(model, validation, args.context, device),
        initial_nats,
    )
    publish(result, hvd.rank(), args.out)
    return result


if __name__ == "__main__":
    main()
