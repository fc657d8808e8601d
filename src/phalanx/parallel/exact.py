"""Reproducible mode: gradients that are bit-for-bit the same for any number of workers.

Three things make a data-parallel gradient depend on the world size, and each is removed here:

* **Kernel batch size.** A global batch is cut into fixed *virtual micro-batches* of
  ``micro_batch_size`` samples, numbered in order; each worker runs forward and backward on its
  contiguous range of them, one micro-batch at a time. The cut depends on the batch alone.
* **Summation order.** Each micro-batch's gradient is converted to fixed point (int64) with a
  per-tensor power-of-two scale that every rank agrees on, and integers are summed, locally and
  by allreduce. Integer addition is exact and associative, so the sum has the same bits however
  the micro-batches are spread over workers. The scale comes from the previous step's global
  maximum; when this step's maximum shows the scale would overflow or waste more than
  ``PRECISION_SLACK_BITS`` bits, the step is redone with the right scale (the decision is made
  from a global MAX, so it is the same everywhere; the first step always runs twice).
* **Randomness and batch norm.** The random generator is seeded from ``(seed, step, index)``
  before each micro-batch, so dropout does not depend on which worker runs it. Batch norm
  normalises by each micro-batch's statistics; the running statistics are gathered per
  micro-batch and folded in index order on every rank.

The thread count changes how CPU kernels block their sums, so it is fixed (``threads``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx.comm import collectives, runtime
from phalanx.data.sharding import mix_seed, share_bounds
from phalanx.errors import ConfigurationError, NonFiniteGradientError

INT64_HEADROOM_BITS = 62  # |sum| stays below 2**62, well inside int64
PRECISION_SLACK_BITS = 8
MAX_SCALE_EXPONENT = 100


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
    ``state_dict()`` carries the step counter and scales; checkpoint it to resume bitwise.
    """

    def __init__(self, model: nn.Module, micro_batch_size: int, seed: int = 0, threads: int | None = 1):
        if micro_batch_size < 1:
            raise ConfigurationError(f"micro_batch_size must be at least 1, got {micro_batch_size}.")
        if threads is not None:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.step = 0
        self.redone_steps = 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._lengths = [p.numel() for p in self.params]
        self.scales = torch.zeros(len(self.params), dtype=torch.float64)
        self._running_stats = _RunningStatsFolding(model)

    def backward(self, loss_fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                 global_batch_size: int) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """Run every local micro-batch and leave the exact global mean gradient in ``.grad``.

        Returns ``(outputs, targets, loss)`` of each local micro-batch, detached, for metrics.
        """
        micro = local_micro_batches(global_batch_size, len(targets), self.micro_batch_size,
                                    runtime.size(), runtime.rank())
        total_micro = -(-global_batch_size // self.micro_batch_size)
        while True:
            sums, local_max, results = self._accumulate(loss_fn, inputs, targets, micro)
            # The sum travels alongside the maximum; it is discarded in the rare step that is redone.
            summed = collectives.allreduce_(sums, "sum", async_op=True, check=False)
            ideal = _ideal_scales(collectives.allreduce(local_max, "max", check=False), total_micro)
            summed = summed.wait()
            if _scales_fit(self.scales, ideal):
                break
            self.scales, self.redone_steps = ideal, self.redone_steps + 1
        self._publish(summed, global_batch_size)
        self._running_stats.fold()
        self.step += 1
        return results

    def _accumulate(self, loss_fn: Callable, inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                    micro: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Fixed-point sum of this rank's micro-batch gradients, and each tensor's largest entry.

        Scaling by a power of two is exact in the gradient's own dtype, so each entry is rounded
        once, to an integer, and the sample count multiplies the integer: no float64 pass.
        """
        sums = [torch.zeros(p.numel(), dtype=torch.int64) for p in self.params]
        local_max = torch.zeros(len(self.params), dtype=torch.float64)
        scales = self.scales.tolist()
        results = []
        self._running_stats.begin()
        for part in micro:
            results.append(self._backward_one(loss_fn, inputs, targets, part))
            grads = [_flat_grad(param) for param in self.params]
            maxima = torch.stack(torch._foreach_norm(grads, float("inf"))).double() * part.size
            local_max = torch.maximum(local_max, maxima)
            for grad, total, scale in zip(grads, sums, scales):
                total.add_(torch.mul(grad, scale).round_().to(torch.int64), alpha=part.size)
        self._running_stats.end()
        return torch.cat(sums), local_max, results

    def _backward_one(self, loss_fn: Callable, inputs: Sequence[torch.Tensor], targets: torch.Tensor,
                      part: MicroBatch) -> tuple[Any, torch.Tensor, torch.Tensor]:
        for param in self.params:
            param.grad = None
        torch.manual_seed(mix_seed(self.seed, self.step, part.index))
        rows = slice(part.start, part.stop)
        context = self.model.no_sync() if hasattr(self.model, "no_sync") else contextlib.nullcontext()
        with context:
            outputs = self.model(*(x[rows] for x in inputs))
            loss = loss_fn(outputs, targets[rows])
            loss.backward()
        self._running_stats.end_micro_batch()
        return _detach(outputs), targets[rows], loss.detach()

    def _publish(self, sums: torch.Tensor, global_batch_size: int) -> None:
        for param, chunk, scale in zip(self.params, sums.split(self._lengths), self.scales.tolist()):
            mean = chunk.double() / (scale * global_batch_size) if scale else torch.zeros(chunk.shape, dtype=torch.float64)
            param.grad = mean.to(param.dtype).view_as(param)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "scales": self.scales.clone(), "micro_batch_size": self.micro_batch_size,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["micro_batch_size"] != self.micro_batch_size:
            raise ConfigurationError(
                f"this run uses micro_batch_size={self.micro_batch_size}, the checkpoint {state['micro_batch_size']}; "
                "bitwise reproducibility needs the same micro-batch size."
            )
        self.step, self.scales, self.seed = int(state["step"]), state["scales"].clone(), int(state["seed"])


def _flat_grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad.detach().reshape(-1) if param.grad is not None else param.new_zeros(param.numel())


def _detach(outputs: Any) -> Any:
    return outputs.detach() if isinstance(outputs, torch.Tensor) else outputs


def _ideal_scales(global_max: torch.Tensor, total_micro: int) -> torch.Tensor:
    """The largest power of two per tensor that keeps a sum of ``total_micro`` terms in range."""
    if not bool(torch.isfinite(global_max).all()):
        raise NonFiniteGradientError(
            f"rank {runtime.rank()}: a micro-batch gradient holds NaN or Inf in reproducible mode; every rank "
            "raises this. Lower the learning rate or check the inputs."
        )
    budget = INT64_HEADROOM_BITS - math.ceil(math.log2(total_micro + 1)) - 1
    exponents = torch.where(global_max > 0, budget - torch.ceil(torch.log2(global_max.clamp_min(1e-300))),
                            torch.zeros_like(global_max))
    # Within float32's exponent range, so that scaling a float32 gradient stays exact.
    return torch.pow(2.0, exponents.clamp(-MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT))


def _scales_fit(used: torch.Tensor, ideal: torch.Tensor) -> bool:
    """Whether the scales used cannot overflow and lose at most ``PRECISION_SLACK_BITS`` bits."""
    return bool(((used <= ideal) & (used * 2.0**PRECISION_SLACK_BITS >= ideal)).all())


class _RunningStatsFolding:
    """Batch-norm running statistics updated per micro-batch in index order, on every rank alike.

    During a micro-batch's forward each layer runs with momentum 1, so its running statistics
    become that micro-batch's mean and unbiased variance, computed by the layer's own kernel; they
    are recorded and the layer's state is put back. After the step the records of all ranks are
    gathered (ranges are contiguous, so rank order is index order) and folded in with the
    layer's real momentum.
    """

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        self._index = {id(layer): k for k, layer in enumerate(self.layers)}
        self._width = sum(2 * layer.num_features for layer in self.layers)
        self._offsets = [0]
        for layer in self.layers:
            self._offsets.append(self._offsets[-1] + 2 * layer.num_features)
        self._rows: list[torch.Tensor] = []
        self._current: dict[int, torch.Tensor] = {}
        self._saved: list[tuple[torch.Tensor, ...]] = []
        self._momenta: dict[int, float | None] = {}
        self._recording = False
        for layer in self.layers:
            layer.register_forward_pre_hook(self._before)
            layer.register_forward_hook(self._after)

    def begin(self) -> None:
        """Start a pass over this rank's micro-batches (a redone step starts again)."""
        self._saved = [(l.running_mean.clone(), l.running_var.clone(), l.num_batches_tracked.clone())
                       for l in self.layers]
        self._rows, self._current, self._recording = [], {}, True

    def end_micro_batch(self) -> None:
        if self.layers:
            row = torch.full((self._width,), math.nan, dtype=torch.float64)
            for k, stats in self._current.items():
                row[self._offsets[k] : self._offsets[k + 1]] = stats
            self._rows.append(row)
        self._current = {}

    def end(self) -> None:
        """Undo the layers' own updates from this pass."""
        self._recording = False
        for layer, (mean, var, count) in zip(self.layers, self._saved):
            layer.running_mean.copy_(mean)
            layer.running_var.copy_(var)
            layer.num_batches_tracked.copy_(count)

    def _before(self, layer: nn.Module, args: tuple) -> None:
        if self._recording and layer.training:
            self._momenta[id(layer)] = layer.momentum
            layer.momentum = 1.0

    def _after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        if id(layer) in self._momenta:
            layer.momentum = self._momenta.pop(id(layer))
            self._current[self._index[id(layer)]] = torch.cat([layer.running_mean, layer.running_var]).double()

    def fold(self) -> None:
        """Gather every micro-batch's statistics and fold them in, in global index order."""
        if not self.layers:
            return
        local = torch.stack(self._rows) if self._rows else torch.zeros(0, self._width, dtype=torch.float64)
        for row in collectives.allgather(local, check=False):
            self._fold_row(row)

    def _fold_row(self, row: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for layer in self.layers:
                c = layer.num_features
                mean, var = row[offset : offset + c], row[offset + c : offset + 2 * c]
                offset += 2 * c
                if bool(torch.isnan(mean).any()):
                    continue  # the layer did not run on this micro-batch
                layer.num_batches_tracked.add_(1)
                momentum = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
                layer.running_mean.mul_(1 - momentum).add_(mean.to(layer.running_mean.dtype), alpha=momentum)
                layer.running_var.mul_(1 - momentum).add_(var.to(layer.running_var.dtype), alpha=momentum)
