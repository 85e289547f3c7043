"""An elastic Horovod job of Keras for ``tests/test_elastic.py``: dist-EF-blockSGDM (ef-sign,
its server sharded among the ranks) trains a perceptron under ``hvd.elastic.run`` with
``hvd_compress.tf.elastic.KerasState``, by ``fit`` with Horovod's elastic Keras callbacks or by
a loop of tape steps, through a sequence of world changes, as ``tests/elastic_train.py`` does
in PyTorch: at the end of each change's epoch rank 0 rewrites the host-discovery file. At
each reset every worker writes what it saw to ``<dir>/change<k>_rank<r>.pkl``; the workers
that finish write ``<dir>/rank<r>.pkl``.

    horovodrun -np 3 --min-np 2 --host-discovery-script <dir>/discover.sh \\
        python -m tests.elastic_train_keras <dir> <steps> fit sharded 4=localhost:2 8=localhost:3
"""

import os
import pickle
import sys

import horovod.tensorflow.keras as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_compress.tf as htf
from hvd_compress.tf.elastic import KerasState
from hvd_compress.tf.tape import pipelines_over

from .elastic_changes import change_hosts

STEPS_PER_EPOCH = 4
BATCH = 16


def parameter_mass(pipeline):
    """This rank's share of the residual mass, as the average of a step would carry it: its
    worker residual over the N ranks, plus its share of the server residual (a sharded
    server's shard whole at its positions, a replicated one over the N ranks)."""
    mass = {}
    for plan in pipeline.plans:
        if plan.reason != "compressed":
            continue
        total = pipeline.state.worker.residuals[plan.name].numpy() / pipeline.world_size
        server = pipeline.state.server.residuals[plan.name].numpy()
        exchange = pipeline.exchanges[plan.name]
        if exchange.name == "sharded":
            total[exchange.shard(pipeline.rank)] += server
        else:
            total += server / pipeline.world_size
        mass[plan.name] = total
    return mass


def _save(obj, directory, name):
    with open(os.path.join(directory, name), "wb") as f:
        pickle.dump(obj, f)


def main(directory, steps, loop, exchange, changes):
    """``loop``: ``"fit"`` (the Keras ``DistributedOptimizer``) or ``"tape"`` (a
    ``tf.function`` step of a ``DistributedGradientTape`` and a Keras SGD); ``changes``:
    (step, hosts) pairs in step order, each step a multiple of the epoch's."""
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    codec = htf.BlockSign(min_size=0)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if loop == "fit":
        optimizer = htf.DistributedOptimizer(optimizer, compression=codec, exchange=exchange)
        model.compile(optimizer=optimizer, loss=loss)
    state = KerasState(model, optimizer, epoch=0)
    epochs = steps // STEPS_PER_EPOCH
    change_epochs = [step // STEPS_PER_EPOCH for step, _ in changes]
    data = np.random.default_rng(hvd.rank())
    x = data.normal(size=(STEPS_PER_EPOCH * BATCH, 32)).astype("float32")
    y = data.integers(0, 4, size=STEPS_PER_EPOCH * BATCH)
    sizes = []
    committed = {}

    def pipeline():
        if loop == "fit":
            return optimizer._hvdc_pipeline
        [tape_pipeline] = pipelines_over(model.trainable_variables)
        return tape_pipeline

    def on_reset():
        # After the pipeline followed the new world (KerasState.reset): the mass this rank
        # held at the commit before the change, and now.
        seen = {
            "before": committed["mass"],
            "after": parameter_mass(pipeline()),
            "world": pipeline().world_size,
        }
        _save(seen, directory, f"change{change_epochs.index(state.epoch)}_rank{hvd.rank()}.pkl")

    state.register_reset_callbacks([on_reset])

    def after_commit():
        """At a change's epoch, has rank 0 change the hosts and waits for the driver to
        interrupt every rank."""
        committed["mass"] = parameter_mass(pipeline())
        if state.epoch not in change_epochs:
            return
        change_hosts(state, hvd.rank(), directory, changes[change_epochs.index(state.epoch)][1])

    class Changes(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sizes.append(hvd.size())

        def on_epoch_end(self, epoch, logs=None):
            after_commit()

    @hvd.elastic.run
    def train(state):
        if loop == "fit":
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=epochs - state.epoch,
                shuffle=False,
                verbose=0,
                # The epoch counted before the commit at its end, so that a change of world
                # after it resumes at the next epoch.
                callbacks=[
                    hvd.elastic.UpdateEpochStateCallback(state),
                    hvd.elastic.CommitStateCallback(state),
                    Changes(),
                ],
            )
            return

        # Traced in each world that train() runs in.
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            tape = htf.DistributedGradientTape(tape, compression=codec, exchange=exchange)
            optimizer.apply(tape.gradient(value, model.trainable_variables))

        while state.epoch < epochs:
            for start in range(0, len(x), BATCH):
                step(x[start : start + BATCH], y[start : start + BATCH])
                sizes.append(hvd.size())
            state.epoch += 1
            state.commit()
            after_commit()

    train(state)
    _save(
        {
            "sizes": sizes,
            "params": np.concatenate([v.numpy().reshape(-1) for v in model.variables]),
            "size": hvd.size(),
        },
        directory,
        f"rank{hvd.rank()}.pkl",
    )


if __name__ == "__main__":
    changes = [argument.split("=", 1) for argument in sys.argv[5:]]
    directory, steps, loop, exchange = sys.argv[1:5]
    main(directory, int(steps), loop, exchange, [(int(s), h) for s, h in changes])
