"""CELGC: local SGD with per-worker gradient clipping (Liu, Zhuang, Lei, Liao, NeurIPS 2022,
"Communication-Efficient Local Gradient Clipping", Algorithm 1 and the authors' code), for
Keras 3 optimizers.

Every worker i steps on its own data with its own gradient and a clipped step size,

    x_i <- x_i - min(eta_t, gamma_t / ||g_i||) g_i       (||.||: the L2 norm over all layers)

and every I steps the workers average their parameters. That average is the only
communication: 32 / I bits per element and step, against 32 for synchronous SGD. Clipping
keeps the local steps safe where gradients explode (recurrent networks): a step moves the
weights by at most gamma_t, so between two averages a worker drifts at most I gamma_t from
the others' mean (the paper's Lemma 1).

Schedule. Algorithm 1 averages at the start of every iteration t with t mod I = 0, before the
gradient of that iteration is computed. ``apply()`` receives a gradient that is already
computed, so the average for iteration t runs at the end of step t - 1: after every I-th
local step. Iteration 0's average is the broadcast of the initial variables that every
Horovod program starts with (``BroadcastGlobalVariablesCallback``), so T calls of ``apply()``
make floor(T / I) averaging rounds, and after any multiple of I steps all ranks hold the same
variables.

The step counter, the round counter and the other state are ``tf.Variable``\\ s, so the
rounds run inside ``model.fit``'s ``tf.function`` (as ``tf.cond`` branches that every rank
takes alike) and ``tf.train.Checkpoint(optimizer=...)`` saves them.
"""

from __future__ import annotations

import contextlib

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvd_compress.registry import Compression, resolve
from hvd_compress.validation import check_bool, check_choice, check_float, check_int

from .codecs import CODECS
from .exchange import Meter
from .optimizer import wrap_in_subclass
from .pipeline import make_pipeline, variable_name
from .xla import leave_auto_xla_off, refuse_xla

CLIPPINGS = ("local", "global_average", "max")


def _state(name, dtype=tf.int64):
    """A scalar of the wrapper's state, zero until the first step."""
    with tf.init_scope():
        return tf.Variable(tf.zeros([], dtype), trainable=False, name=name)


class _LocalClipSGD:
    """Methods grafted onto a subclass of the user's SGD class (see ``LocalClipSGD``); the
    base class is called explicitly, never through ``super``, as in ``DistributedOptimizer``."""

    _hvdc_owner = "LocalClipSGD"

    def build(self, variables):
        self._hvdc_base.build(self, variables)
        self._hvdc_attach(variables)

    def _hvdc_attach(self, variables):
        # Attributes of the optimizer (set outside Keras's untracked build), so
        # tf.train.Checkpoint(optimizer=...) saves them.
        self._hvdc_named = [(variable_name(v), v) for v in variables]
        self._hvdc_buffers = (
            [
                v
                for v in self._hvdc_model.non_trainable_variables
                if tf.as_dtype(v.dtype).is_floating
            ]
            if self._hvdc_average_buffers
            else []
        )
        self._hvdc_steps = _state("local_steps")
        self._hvdc_syncs = _state("syncs")
        self._hvdc_last_step_bytes = _state("last_step_bytes")
        self._hvdc_average_grad_norm = _state("average_grad_norm", tf.float32)
        self._hvdc_pipeline = None
        # With a codec, what travels is each worker's move since the last round, added to the
        # parameters of that round (the anchors), which every rank holds alike: they are taken
        # at the start of every period, after a round or the initial broadcast.
        self._hvdc_anchors = {}
        if self._hvdc_codec.code_space is not None:
            self._hvdc_pipeline = make_pipeline(
                "LocalClipSGD",
                self._hvdc_named,
                self._hvdc_codec,
                (),
                dict(
                    exchange="auto",
                    average=True,
                    seed=self._hvdc_seed,
                    prescale_factor=1.0,
                    postscale_factor=1.0,
                    error_feedback=True,
                ),
            )
            with tf.init_scope():
                self._hvdc_anchors = {
                    name: tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="anchor")
                    for name, v in self._hvdc_named
                }

    @property
    def local_steps(self):
        """Calls of ``apply()`` so far (saved by ``tf.train.Checkpoint``); they position the
        rounds."""
        return int(self._hvdc_steps.numpy())

    @property
    def syncs(self):
        """Averaging rounds made so far."""
        return int(self._hvdc_syncs.numpy())

    @property
    def last_step_bytes(self):
        """Bytes handed to Horovod by the last ``apply()``."""
        return int(self._hvdc_last_step_bytes.numpy())

    # Unconverted by autograph, as ``DistributedGradientTape.gradient``.
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """One local clipped step; after every ``sync_every``-th, the variables are
        averaged."""
        refuse_xla("LocalClipSGD")
        grads = list(grads)
        if trainable_variables is None:
            variables = self._trainable_variables
        else:
            variables = trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(variables)
        by_key = {self._var_key(v): g for v, g in zip(variables, grads)}
        ordered = [by_key.get(self._var_key(v)) for _, v in self._hvdc_named]
        starts_period = tf.equal(self._hvdc_steps % self._hvdc_sync_every, 0)
        handed = tf.constant(0, tf.int64)
        if self._hvdc_pipeline is not None:
            tf.cond(starts_period, self._hvdc_take_anchors, lambda: None)
        if self._hvdc_clipping != "local":
            handed += tf.cond(
                starts_period,
                lambda: self._hvdc_averaged_gradient_norm(ordered),
                lambda: tf.constant(0, tf.int64),
            )
        with self._hvdc_clipped_rates(self._hvdc_clipping_norm(ordered)):
            self._hvdc_base.apply(self, grads, trainable_variables)
        self._hvdc_steps.assign_add(1)
        handed += tf.cond(
            tf.equal(self._hvdc_steps % self._hvdc_sync_every, 0),
            self._hvdc_average,
            lambda: tf.constant(0, tf.int64),
        )
        self._hvdc_last_step_bytes.assign(handed)

    def _hvdc_clipping_norm(self, grads):
        """The norm that decides the step size, by the ``clipping`` option."""
        if self._hvdc_clipping == "global_average":
            return self._hvdc_average_grad_norm
        local = tf.linalg.global_norm([g for g in grads if g is not None])
        if self._hvdc_clipping == "max":
            return tf.maximum(local, self._hvdc_average_grad_norm)
        return local

    def _hvdc_averaged_gradient_norm(self, grads):
        """Sets ||g_bar||, the norm of the average of all workers' gradients (one more
        allreduce); returns the bytes handed."""
        meter = Meter()
        # Every rank must hand over the same tensors, also for variables without a gradient.
        dense = [
            meter.hand(tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g))
            for (_, v), g in zip(self._hvdc_named, grads)
        ]
        averaged = hvd.grouped_allreduce(dense, op=hvd.Average, name="hvdc.local_sgd.gradients")
        self._hvdc_average_grad_norm.assign(tf.linalg.global_norm(averaged))
        return meter.take()

    @contextlib.contextmanager
    def _hvdc_clipped_rates(self, norm):
        """Runs the base step at min(eta_t, gamma_t / ||g||) with gamma_t = gamma eta_t / eta_0,
        that is eta_t (gamma / eta_0) / ||g|| where ||g|| exceeds gamma / eta_0. The clipped
        rate is what Keras's SGD reads as its learning rate, so it scales the gradient's
        share of the momentum and the decoupled weight decay too."""
        threshold = self._hvdc_max_grad_norm
        self._hvdc_rate_factor = tf.where(norm > threshold, threshold / norm, 1.0)
        try:
            yield
        finally:
            self._hvdc_rate_factor = None

    def _get_current_learning_rate(self):
        rate = self._hvdc_base._get_current_learning_rate(self)
        return rate if self._hvdc_rate_factor is None else rate * self._hvdc_rate_factor

    def _hvdc_take_anchors(self):
        for name, v in self._hvdc_named:
            self._hvdc_anchors[name].assign(v)

    def _hvdc_average(self):
        """One averaging round: the parameters by one grouped allreduce (or the codec), the
        floating-point buffers by another; returns the bytes handed."""
        meter = Meter()
        handed = tf.constant(0, tf.int64)
        if self._hvdc_pipeline is None:
            parameters = [v for _, v in self._hvdc_named]
            self._hvdc_assign(
                parameters,
                hvd.grouped_allreduce(
                    [meter.hand(tf.convert_to_tensor(v)) for v in parameters],
                    op=hvd.Average,
                    name="hvdc.local_sgd.parameters",
                ),
            )
        else:
            handed += self._hvdc_exchange_moves()
        if self._hvdc_buffers:
            self._hvdc_assign(
                self._hvdc_buffers,
                hvd.grouped_allreduce(
                    [meter.hand(tf.convert_to_tensor(b)) for b in self._hvdc_buffers],
                    op=hvd.Average,
                    name="hvdc.local_sgd.buffers",
                ),
            )
        self._hvdc_syncs.assign_add(1)
        return handed + meter.take()

    @staticmethod
    def _hvdc_assign(variables, values):
        # Horovod's shape function may leave the reduced shapes unknown inside tf.function.
        for variable, value in zip(variables, values):
            variable.assign(tf.reshape(value, variable.shape))

    def _hvdc_exchange_moves(self):
        """Averages the moves x_i - anchor through the codec, with error feedback (what a
        round does not carry is added to the next round's move; it is in parameter units, so
        learning-rate changes need no rescaling). Every rank adds the same average to the
        same anchor, so all end bitwise equal. Returns the bytes handed."""
        pipeline, anchors = self._hvdc_pipeline, self._hvdc_anchors
        moves = pipeline.reduce(
            [tf.convert_to_tensor(v) - anchors[name] for name, v in self._hvdc_named]
        )
        for (name, v), move in zip(self._hvdc_named, moves):
            v.assign(anchors[name].assign_add(move))
        return pipeline.last_step_bytes.read_value()

    @property
    def compression_variables(self):
        """The state of the local steps and rounds (``tf.Variable``\\ s), to broadcast with
        the model's."""
        state = [
            self._hvdc_steps,
            self._hvdc_syncs,
            self._hvdc_last_step_bytes,
            self._hvdc_average_grad_norm,
            *self._hvdc_anchors.values(),
        ]
        if self._hvdc_pipeline is not None:
            state += list(self._hvdc_pipeline.variables)
        return state

    def compression_stats(self):
        """What the last step handed to Horovod, and how each tensor travels at a round."""
        pipeline = self._hvdc_pipeline
        if pipeline is None:
            tensors = [
                (
                    name,
                    tf.TensorShape(v.shape).num_elements(),
                    "grouped allreduce",
                    "parameters averaged whole",
                )
                for name, v in self._hvdc_named
            ]
        else:
            tensors = [
                (plan.name, plan.numel, plan.exchange, plan.reason) for plan in pipeline.plans
            ]
        return {
            "codec": repr(self._hvdc_codec),
            "step": self.local_steps,
            "syncs": self.syncs,
            "bytes_handed": self.last_step_bytes,
            # What synchronous SGD's plain allreduce of every gradient hands each step.
            "bytes_uncompressed": sum(
                tf.TensorShape(v.shape).num_elements() * tf.as_dtype(v.dtype).size
                for _, v in self._hvdc_named
            ),
            "tensors": tensors,
        }


def LocalClipSGD(
    optimizer: keras.optimizers.SGD,
    model: keras.Model,
    *,
    clip: float,
    sync_every: int = 8,
    clipping: str = "local",
    average_buffers: bool = True,
    compression: Compression = "none",
    seed: int = 0,
) -> keras.optimizers.SGD:
    """Wraps a ``keras.optimizers.SGD`` so that every Horovod rank trains locally with
    clipped steps and the ranks average their models every ``sync_every`` steps (CELGC).

    Use it where ``DistributedOptimizer`` would go; it exchanges no gradients::

        optimizer = htf.LocalClipSGD(keras.optimizers.SGD(0.5), model, clip=0.05,
                                     sync_every=8)
        model.compile(optimizer=optimizer, loss=...)
        model.fit(..., callbacks=[BroadcastGlobalVariablesCallback(0)])

    The result is an instance of a subclass of the optimizer's class (so ``isinstance``,
    ``get_config`` and learning-rate schedules behave as before) that shares the given
    optimizer's state. Every rank must start from the same variables (broadcast them with
    ``BroadcastGlobalVariablesCallback``, which also sends this wrapper's state) and take
    the same number of steps. ``tf.train.Checkpoint(optimizer=...)`` saves the step counter
    (which positions the rounds) and, with a codec, the parameters of the last round and the
    error-feedback residuals; restore it on every rank.

    Momentum buffers stay local, never averaged (as in the authors' code). Momentum and
    Keras's decoupled weight decay are allowed; the clipped rate is the learning rate Keras
    applies to both. The paper analyses plain SGD.

    Args:
        optimizer: the ``keras.optimizers.SGD`` to wrap (its learning rate is eta).
        model: the ``keras.Model`` trained; its floating-point non-trainable variables
            (BatchNormalization's moving statistics) are averaged with the parameters.
        clip (float): gamma > 0, the largest distance one local step moves the weights at
            the learning rate the optimizer has when wrapped (eta_0). Steps whose gradient norm
            exceeds gamma / eta_0 are clipped; a schedule that sets the rate to eta_t sets
            gamma_t = gamma eta_t / eta_0, keeping gamma / eta fixed as the paper's theory
            (gamma / eta = 5 (sigma + kappa)) and the authors' decay milestones do. The paper
            uses gamma = 1.0 with eta = 0.3 (ResNet-56) and gamma = 7.5 with eta = 30
            (AWD-LSTM).
        sync_every (int): I >= 1, local steps between two averaging rounds (the authors'
            ``communication_interval``, 8 by default; the paper runs 2 to 32). I = 1 with
            ``"local"`` clipping is not synchronous SGD: each worker clips its own gradient.
        clipping (str): which gradient norm ||g|| sets the step min(eta_t, gamma_t / ||g||),
            as the authors' ``clipping_option``:

            - ``"local"`` (the paper's algorithm): the worker's own gradient norm
              ||g_i||; no communication besides the rounds.
            - ``"global_average"``: ||g_bar||, the norm of the average of all workers'
              gradients at the first step after each round (one more allreduce of the
              gradients per round, which doubles the traffic), kept for the I steps of
              that period.
            - ``"max"``: max(||g_i||, ||g_bar||), with the same ||g_bar||.
        average_buffers (bool): average the model's floating-point non-trainable variables
            (BatchNormalization's moving statistics) at every round, by one more allreduce.
            False keeps them per worker, as the authors' code does. Integer ones (seed
            generator states) are never averaged.
        compression: a codec instance or registry name for the rounds. ``"none"`` averages
            the parameters whole with one grouped allreduce. Any other codec compresses each
            worker's move since the last round, with error feedback, through the same
            exchanges as ``DistributedOptimizer`` (tensors under the codec's ``min_size``,
            and the classifier if the codec leaves it out, travel whole).
        seed (int): base seed of the random streams of stochastic codecs.
    """
    owner = "LocalClipSGD"
    if not isinstance(optimizer, keras.optimizers.SGD):
        raise TypeError(
            f"{owner}: optimizer must be a keras.optimizers.SGD (CELGC clips SGD "
            f"steps), got {type(optimizer).__name__}"
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{owner}: model must be the keras.Model whose variables the "
            f"optimizer trains, got {type(model).__name__}"
        )
    if optimizer.gradient_accumulation_steps:
        raise ValueError(
            f"{owner}: the optimizer's gradient_accumulation_steps is not "
            f"supported; every apply() is a local step"
        )
    clip = check_float(owner, "clip", clip)
    if clip <= 0:
        raise ValueError(f"{owner}: clip (gamma) must be > 0, got {clip!r}")
    sync_every = check_int(owner, "sync_every", sync_every, low=1)
    check_choice(owner, "clipping", clipping, CLIPPINGS)
    check_bool(owner, "average_buffers", average_buffers)
    codec = resolve(compression, CODECS)
    seed = check_int(owner, "seed", seed, low=0)
    rate = float(optimizer.learning_rate)
    if not rate > 0:
        raise ValueError(
            f"{owner}: the learning rate must be > 0 (the clip threshold is "
            f"gamma / eta_0), got {rate!r}"
        )

    leave_auto_xla_off()
    wrapped = wrap_in_subclass(optimizer, _LocalClipSGD)
    # Outside Keras's attribute tracking: the model is not the optimizer's to save.
    wrapped.__dict__.update(
        _hvdc_base=optimizer.__class__,
        _hvdc_model=model,
        _hvdc_codec=codec,
        _hvdc_seed=seed,
        _hvdc_sync_every=sync_every,
        _hvdc_clipping=clipping,
        _hvdc_average_buffers=average_buffers,
        _hvdc_max_grad_norm=clip / rate,
        _hvdc_rate_factor=None,
    )
    if optimizer.built:
        wrapped._hvdc_attach(optimizer._trainable_variables)
    return wrapped
