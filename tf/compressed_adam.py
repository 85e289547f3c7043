"""Compressed Adam: 1-bit Adam's optimizer mode (Tang et al., ICML 2021, Algorithm 1) of
the Keras ``DistributedOptimizer`` over ``keras.optimizers.Adam`` and ``AdamW``.

The PyTorch port's ``hvd_compress.pt.compressed_adam`` says why and how. With T_w warm-up
steps, at step t (from 1):

    t <= T_w:  the base optimizer's step, on the gradient averaged by an fp32 allreduce
    t > T_w:   d = sqrt(v_{T_w} / (1 - beta2^T_w)) + eps, frozen
               before the exchange:  u_i = clip((beta1 m + (1 - beta1) g_i) / d, +-c),
                                     c = max(1, (1 - beta1) / sqrt(1 - beta2))
               exchange: u_i through the codec, with its error feedback; m = u d
               step:     Keras's gradient clipping and decoupled weight decay on m, then
                         x -= eta / (1 - beta1^t) m / d

The compressed stage's step is the PyTorch port's (eps added to the bias-corrected root of
v), so both ports train alike; the warm-up's is Keras's own Adam. Keras applies its clipping
to m, as a PyTorch user's clipping between ``synchronize()`` and ``step()`` does. m and v
stay the optimizer's momentum and velocity variables (v frozen from T_w on), d an optimizer
variable made once at the freeze, the step counter and residuals the pipeline's:
``tf.train.Checkpoint(optimizer=...)`` saves them all.
The stage is a tensor condition on the pipeline's step, so a traced ``model.fit`` step
switches at T_w without retracing.
"""

import keras
import tensorflow as tf

from hvd_compress.validation import check_int


class CompressedAdam:
    def __init__(self, optimizer, pipeline, variables, warmup_steps):
        self.optimizer = optimizer
        self.pipeline = pipeline
        self.variables = list(variables)  # in the pipeline's order
        self.warmup_steps = warmup_steps  # T_w
        # d of each variable, made once from the frozen v at the first compressed exchange:
        # optimizer variables, so a checkpoint holds them with m and v.
        with tf.init_scope():
            self.denominators = {
                optimizer._var_key(v): optimizer.add_variable_from_reference(
                    v, name="frozen_denominator"
                )
                for v in self.variables
            }

    @staticmethod
    def refusal(optimizer):
        """Why the mode cannot run with ``optimizer`` (as the end of "compressed_adam
        ..."), or None."""
        if not isinstance(optimizer, keras.optimizers.Adam):
            return (
                f"needs a keras.optimizers.Adam or AdamW (Keras 3), got {type(optimizer).__name__}"
            )
        if optimizer.amsgrad:
            return "does not support amsgrad=True"
        return None

    @staticmethod
    def check(optimizer, warmup_steps):
        """Returns T_w if ``optimizer`` and ``warmup_steps`` suit the mode; raises otherwise."""
        refusal = CompressedAdam.refusal(optimizer)
        if refusal is not None:
            error = TypeError if not isinstance(optimizer, keras.optimizers.Adam) else ValueError
            raise error(f"DistributedOptimizer: compressed_adam {refusal}")
        # Adam's variance is frozen after the warm-up: it must have seen gradients.
        return check_int("DistributedOptimizer", "compressed_adam", warmup_steps, low=1)

    @property
    def compressing(self):
        """Whether the next exchange (or the one in flight) sends the momentum through the
        codec: the pipeline counts the exchanges done, T_w of them uncompressed."""
        return self.pipeline.state.step >= self.warmup_steps

    @property
    def exchanged_momentum(self):
        """Whether the exchange just finished sent the momentum."""
        return self.pipeline.state.step > self.warmup_steps

    def _moments(self, variable):
        index = self.optimizer._get_variable_index(variable)
        return self.optimizer._momentums[index], self.optimizer._velocities[index]

    def _denominator(self, variable):
        """d = sqrt(v_hat) + eps of the frozen variance."""
        return self.denominators[self.optimizer._var_key(variable)]

    def _freeze(self):
        """Makes every d from the variance the warm-up left."""
        correction = (1 - self.optimizer.beta_2**self.warmup_steps) ** 0.5
        for variable in self.variables:
            _, v = self._moments(variable)
            self._denominator(variable).assign(tf.sqrt(v) / correction + self.optimizer.epsilon)
        return tf.constant(True)

    def before_exchange(self, grads):
        """After the warm-up, each gradient (in the pipeline's order; None stays None)
        turned into this worker's u_i."""
        tf.cond(
            self.pipeline.state.step == self.warmup_steps, self._freeze, lambda: tf.constant(False)
        )
        beta1, beta2 = self.optimizer.beta_1, self.optimizer.beta_2
        bound = max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)  # c

        def normalised(grad, variable):
            m, _ = self._moments(variable)
            momentum = m * beta1 + grad * (1 - beta1)
            return tf.clip_by_value(momentum / self._denominator(variable), -bound, bound)

        return [
            None
            if grad is None
            else tf.cond(
                self.compressing,
                lambda grad=grad, variable=variable: normalised(grad, variable),
                lambda grad=grad: tf.convert_to_tensor(grad),
            )
            for grad, variable in zip(grads, self.variables)
        ]

    def after_exchange(self, grads):
        """After a compressed exchange, each averaged u turned into m = u d."""
        return [
            None
            if grad is None
            else tf.cond(
                self.exchanged_momentum,
                lambda grad=grad, variable=variable: grad * self._denominator(variable),
                lambda grad=grad: grad,
            )
            for grad, variable in zip(grads, self.variables)
        ]

    def update_step(self, base, gradient, variable, learning_rate):
        """Keras's per-variable update: the base Adam's during the warm-up, the frozen-
        variance step from the averaged m after it."""

        def frozen():
            m, _ = self._moments(variable)
            momentum = tf.cast(gradient, variable.dtype)
            t = tf.cast(self.pipeline.state.step, variable.dtype)  # this step's exchange is counted
            step_size = tf.cast(learning_rate, variable.dtype) / (1 - self.optimizer.beta_1**t)
            m.assign(momentum)
            variable.assign_sub(step_size * (momentum / self._denominator(variable)))
            return tf.constant(True)

        def adam():
            base.update_step(self.optimizer, gradient, variable, learning_rate)
            return tf.constant(True)

        tf.cond(self.exchanged_momentum, frozen, adam)
