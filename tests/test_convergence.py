"""Every codec still trains: in one 2-rank Horovod job, a small MLP learns an easy synthetic
10-class task once per configuration (every codec of the registry by its name alone,
CELGC's ``LocalClipSGD``, compressed Adam), from the same seed,
data and schedule, and each run ends within 3 points of its baseline's test accuracy
(uncompressed SGD with the same optimizer; 5 points of synchronous clipped SGD for CELGC)
with fewer bytes than the baseline. It catches a codec that stops training or trains far
worse (a wrong sign, scale or decoding; DGC without its residual lost 8-14 points); the
exact arithmetic is the reference tests' (``test_pt_distributed.py`` and the codecs' own).

The accuracy claims on real data (MNIST-1D, the language model) are the demo's
(``make demo-full``, several seeds), not CI's. The bound comes from measured seeds:
``python -m tests.test_convergence 0 1 2 3 4 5 6 7`` prints every configuration's gap to its
baseline on each seed (docs/testing.md, "The convergence test").
"""

import sys

import numpy as np
import pytest
import torch

from .harness import run_parallel

pytestmark = [pytest.mark.multiprocess, pytest.mark.convergence]

CLASSES, FEATURES, HIDDEN = 10, 40, 256
TRAIN_SIZE, TEST_SIZE = 4000, 2000
# Noise of the samples around their class's prototype: the task is easy, but a 250-step run
# is still short of its last point, so that a codec's extra variance shows.
NOISE = 3.0
STEPS, BATCH, LR, MOMENTUM = 120, 32, 0.05, 0.9
SEED = 0
# Over seeds 0-7 the lowest gaps were -2.25 points (DGC), -2.10 (CLT-k, AdaComp), -1.40
# (ef-sign), -0.75 or better (the quantizers, PowerSGD, compressed Adam) and -4.15 for
# CELGC's local SGD against synchronous clipped SGD (docs/testing.md); each bound keeps about
# a point more, for the floating-point differences between machines.
TOLERANCE = 0.03
LOCAL_TOLERANCE = 0.05
# The baselines ended at 79.1-88.0% (SGD, AdamW) and 72.5-83.9% (clipped SGD); chance is 10%.
BASELINE_FLOOR = 0.65

# (label, codec, optimizer): optimizer "sgd" (heavy ball; ef-sign's worker momentum takes
# Nesterov's form there, hvd_compress.remedies), "local" (CELGC's
# LocalClipSGD, against "sync", synchronous clipped SGD), "adamw", or "cadam" (AdamW in the
# compressed-Adam mode).
CONFIGS = [
    ("none", "none", "sgd"),
    ("fp16", "fp16", "sgd"),
    ("terngrad", "terngrad", "sgd"),
    ("qsgd", "qsgd", "sgd"),
    ("qsgd-inf", "qsgd-inf", "sgd"),
    ("nuqsgd", "nuqsgd", "sgd"),
    ("adacomp", "adacomp", "sgd"),
    ("clt-k", "clt-k", "sgd"),
    ("powersgd", "powersgd", "sgd"),
    ("dgc", "dgc:warmup_steps=50", "sgd"),
    ("ef-sign", "ef-sign", "sgd"),
    ("sync", "none", "sync"),
    ("local", "none", "local"),
    ("none@adamw", "none", "adamw"),
    ("ef-sign+cadam@adamw", "ef-sign", "cadam"),
]
BASELINES = {
    "sgd": "none",
    "sync": "sync",
    "local": "sync",
    "adamw": "none@adamw",
    "cadam": "none@adamw",
}
CLIP = 0.05  # gamma of CELGC: the largest move of one step, at LR
ADAMW_LR = 0.002
COMPRESSED_ADAM_WARMUP = 30  # T_w of compressed Adam: uncompressed steps before the freeze


def task(seed):
    """The synthetic task: 10 Gaussian classes around random prototypes in 40 dimensions,
    the same on every rank. Returns x_train, y_train, x_test, y_test as tensors."""
    rng = np.random.default_rng(seed)
    prototypes = rng.standard_normal((CLASSES, FEATURES))

    def draw(n):
        labels = rng.integers(CLASSES, size=n)
        x = prototypes[labels] + NOISE * rng.standard_normal((n, FEATURES)) / np.sqrt(2)
        return torch.tensor(x, dtype=torch.float32), torch.tensor(labels)

    return (*draw(TRAIN_SIZE), *draw(TEST_SIZE))


def _train(codec, optimizer_kind, seed, data):
    """One run at this rank: test accuracy and the compression ratio of the last step."""
    import horovod.torch as hvd
    from torch import nn

    import hvd_compress.pt as hc

    x_train, y_train, x_test, y_test = data
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )
    if optimizer_kind in ("adamw", "cadam"):
        base = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    else:
        base = torch.optim.SGD(
            model.parameters(),
            lr=LR,
            momentum=0.0 if optimizer_kind in ("sync", "local") else MOMENTUM,
        )
    if optimizer_kind == "local":
        optimizer = hc.LocalClipSGD(base, model, clip=CLIP, sync_every=8, compression=codec)
    else:
        optimizer = hc.DistributedOptimizer(
            base,
            model.named_parameters(),
            compression=codec,
            seed=seed,
            compressed_adam=COMPRESSED_ADAM_WARMUP if optimizer_kind == "cadam" else None,
        )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    handed = uncompressed = 0
    for _ in range(STEPS):
        index = torch.randint(len(x_train), (BATCH,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x_train[index]), y_train[index]).backward()
        if optimizer_kind == "sync":
            optimizer.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP / LR)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        schedule.step()
        stats = optimizer.compression_stats()
        handed += stats["bytes_handed"]
        uncompressed += stats["bytes_uncompressed"]
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {"accuracy": accuracy, "ratio": uncompressed / max(handed, 1)}


def _train_all(seeds):
    """Every configuration on every seed, in this rank: {seed: {label: result}}."""
    import horovod.torch as hvd

    hvd.init()
    results = {}
    for seed in seeds:
        data = task(seed)
        results[seed] = {label: _train(codec, kind, seed, data) for label, codec, kind in CONFIGS}
    return results


def gaps(results):
    """Each configuration's test accuracy minus its baseline's."""
    return {
        label: results[label]["accuracy"] - results[BASELINES[kind]]["accuracy"]
        for label, _, kind in CONFIGS
    }


@pytest.mark.timeout(600)
def test_every_codec_trains_within_its_baselines_bound():
    ranks = [per_seed[SEED] for per_seed in run_parallel(_train_all, 2, [SEED], timeout=540)]
    for label in ranks[0]:  # the same model on both ranks (the bytes differ for sparse codecs)
        assert ranks[0][label]["accuracy"] == ranks[1][label]["accuracy"], label
    results = ranks[0]
    for label in set(BASELINES.values()):
        assert results[label]["accuracy"] >= BASELINE_FLOOR, (label, results[label])
    for label, gap in gaps(results).items():
        bound = LOCAL_TOLERANCE if label == "local" else TOLERANCE
        assert gap >= -bound, (label, gap, results[label])
    for label, _, _ in CONFIGS:
        if label in BASELINES.values():
            assert results[label]["ratio"] == 1, (label, results[label])
        else:  # fp16 halves the bytes; every other codec, and local SGD's rounds, more
            assert results[label]["ratio"] > 1.9, (label, results[label])


if __name__ == "__main__":
    seeds = [int(s) for s in sys.argv[1:]] or [0, 1, 2, 3, 4]
    from tests import test_convergence  # the body by its importable name, not __main__'s

    per_seed = run_parallel(test_convergence._train_all, 2, seeds, timeout=3600)[0]
    print(f"{'configuration':18s}" + "".join(f"{s:>8d}" for s in seeds) + "     min")
    table = {seed: gaps(per_seed[seed]) for seed in seeds}
    for label, _, _ in CONFIGS:
        row = [table[seed][label] for seed in seeds]
        accuracy = [per_seed[seed][label]["accuracy"] for seed in seeds]
        print(
            f"{label:18s}"
            + "".join(f"{100 * g:+8.2f}" for g in row)
            + f"{100 * min(row):+8.2f}   (accuracy {100 * min(accuracy):.1f}-"
            f"{100 * max(accuracy):.1f}%)"
        )
