"""Compressed Adam: 1-bit Adam's optimizer mode (Tang et al., ICML 2021, Algorithm 1) of
``DistributedOptimizer`` over ``torch.optim.Adam`` and ``torch.optim.AdamW``.

Compressing Adam's gradients disturbs its second moment v, which then scales every
coordinate's step by the wrong amount; error-feedback codecs, whose messages are far from
the gradient at any one step, suffer most. 1-bit Adam therefore compresses the momentum
instead, once v has settled and can be frozen. With T_w warm-up steps, at step t (from 1):

    t <= T_w:  the base optimizer's step, on the gradient averaged by an fp32 allreduce
               (nothing goes through the codec)
    t > T_w:   d = sqrt(v_{T_w} / (1 - beta2^T_w)) + eps, frozen
               before the exchange:  u_i = clip((beta1 m + (1 - beta1) g_i) / d, +-c)
                                     (g_i + lambda x for Adam's coupled weight decay)
               exchange: u_i through the codec, with its error feedback (two-way codecs:
                         worker and server residuals), decoded into the average u; m = u d
               step:     x *= 1 - eta lambda   (AdamW's decoupled weight decay)
                         x -= eta / (1 - beta1^t) u

The codec carries the momentum divided by the frozen denominator, the step Adam takes, not
the momentum itself (1-bit Adam's choice): d is the same on every rank, so the average is
the same, but a codec's error is then spread over coordinates by the size of their steps.
A block of signs under one scale gives every coordinate its block's mean magnitude, which,
divided by a small d, made steps that diverged (``docs/algorithms.md``, compressed Adam).
The clip to c = max(1, (1 - beta1) / sqrt(1 - beta2)), the bound on Adam's own |m / sqrt(v)|
(Kingma and Ba, ICLR 2015, section 2.1), keeps a coordinate whose gradient grew after the
freeze (an embedding row of a token the warm-up never saw, a unit it found dead: v = 0, d =
eps) from taking a step that no Adam step would, and from swamping its block's scale.

Between ``synchronize()`` and ``step()`` a compressed step's ``.grad`` holds the averaged
momentum m, which ``step()`` takes as Adam's first moment: gradient clipping there bounds m.
m and v stay the base optimizer's ``exp_avg`` and ``exp_avg_sq`` (v frozen from T_w on), the
step counter and residuals the pipeline's: all in ``state_dict()``.
"""

import torch

from hvd_compress.validation import check_int


class CompressedAdam:
    def __init__(self, optimizer, pipeline, warmup_steps):
        self.optimizer = optimizer
        self.pipeline = pipeline
        self.warmup_steps = warmup_steps  # T_w
        # Group positions, not the group dicts: load_state_dict replaces the dicts, and the
        # learning rate must be read from the live ones that schedulers set.
        self.group_index = {
            p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        self.denominators = {}  # parameter -> d, made from the frozen v when first needed
        pipeline.uncompressed_steps = warmup_steps
        self.follow()

    @staticmethod
    def refusal(optimizer):
        """Why the mode cannot run with ``optimizer`` (as the end of "compressed_adam
        ..."), or None."""
        if not isinstance(optimizer, torch.optim.Adam):
            return f"needs a torch.optim.Adam or AdamW, got {type(optimizer).__name__}"
        for group in optimizer.param_groups:
            for option in ("amsgrad", "maximize", "differentiable"):
                if group.get(option):
                    return f"does not support {option}=True"
        return None

    @staticmethod
    def check(optimizer, warmup_steps):
        """Returns T_w if ``optimizer`` and ``warmup_steps`` suit the mode; raises otherwise."""
        refusal = CompressedAdam.refusal(optimizer)
        if refusal is not None:
            error = TypeError if not isinstance(optimizer, torch.optim.Adam) else ValueError
            raise error(f"DistributedOptimizer: compressed_adam {refusal}")
        # Adam's variance is frozen after the warm-up: it must have seen gradients.
        return check_int("DistributedOptimizer", "compressed_adam", warmup_steps, low=1)

    @property
    def compressing(self) -> bool:
        """Whether the next exchange (or the one in flight) sends the momentum through the
        codec: the pipeline counts the exchanges done, T_w of them uncompressed."""
        return self.pipeline.state.step >= self.warmup_steps

    @property
    def exchanged_momentum(self) -> bool:
        """Whether the exchange just finished (by ``synchronize``) sent the momentum."""
        return self.pipeline.state.step > self.warmup_steps

    def follow(self):
        """Routes every compressed tensor for the next step: by an fp32 allreduce during
        the warm-up, by the codec after (``CompressionPipeline.follow_paths``)."""
        self.pipeline.follow_paths()

    def reload(self):
        """Follows a loaded state, whose step and frozen v may be others."""
        self.denominators.clear()
        self.follow()

    def _group(self, param):
        return self.optimizer.param_groups[self.group_index[param]]

    def _decoupled(self, group):
        """Whether ``group``'s weight decay is AdamW's (torch < 2.7 has no such key)."""
        return group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))

    def _first_moment(self, param):
        state = self.optimizer.state[param]
        if "exp_avg" not in state:  # a parameter without a gradient during the warm-up
            state["step"] = torch.tensor(float(self.warmup_steps))
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["exp_avg"]

    def _denominator(self, param):
        """d = sqrt(v_hat) + eps of the frozen variance."""
        d = self.denominators.get(param)
        if d is None:
            group = self._group(param)
            correction = (1 - group["betas"][1] ** self.warmup_steps) ** 0.5
            self._first_moment(param)
            v = self.optimizer.state[param]["exp_avg_sq"]
            d = self.denominators[param] = (v.sqrt() / correction).add_(group["eps"])
        return d

    def before_exchange(self, param):
        """After the warm-up, turns ``param.grad`` into this worker's u_i."""
        if not self.compressing:
            return
        group = self._group(param)
        grad = param.grad
        if group["weight_decay"] and not self._decoupled(group):
            grad.add_(param.detach(), alpha=group["weight_decay"])
        beta1, beta2 = group["betas"]
        bound = max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)  # c
        grad.lerp_(self._first_moment(param), beta1)  # beta1 m + (1 - beta1) g
        grad.div_(self._denominator(param)).clamp_(-bound, bound)

    def after_exchange(self):
        """After a compressed exchange, turns each averaged u in ``.grad`` into m = u d."""
        if not self.exchanged_momentum:
            return
        for param in self.group_index:
            if param.grad is not None:
                param.grad.mul_(self._denominator(param))

    @torch.no_grad()
    def step(self):
        """The compressed stage's Adam step with the frozen variance, from the averaged
        momentum in ``.grad``."""
        t = self.pipeline.state.step  # this step's exchange is counted
        for group in self.optimizer.param_groups:
            eta, decay = group["lr"], group["weight_decay"]
            step_size = eta / (1 - group["betas"][0] ** t)
            for param in group["params"]:
                if param.grad is None:
                    continue
                self._first_moment(param).copy_(param.grad)
                self.optimizer.state[param]["step"] += 1
                if decay and self._decoupled(group):
                    param.mul_(1 - eta * decay)
                param.addcdiv_(param.grad, self._denominator(param), value=-step_size)
