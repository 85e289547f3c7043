"""``DistributedGradientTape``: a drop-in for ``horovod.tensorflow.DistributedGradientTape``
that compresses gradients with any codec of ``hvd_compress``."""

from __future__ import annotations

from typing import Any, Iterable

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import agreement
from hvd_compress.adaptive import Adaptive
from hvd_compress.registry import Compression
from hvd_compress.validation import check_horovod_defaults

from . import CODECS
from .pipeline import check_options, make_pipeline, variable_name

# The compression state of every set of differentiated variables, by the tape's settings:
# a training loop makes a new tape every step, and the step counter (which positions the
# random streams) and the error-feedback residuals must carry over.
_PIPELINES = {}


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns the gradients compressed,
    exchanged across all Horovod ranks and averaged.

    The signature follows ``horovod.tensorflow.DistributedGradientTape``; it works eagerly
    and inside ``tf.function``, and also runs the exchange with a single process. Every
    other attribute is the wrapped tape's.

    The compression state (the step counter that positions the random streams, and the
    error-feedback residuals) is a ``CompressionPipeline``, made at the first ``gradient()``
    call and shared by every tape with the same settings over the same variables, so a new
    tape per step continues it. ``tape.pipeline`` is that module: checkpoint it with the model
    (``tf.train.Checkpoint(model=model, compression=tape.pipeline)``).

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        compression: a codec instance (``hvd_compress.tf.TernGrad(clip=2.5)``) or a registry
            name (``"none"``, ``"fp16"``, ``"terngrad"``, ...).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: as in Horovod, for the uncompressed allreduces.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients so they can be compressed;
            otherwise they go through Horovod's sparse allreduce.
        process_set: the Horovod process set whose ranks average together; every
            collective, shared scale, shard and agreement check stays inside it. Ranks
            outside it keep their own gradients, as with Horovod's wrappers.
        exchange: ``"auto"`` (the cheapest by ``hvd_compress.cost`` for each tensor),
            ``"allreduce"``, ``"allgather"`` or ``"sharded"``; or ``"two-level"``: each
            node's ranks sum their gradients uncompressed (a reduce-scatter; for CPU
            tensors an allreduce), rank l of every node exchanges the codes of shard l
            with rank l of the others, and the node gathers the decoded shards
            (``hvd_compress.topology``; Horovod must be initialised with
            ``hvd.init(process_sets="dynamic")``).
        seed: base seed of the random streams of stochastic codecs.
        uncompressed: variable names (Keras paths) always sent whole, in addition to those
            the codec leaves out (smaller than ``min_size``; the classifier unless
            ``compress_classifier``).
        error_feedback: keep, per compressed tensor, what its messages did not carry and add
            it to the next gradient. None: the codec's default (on for ``ef-sign``).
        adaptive: the PyTorch port's per-tensor choice of codec, fp16 or fp32; refused
            here (``docs/adaptive.md``). Default False.
        device_dense, device_sparse, num_groups, groups, scale_local_gradients: Horovod's,
            taken at their defaults only (``validation.HOROVOD_DEFAULTS`` says why).
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        compression: Compression = "none",
        op: int = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
        process_set: hvd.ProcessSet = hvd.global_process_set,
        *,
        exchange: str = "auto",
        seed: int = 0,
        uncompressed: Iterable[str] = (),
        error_feedback: bool | None = None,
        adaptive: bool | Adaptive = False,
        device_dense: str = "",
        device_sparse: str = "",
        num_groups: int = 0,
        groups: Any = None,
        scale_local_gradients: bool = True,
    ) -> None:
        check_horovod_defaults(
            "DistributedGradientTape",
            device_dense=device_dense,
            device_sparse=device_sparse,
            num_groups=num_groups,
            groups=groups,
            scale_local_gradients=scale_local_gradients,
        )
        self._tape = gradtape
        self._sparse_as_dense = sparse_as_dense
        self._codec, self._options = check_options(
            "DistributedGradientTape",
            compression,
            CODECS,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            process_set=process_set,
            exchange=exchange,
            seed=seed,
            error_feedback=error_feedback,
            adaptive=adaptive,
        )
        self._uncompressed = frozenset(uncompressed)
        self.pipeline = None

    # Called in a user's tf.function, autograph would convert the library's code, which
    # needs no conversion (its tensor-dependent control flow is in explicit tf.cond calls)
    # and whose conversion costs most of the time of tracing a step.
    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        variables = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        if self._sparse_as_dense:
            flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
        self.pipeline = self._pipeline(variables)
        reduced = self.pipeline.reduce(self.pipeline.clip_locally(flat))
        return tf.nest.pack_sequence_as(grads, reduced)

    def _pipeline(self, variables):
        key = (
            tuple(id(v) for v in variables),
            self._codec,
            self._uncompressed,
            tuple(sorted(self._options.items())),
        )
        entry = _PIPELINES.get(key)
        if entry is None:
            named = [(variable_name(v), v) for v in variables]
            pipeline = make_pipeline(
                "DistributedGradientTape",
                named,
                self._codec,
                self._uncompressed,
                self._options,
                agreement.modes(sparse_as_dense=self._sparse_as_dense),
            )
            # The variables are kept with their pipeline so that their ids are never reused.
            entry = _PIPELINES[key] = (variables, pipeline)
        return entry[1]

    def __getattr__(self, name):
        return getattr(self._tape, name)
