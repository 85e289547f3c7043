"""Trains the byte-level transformer language model of ``lm_torch.py`` in Keras with AdamW,
``model.fit`` and a compressed DistributedOptimizer, on the Python standard library's source
(``hvd_compress.examples.corpus``).

    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_keras.py --compression terngrad

The model and schedule are ``lm_torch.py``'s (3 layers, width 192, 4 heads, 64-byte context,
the embedding tied to the output layer; AdamW with decoupled weight decay on the matrices, a
linear warm-up then cosine decay). The global gradient norm is clipped after the exchange:
the wrapper averages before the base optimizer's ``apply``, which clips (``global_clipnorm``).
Rank 0 prints the validation loss in bits per byte, the bytes handed to Horovod per worker
per step and the compression ratio; ``--out`` also writes them as JSON.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvd_compress.tf as hc  # noqa: E402
from hvd_compress.examples import corpus  # noqa: E402
from hvd_compress.examples.args import lm_parser  # noqa: E402
from hvd_compress.examples.keras_steps import StepRecorder  # noqa: E402
from hvd_compress.examples.report import language_model_result, publish  # noqa: E402
from hvd_compress.tf.callbacks import BroadcastGlobalVariablesCallback  # noqa: E402
from hvd_compress.tf.device import rank_device  # noqa: E402


class Block(keras.layers.Layer):
    """Pre-norm causal attention and MLP, each added to the residual stream."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.expand = keras.layers.Dense(4 * width, activation="gelu")
        self.contract = keras.layers.Dense(width)

    def call(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, use_causal_mask=True)
        return x + self.contract(self.expand(self.norm2(x)))


class ByteLM(keras.Model):
    def __init__(self, context=64, width=192, layers=3, heads=4):
        super().__init__()
        self.embed = keras.layers.Embedding(256, width)
        self.position = self.add_weight(
            shape=(context, width),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="position",
        )
        self.blocks = [Block(width, heads) for _ in range(layers)]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)

    def call(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        # The output layer is the embedding, transposed (tied).
        return keras.ops.matmul(self.norm(x), keras.ops.transpose(self.embed.embeddings))


def validation_loss(model, validation, context):
    """The model's mean next-byte loss, in nats, on the validation windows."""
    inputs, targets = corpus.validation_windows(validation, context)
    logits = model.predict(inputs, batch_size=64, verbose=0)
    return float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(targets, logits))


def main(argv=None):
    args = lm_parser(__doc__.splitlines()[0]).parse_args(argv)
    hvd.init()
    rank_device()
    keras.utils.set_random_seed(args.seed)
    train, validation = corpus.load_stdlib_text()
    model = ByteLM(context=args.context)
    model(np.zeros((1, args.context), np.int64))  # builds the variables
    initial_nats = validation_loss(model, validation, args.context)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=max(1, args.steps - args.warmup),
        warmup_target=args.lr,
        warmup_steps=args.warmup,
    )
    optimizer = keras.optimizers.AdamW(
        schedule, weight_decay=args.weight_decay, global_clipnorm=args.clip
    )
    # Decoupled weight decay on the matrices only, as transformers are trained.
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if len(v.shape) < 2]
    )
    optimizer = hc.DistributedOptimizer(
        optimizer,
        compression=args.compression,
        exchange=args.exchange,
        seed=args.seed,
        compressed_adam=args.compressed_adam,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    local_batch = args.batch_size // hvd.size()
    rng = np.random.default_rng(args.seed * 1000 + hvd.rank())
    offsets = rng.integers(0, train.size - args.context - 1, args.steps * local_batch)
    inputs, targets = corpus.windows(train, offsets, args.context)
    recorder = StepRecorder()
    model.fit(
        inputs,
        targets,
        batch_size=local_batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastGlobalVariablesCallback(0), recorder],
    )

    result = language_model_result(
        recorder.record,
        optimizer.compression_stats(),
        args,
        hvd.size(),
        validation_loss(model, validation, args.context),
        initial_nats,
    )
    publish(result, hvd.rank(), args.out)
    return result


if __name__ == "__main__":
    main()
