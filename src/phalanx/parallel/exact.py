"""Reproducible mode: gradients that are bit-for-bit the same for any number of workers.

Three things make a data-parallel gradient depend on the world size, and each is removed here:

* **Kernel batch size.** A global batch is cut into fixed *virtual micro-batches* of
  ``micro_batch_size`` samples, numbered in order; each worker runs forward and backward on its
  contiguous range of them, one micro-batch at a time. The cut depends on the batch alone.
* **Summation order.** Gradients are summed in fixed point (integers, held exactly in float64)
  with a power-of-two scale per tensor that every rank agrees on
  (:mod:`phalanx.parallel.fixed_point`), locally and by an allreduce that overlaps the last
  micro-batch's backward. Adding integers is exact, so the sum has the same bits however the
  micro-batches are spread over workers. A step whose scales turn out wrong (the first, and
  rarely another) is redone, identically everywhere.
* **Randomness and batch norm.** The random generator is seeded from ``(seed, step, index)``
  before each micro-batch, so dropout does not depend on which worker runs it. Batch norm
  normalises by each micro-batch's statistics; the running statistics are recorded per
  micro-batch and folded in index order on every rank (:mod:`phalanx.parallel.running_stats`).

The thread count changes how CPU kernels block their sums, so each step runs with ``threads``
threads and deterministic kernels; the process's own settings are restored after the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.deterministic
from torch import nn

from phalanx.comm import runtime
from phalanx.global_batch import mix_seed, share_bounds
from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.parallel.buckets import DEFAULT_FUSION_THRESHOLD_MB
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.fixed_point import FixedPointSum
from phalanx.parallel.reducer import GradientReducer, Phase
from phalanx.parallel.running_stats import RunningStatsFolding

#: A step is recomputed at most this often; only a model that is not deterministic needs more.
MAX_PASSES_PER_STEP = 3


class MicroBatch:
    """One virtual micro-batch on this worker: its global index and its rows in the local batch."""

    def __init__(self, index: int, start: int, stop: int):
        self.index, self.start, self.stop = index, start, stop

    @property
    def size(self) -> int:
        return self.stop - self.start


def local_micro_batches(global_batch: int, local_batch: int, micro_batch_size: int, world_size: int,
                        rank: int) -> list[MicroBatch]:
    """The micro-batches of this rank's share, in global index order."""
    start, _ = share_bounds(global_batch, world_size, rank, micro_batch_size)
    first = start // micro_batch_size
    return [MicroBatch(first + k, offset, min(offset + micro_batch_size, local_batch))
            for k, offset in enumerate(range(0, local_batch, micro_batch_size))]


class ExactGradients:
    """Computes the global-batch gradient of a model exactly, independent of the world size.

    Use it in place of ``loss.backward()``: ``exact.backward(loss_fn, inputs, targets,
    global_batch_size)`` leaves in ``.grad`` the mean gradient over the global batch, with the
    same bits on 1, 2, 3 or N workers. ``loss_fn`` must return the mean loss of its samples.
    ``state_dict()`` carries the step counter and the fixed-point exponents; checkpoint it to resume
    bitwise. Given a ``px.DataParallel``, it switches that model's reducer to the exact sum for good
    (one set of hooks and buckets): from then on gradients are summed over ranks only inside
    :meth:`backward`, and a plain ``loss.backward()`` on the model leaves local gradients.
    ``redone_steps`` counts recomputed passes (the first step's calibration included).
    """

    def __init__(self, model: nn.Module, micro_batch_size: int, seed: int = 0, threads: int | None = 1,
                 fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD_MB):
        if micro_batch_size < 1:
            raise ConfigurationError(f"micro_batch_size must be at least 1, got {micro_batch_size}.")
        self.threads = threads
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.step = 0
        self.redone_steps = 0
        self._calibrated = False
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigurationError("ExactGradients needs a model with at least one parameter that requires grad.")
        self._sum = FixedPointSum()
        self._own_reducer: GradientReducer | None = None
        if isinstance(model, DataParallel):  # its reducer, hooks and all, sums exactly from now on
            model.rebuild_reducer(summation=self._sum, threshold_mb=fusion_threshold_mb, follows_forward=False)
            model.check_batchnorm_batch = False  # per-micro-batch statistics are the design here
        else:
            self._own_reducer = GradientReducer([p for _, p in named], [name for name, _ in named],
                                                fusion_threshold_mb, self._sum, follows_forward=False)
        self._running_stats = RunningStatsFolding(model)

    @property
    def _reducer(self) -> GradientReducer:
        """The engine summing into the fixed-point sum: the model's current one (elastic recovery
        rebuilds it), or this object's own around a plain module."""
        if self._own_reducer is not None:
            return self._own_reducer
        assert isinstance(self.model, DataParallel) and self.model.reducer is not None
        return self.model.reducer

    def backward(self, loss_fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                 global_batch_size: int) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """Run every local micro-batch and leave the exact global mean gradient in ``.grad``.

        Returns ``(outputs, targets, loss)`` of each local micro-batch, detached, for metrics.
        """
        with _deterministic_kernels(self.threads):
            return self._backward(loss_fn, inputs, targets, global_batch_size)

    def _backward(self, loss_fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                  global_batch_size: int) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        micro = local_micro_batches(global_batch_size, len(targets), self.micro_batch_size,
                                    runtime.size(), runtime.rank())
        total_micro = -(-global_batch_size // self.micro_batch_size)
        for _ in range(MAX_PASSES_PER_STEP):
            results = self._run_pass(loss_fn, inputs, targets, micro, total_micro)
            if self._sum.finish_pass():
                break
            self._sum.recalibrate()
            self.redone_steps += 1
            self._calibrated = True
        else:
            raise PhalanxError(
                f"rank {runtime.rank()}: reproducible mode recomputed step {self.step} {MAX_PASSES_PER_STEP} times "
                "and the gradients changed each time, so the model is not deterministic. Make sure every random "
                "draw in forward uses torch's global generator (phalanx seeds it per micro-batch)."
            )
        self._sum.publish(global_batch_size)
        self._running_stats.fold()
        self.step += 1
        return results

    def _run_pass(self, loss_fn: Callable, inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                  micro: list[MicroBatch], total_micro: int) -> list:
        """Forward and backward over this rank's micro-batches, summing into the reducer."""
        self._reducer.forget_interrupted_backward()
        table = self._sum.begin_pass(total_micro, calibrate=not self._calibrated,
                                         payload_numel=self._running_stats.table_numel(total_micro))
        self._running_stats.begin_pass(table)
        try:
            results = [self._run_one(loss_fn, inputs, targets, part, last=k == len(micro) - 1)
                       for k, part in enumerate(micro)]
        finally:
            self._running_stats.end_recording()
        if not micro:  # this rank still takes part in the pass's allreduce
            self._sum.begin_micro_batch(0)
            self._reducer.expect_backward(0, Phase.REDUCE)
            self._reducer.reduce_without_data()
        return results

    def _run_one(self, loss_fn: Callable, inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                 part: MicroBatch, last: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        torch.manual_seed(mix_seed(self.seed, self.step, part.index))
        self._sum.begin_micro_batch(part.size)
        self._reducer.expect_backward(part.size, Phase.REDUCE if last else Phase.GATHER)
        self._running_stats.begin_micro_batch(part.index)
        rows = slice(part.start, part.stop)
        outputs = self.model(*(x[rows] for x in inputs))
        loss = loss_fn(outputs, targets[rows])
        loss.backward()  # the reducer's hooks quantise; the end of backward completes (and sends) buckets
        if self._reducer.awaiting_backward:  # no gradient reached a hook: no end of backward was hooked into
            self._reducer.reduce_without_data()
        return _detach(outputs), targets[rows], loss.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "exponents": self._sum.exponents.clone(), "calibrated": self._calibrated,
                "micro_batch_size": self.micro_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["micro_batch_size"] != self.micro_batch_size:
            raise ConfigurationError(
                f"this run uses micro_batch_size={self.micro_batch_size}, the checkpoint {state['micro_batch_size']}; "
                "bitwise reproducibility needs the same micro-batch size."
            )
        self.step, self.seed, self._calibrated = int(state["step"]), int(state["seed"]), bool(state["calibrated"])
        self._sum.set_exponents(state["exponents"])


@contextlib.contextmanager
def _deterministic_kernels(threads: int | None) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for one step; the process's settings come back after.

    The thread count changes how CPU kernels block their sums, so forward and backward run with
    ``threads`` threads; nothing outside the step (the user's own code, other models) is affected.
    Deterministic mode's filling of every new tensor with NaN (a debugging aid, one more write of
    every activation: a kernel launch each on a GPU) is turned off: no result here reads memory it
    did not write.
    """
    previous_threads = torch.get_num_threads()
    previous_mode = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    if threads is not None and threads != previous_threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill  # type: ignore[attr-defined]
        torch.use_deterministic_algorithms(previous_mode[0], warn_only=previous_mode[1])
        if torch.get_num_threads() != previous_threads:
            torch.set_num_threads(previous_threads)


def _detach(outputs: Any) -> Any:
    return outputs.detach() if isinstance(outputs, torch.Tensor) else outputs
