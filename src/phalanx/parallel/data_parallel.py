"""``px.DataParallel``: one model replica per worker, gradients averaged during backward."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from phalanx import profile
from phalanx.comm import collectives, runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel import batchnorm, compiled, reductions, replicate
from phalanx.parallel.autotune import FusionTuner
from phalanx.parallel.buckets import DEFAULT_FUSION_THRESHOLD_MB
from phalanx.parallel.accumulation import Accumulation
from phalanx.parallel.reducer import GradientReducer, Phase, Summation
from phalanx.parallel.weighted import WeightedAverage


class DataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves the global average gradient in ``.grad``.

    Construction checks that every rank built the same model and broadcasts rank 0's parameters
    and buffers (in an elastic launch that waits for the elastic State's first sync, or else the
    first training forward, so that a worker lost meanwhile is survived). Gradients are fused
    into buckets of about ``fusion_threshold_mb`` (``0``: one allreduce per tensor,
    ``float("inf")``: one per step, ``"auto"``: measured during the first steps; the first bucket
    of a step closes at 1 MB already) and reduced while backpropagation continues. Ranks are weighted by the samples they saw, so uneven shares of a global batch
    still give the exact global-batch gradient.

    ``accumulate_steps=k`` reduces only on every ``k``-th backward (decided at forward time);
    ``no_sync()`` skips reduction inside it. ``reduction`` says how a bucket is summed over ranks:
    ``None`` (as it is), ``"fp16"``, ``"bf16"``, ``px.TopK(ratio)``, or your own
    :class:`px.Reduction <phalanx.parallel.reductions.Reduction>`; ``compression`` is its older
    name. ``algorithm`` is how buckets cross the network: ``"auto"`` (shared memory within a host;
    between hosts, or without shared memory, the algorithm the measured alpha-beta model predicts
    fastest for each bucket), ``"backend"``, ``"ring"``, ``"tree"`` or ``"halving_doubling"`` (see
    docs/transport.md). ``check_finite`` raises on every rank when an averaged gradient holds NaN
    or Inf. At world size 1 nothing is hooked and the wrapper costs nothing.
    """

    def __init__(self, module: nn.Module, fusion_threshold_mb: float | str = DEFAULT_FUSION_THRESHOLD_MB,
                 reduction: str | reductions.Reduction | None = None, accumulate_steps: int = 1,
                 sync_batchnorm: bool = False, check_finite: bool = False, broadcast: bool = True,
                 compression: str | reductions.Reduction | None = None, algorithm: str = "auto"):
        super().__init__()
        self.accumulation = Accumulation(accumulate_steps)
        self.module = batchnorm.SyncBatchNorm.convert(module) if sync_batchnorm else module
        self.tuner = FusionTuner() if fusion_threshold_mb == "auto" else None
        threshold = self.tuner.initial if self.tuner else _validate_threshold(fusion_threshold_mb)
        #: Warn once if the first local batch is too small for local batch-norm statistics.
        #: Reproducible mode turns it off: there, per-micro-batch statistics are the design.
        self.check_batchnorm_batch = True
        #: In an elastic launch the replicas are made equal inside the elastic protection (the
        #: first sync of a px.elastic.State, whose restore calls reshard, which checks the structure;
        #: or else the first training forward), so that a worker lost while the model is built is survived.
        self._replicate_pending = runtime.size() > 1 and broadcast
        if self._replicate_pending and not runtime.is_elastic():
            self._replicate()
        if reduction is not None and compression is not None:
            raise ConfigurationError("pass reduction= or its older name compression=, not both.")
        if algorithm not in collectives.ALLREDUCE_ALGORITHMS:
            raise ConfigurationError(f"algorithm must be one of {list(collectives.ALLREDUCE_ALGORITHMS)}, "
                                     f"got {algorithm!r}.")
        resolved = reductions.resolve(reduction if reduction is not None else compression)
        resolved.algorithm = algorithm
        self._reduction = profile.wrap(resolved)
        self._check_finite = check_finite
        self._graph_breaks: list[RemovableHandle] = []  # torch.compile's, where buckets begin
        self.reducer = self._make_reducer(threshold)
        #: Whether hooks of the model issue collectives inside its forward and backward (set by the
        #: strategy that adds them: px.Sharded's level 3 gathers each block there). A rank without
        #: samples, or with fewer than ``accumulate_steps``, then still runs every pass, on no rows.
        self.passes_without_data = False

    def _replicate(self) -> None:
        """Check that every rank built the same model, then give every replica rank 0's state."""
        replicate.check_same_structure(self.module)
        replicate.broadcast_state(self.module)
        self._replicate_pending = False

    def _make_reducer(self, threshold: float) -> GradientReducer | None:
        if runtime.size() == 1 and not self._check_finite:
            return None
        return self._build_reducer(WeightedAverage(self._reduction), threshold)

    def _build_reducer(self, summation: Summation, threshold_mb: float, previous: GradientReducer | None = None,
                       follows_forward: bool = True) -> GradientReducer:
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        reducer = GradientReducer([p for _, p in named], [name for name, _ in named], threshold_mb, summation,
                                  self._check_finite, on_step_end=self.tuner, previous=previous,
                                  follows_forward=follows_forward)
        for handle in self._graph_breaks:
            handle.remove()
        self._graph_breaks = compiled.break_at_buckets(self.module, [p for _, p in named], reducer.bucket_params)
        return reducer

    @property
    def accumulate_steps(self) -> int:
        """Backwards per optimizer step; only the last of them is reduced over ranks."""
        return self.accumulation.steps

    def rebuild_reducer(self, *, reduction: reductions.Reduction | None = None, summation: Summation | None = None,
                        threshold_mb: float | None = None, follows_forward: bool | None = None) -> GradientReducer:
        """Build the gradient engine afresh and return it: the one way to change how this model's
        gradients are reduced, or to follow a re-formed group.

        The new :class:`GradientReducer` replaces the current one, whose hooks are removed and whose
        step in flight is forgotten (reductions' state, such as TopK residuals, goes back to before
        that step and moves into the new buckets). It sums with ``summation`` (reproducible mode's
        fixed-point sum), or the weighted average of ``reduction`` (how the strategies plug in),
        else with what the current one used; in buckets of ``threshold_mb`` (default: the current
        size; given, it also ends an ``"auto"`` search). ``follows_forward=False`` hands the steps to a
        caller that drives them (reproducible mode): the model's forward then leaves the reducer
        alone. From then on the model has a reducer at any world size.
        """
        if reduction is not None and summation is not None:
            raise ConfigurationError("rebuild_reducer takes a reduction or a summation, not both.")
        old = self.reducer
        if reduction is not None:
            self._reduction = reduction
        if threshold_mb is None:
            threshold_mb = old.threshold_mb if old else self.tuner.initial if self.tuner else DEFAULT_FUSION_THRESHOLD_MB
        elif self.tuner is not None and self.tuner.chosen is None:
            self.tuner.chosen = threshold_mb
        if summation is None:
            summation = old.summation if old is not None and reduction is None else WeightedAverage(self._reduction)
        if follows_forward is None:
            follows_forward = old.follows_forward if old is not None else True
        if old is not None:
            old.close()
        self.accumulation.restart()
        self.reducer = self._build_reducer(summation, threshold_mb, previous=old, follows_forward=follows_forward)
        return self.reducer

    def reshard(self, rank: int, world_size: int) -> None:
        """After the group changed: a new reducer, with buckets laid out as every peer's.

        Called on every member of the new group, before the state synchronised with the group is
        loaded. In one exchange the members check that they built the same model and agree on the
        fusion threshold (which a worker that joined later has not chosen yet); then
        :meth:`rebuild_reducer` forgets the step in progress (a replica built as a world of one,
        a worker that joined later, gets its reducer here).
        """
        mine = self.reducer.threshold_mb if self.reducer is not None else None
        everyone = collectives.allgather_object((replicate.describe(self.module), mine))
        replicate.raise_if_different([structure for structure, _ in everyone])
        agreed = next((t for _, t in everyone if t is not None), None)
        self.rebuild_reducer(threshold_mb=agreed)
        self._replicate_pending = False  # the state synchronised with the group is loaded next

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(args, kwargs)
        return self.module(*args, **kwargs)

    @compiled.eager
    def _before_forward(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """The step's bookkeeping (and its collectives), run eagerly under ``torch.compile`` too."""
        if self._replicate_pending and self.training and torch.is_grad_enabled():
            self._replicate()
        local_samples = _batch_size(args, kwargs)
        if self.check_batchnorm_batch:
            self.check_batchnorm_batch = False
            batchnorm.warn_if_small_local_batch(self.module, local_samples)
        if self.reducer is not None and self.reducer.follows_forward and self.training and torch.is_grad_enabled():
            self.reducer.expect_backward(local_samples, self._next_phase())
        profile.mark("forward" if self.training else "eval_forward", samples=local_samples)

    def _next_phase(self) -> Phase:
        return Phase.REDUCE if self.accumulation.next_backward() else Phase.IDLE

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Within this block, backward accumulates local gradients without communicating."""
        return self.accumulation.no_sync()

    def reduce_without_data(self) -> None:
        """Join this step's reduction from a rank that has no samples for it.

        The rank contributes zero gradient and zero samples, and afterwards holds the same
        averaged ``.grad`` as every other rank, so its optimizer step keeps the replicas equal.
        """
        if self.reducer is None or not self.reducer.follows_forward:
            return
        self.reducer.expect_backward(0, self._next_phase())
        self.reducer.reduce_without_data()

    @property
    def fusion_threshold_mb(self) -> float:
        """The threshold in use (after ``"auto"`` has chosen, the chosen one)."""
        return self.reducer.threshold_mb if self.reducer else math.inf

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, without a wrapper prefix."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _validate_threshold(threshold: Any) -> float:
    if isinstance(threshold, (int, float)) and threshold >= 0:
        return float(threshold)
    raise ConfigurationError(
        f"fusion_threshold_mb must be a number of megabytes >= 0, float('inf') or 'auto', got {threshold!r}."
    )


def _batch_size(args: tuple, kwargs: dict) -> int:
    """Samples in this forward: dim 0 of the first tensor argument (1 if there is none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return int(value[0].shape[0]) if value[0].dim() else 1
    return 1
