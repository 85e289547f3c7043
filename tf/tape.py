"""``DistributedGradientTape``: a drop-in for ``horovod.tensorflow.DistributedGradientTape``
that compresses gradients with any codec of ``hvd_compress``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_compress import agreement
from hvd_compress.adaptive import Adaptive
from hvd_compress.registry import Compression
from hvd_compress.validation import check_horovod_defaults

from .codecs import CODECS
from .local_variables import LocalVariables
from .pipeline import check_options, make_pipeline, variable_name

# The compression state of every set of differentiated sources, by the tape's settings: a
# training loop makes a new tape every step, and the step counter (which positions the
# random streams) and the error-feedback residuals must carry over.
_PIPELINES: dict[tuple, tuple[list, Any]] = {}


def pipelines_over(variables: Iterable[Any]) -> list:
    """The ``CompressionPipeline`` of every tape that has differentiated any of
    ``variables`` (the objects given to ``gradient`` as sources), in the order they were
    made."""
    ids = {id(v) for v in variables}
    return [
        pipeline
        for sources, pipeline in _PIPELINES.values()
        if any(id(source) in ids for source in sources)
    ]


def _source_key(index, source):
    """What identifies a source across steps: a variable itself; a watched tensor, new at
    every step, by its place among the sources, shape and dtype."""
    if isinstance(source, tf.Tensor):
        return ("tensor", index, tuple(source.shape.as_list()), source.dtype.name)
    return id(source)


def _source_name(owner, index, source):
    """A variable's name (``variable_name``); ``"source_<index>"`` for a watched tensor,
    which has no name in eager mode."""
    if not isinstance(source, tf.Tensor):
        return variable_name(source)
    if not source.shape.is_fully_defined():
        raise ValueError(
            f"{owner}: source {index} is a tensor of shape {source.shape}; the exchange plans "
            f"each tensor by its full static shape (give the tf.function an input_signature "
            f"with fixed shapes, or differentiate with respect to a tf.Variable)"
        )
    return f"source_{index}"


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns the gradients compressed,
    exchanged across all Horovod ranks and averaged.

    The signature follows ``horovod.tensorflow.DistributedGradientTape``; it works eagerly
    and inside ``tf.function``, and also runs the exchange with a single process. The
    sources may be variables or tensors the tape watches (named ``"source_<index>"`` by
    their place among the sources). Every other attribute is the wrapped tape's.

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
        adaptive: ``True`` or an ``hvd_compress.Adaptive``: every tensor the codec
            compresses goes by the codec, an fp16 allreduce or a plain allreduce, whichever
            a model of the step predicts fastest from the link and codec times measured on
            this job (``hvd_compress.adaptive``; how a traced step is measured:
            ``docs/adaptive.md``); decided after a warm-up, again every ``Adaptive.every``
            steps, the same on every rank, without tracing the step again. A tensor that
            leaves the codec sends its error-feedback residuals with its next allreduce.
            Dense codecs only. Default False: every compressible tensor by the codec.
        scale_local_gradients: as in Horovod, divide the gradients of the sources
            registered with ``register_local_source`` by the process set's size (default
            True).
        device_dense, device_sparse, num_groups, groups: Horovod's, taken at their defaults
            only (``validation.HOROVOD_DEFAULTS`` says why).

    The tape has no ``worker_momentum`` or ``compressed_adam``: both change the optimizer's
    own step (its momentum is switched off where the worker applied it; Adam's variance is
    frozen), and the tape never sees the optimizer. In a custom loop, differentiate with a
    plain ``tf.GradientTape`` and apply with the Keras ``DistributedOptimizer``, which has
    both.
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
        )
        self._tape = gradtape
        self._local = LocalVariables("DistributedGradientTape", scale_local_gradients)
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

    def register_local_source(self, source: tf.Variable | tf.Tensor) -> None:
        """As Horovod's: ``source``'s gradient is not exchanged; ``gradient`` returns this
        rank's own (divided by the process set's size if ``scale_local_gradients``). Every
        rank registers the same sources before their first ``gradient``."""
        self._local.register(source)

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
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads)
        if self._sparse_as_dense:
            flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
        shared = [i for i, source in enumerate(flat_sources) if source not in self._local]
        self.pipeline = None
        if shared:
            self.pipeline = self._pipeline([(i, flat_sources[i]) for i in shared])
            reduced = self.pipeline.reduce(self.pipeline.clip_locally([flat[i] for i in shared]))
            for i, g in zip(shared, reduced):
                flat[i] = g
        if self._local:
            world_size = self._options["process_set"].size()
            flat = [
                self._local.gradient(g, world_size) if source in self._local else g
                for source, g in zip(flat_sources, flat)
            ]
        return tf.nest.pack_sequence_as(grads, flat)

    def _pipeline(self, indexed_sources):
        key = (
            tuple(_source_key(i, source) for i, source in indexed_sources),
            self._codec,
            self._uncompressed,
            tuple(sorted(self._options.items())),
        )
        entry = _PIPELINES.get(key)
        if entry is None:
            owner = "DistributedGradientTape"
            named = [(_source_name(owner, i, source), source) for i, source in indexed_sources]
            pipeline = make_pipeline(
                owner,
                named,
                self._codec,
                self._uncompressed,
                self._options,
                agreement.modes(sparse_as_dense=self._sparse_as_dense),
            )
            # The variables are kept with their pipeline so that their ids are never reused;
            # watched tensors are not, being keyed by place.
            variables = [s for _, s in indexed_sources if not isinstance(s, tf.Tensor)]
            entry = _PIPELINES[key] = (variables, pipeline)
        return entry[1]

    def __getattr__(self, name):
        return getattr(self._tape, name)
