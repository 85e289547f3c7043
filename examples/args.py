"""The command lines the examples of one task share in both frameworks (the MNIST-1D CNN:
``examples/mnist1d_torch.py`` and ``examples/mnist1d_keras.py``; the language model:
``examples/lm_torch.py`` and ``examples/lm_keras.py``), so that ``hvd-compress demo`` drives
both with the same options and defaults."""

import argparse


def cnn_parser(description):
    """An ``ArgumentParser`` with the CNN examples' training options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--compression",
        default="terngrad",
        help="codec name, with optional hyperparameters: terngrad, ef-sign:max_block_size=256, ...",
    )
    parser.add_argument("--exchange", default="auto")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="each tensor by the codec, fp16 or fp32, whichever is predicted "
        "fastest (DistributedOptimizer(adaptive=True); PyTorch only)",
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=100, help="global batch size")
    parser.add_argument(
        "--optimizer",
        choices=("adam", "sgd", "nesterov"),
        default="sgd",
        help="Adam, or SGD with momentum 0.9 (heavy-ball or Nesterov)",
    )
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument(
        "--worker-momentum",
        choices=tuple(WORKER_MOMENTUM),
        default="auto",
        help="the SGD's momentum applied on the worker before compression: the wrapper's "
        "choice (auto), in the SGD's own form (sgd), in Nesterov's form, or off "
        "(DistributedOptimizer(worker_momentum=...))",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results of rank 0 as JSON here")
    return parser


# --worker-momentum's choices and the wrappers' worker_momentum they stand for.
WORKER_MOMENTUM = {"auto": None, "sgd": True, "nesterov": "nesterov", "off": False}


def lm_parser(description):
    """An ``ArgumentParser`` with the language-model examples' training options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--compression", default="terngrad", help="codec name, with optional hyperparameters"
    )
    parser.add_argument("--exchange", default="auto")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=60, help="linear warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient norm bound")
    parser.add_argument(
        "--compressed-adam",
        type=int,
        metavar="T_W",
        help="1-bit Adam's mode: T_W uncompressed warm-up steps, then the variance frozen "
        "and the momentum compressed (DistributedOptimizer(compressed_adam=T_W)); 0: off. "
        "Default: the library's choice (on, T_W = 200, for ef-sign, adacomp and clt-k)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results of rank 0 as JSON here")
    return parser
