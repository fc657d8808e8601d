"""A non-finite loss or gradient never trains silently: every rank stops (or skips) at the same step.

Before each backward the loop hands the loss to :meth:`NonFiniteGuard.for_backward`, which notes
on this rank whether it is finite and, if not, multiplies it by NaN instead of 1 (bitwise the same
loss otherwise), so that the gradient is non-finite too even where the loss was only a constant
offset. After the reduction every rank looks at the gradient it is about to apply: where every
rank holds the same averaged gradient (:class:`~phalanx.strategies.base.Replicated`, reproducible
mode) a NaN on any rank reaches every rank's, so all decide alike without a message; where ranks
hold different gradients in lockstep (:class:`~phalanx.strategies.central_storage.CentralStorage`)
they agree by one allreduce of two flags. Only when a step went wrong do the ranks gather who saw a
non-finite loss, to say so in one message that every rank raises.

Workers that step on their own between exchanges (``px.LocalSGD``, ``px.DiLoCo``: the agreement
``"exchanges"``) send nothing per step, and a flag's round trip every step would tie them in
lockstep over the slow link they were chosen for. Each decides its own step: a non-finite one is
not applied (taken empty, so that the strategy's count of steps, which schedules its exchanges,
stays the same on every worker). Under ``"skip"`` that is all: the other workers' steps stand.
Under ``"raise"`` the verdict waits for the next step at which the workers meet anyway (the
strategy says which: :meth:`~phalanx.strategies.base.Strategy.meets_after_step`), or the epoch's
end, whichever comes first; there every rank stops alike, before that step, naming the rank and
step that went wrong first. The weights stay finite meanwhile, since no worker applied its step.

``on_nonfinite`` chooses what happens then: ``"raise"`` (default) stops with
:class:`~phalanx.errors.NonFiniteLossError` or :class:`~phalanx.errors.NonFiniteGradientError`
before the step is applied, so the weights and checkpoints stay finite; ``"skip"`` drops the step
on every rank (its samples do not count in the metrics), as the float16 scaler drops an overflow;
``"ignore"`` applies it, as phalanx did before.

On a GPU, ``"raise"`` reads each step's verdict one step late (:meth:`NonFiniteGuard.settle`): the
verdict is copied to the host as the GPU computes it, and read when the next step is about to be
applied (or at the end of the epoch, before validation and the epoch's checkpoint), when it is long
there. Reading it at once would make the host wait for the whole backward before launching
anything more, which cost 27 % of a small CNN's step on an H100 (``benchmarks/RESULTS.md``). So on a
GPU the run stops one step later, with that one non-finite update applied to the weights in memory;
no checkpoint is written from them (:mod:`phalanx.train.checkpoint` refuses non-finite weights).
``"skip"`` must decide before the step, so it waits, as on the CPU, where the wait costs nothing.

Under ``precision="16-mixed"`` the float16 scaler keeps skipping non-finite steps as it always did
(every rank alike, the scale halved each time): an overflow is normal there. The guard steps in
only when skipping cannot help any more, once the scale has fallen below 1 (16 overflows in a row
from the default 65536, which no healthy run sees): then it raises as above.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable

import torch

from phalanx.comm import collectives, runtime
from phalanx.errors import ConfigurationError, NonFiniteGradientError, NonFiniteLossError
from phalanx.parallel.clipping import Clipping

POLICIES = ("raise", "skip", "ignore")
#: How ranks come to the same decision: "gradient" (every rank holds the same reduced gradient),
#: "collective" (different gradients, one allreduce of flags), "exchanges" (workers that step on
#: their own and meet every so many steps), "local" (workers that never meet).
AGREEMENTS = ("gradient", "collective", "exchanges", "local")

logger = logging.getLogger(__name__)


def reads_late(device: torch.device) -> bool:
    """Whether a run on ``device`` reads each step's verdict one step late (a GPU: see the module)."""
    return device.type == "cuda"


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`; a clear error otherwise."""
    if policy not in POLICIES:
        raise ConfigurationError(f"on_nonfinite must be one of {list(POLICIES)}, got {policy!r}.")
    return policy


class NonFiniteGuard:
    """Decides, the same way on every rank, whether a step's losses and gradient let it be applied."""

    def __init__(self, policy: str = "raise", agreement: str = "gradient", precision: str = "32",
                 clipping: Clipping | None = None, late: bool = False, meets: Callable[[], bool] = lambda: True):
        if agreement not in AGREEMENTS:
            raise ConfigurationError(f"a strategy's nonfinite_agreement must be one of {list(AGREEMENTS)}, got "
                                     f"{agreement!r}.")
        self.policy, self.agreement = check_policy(policy), agreement
        self.precision, self.clipping = precision, clipping
        self.skipped_steps = 0  # steps skipped under "skip", over the run
        self.skipped = False  # whether the current step was skipped
        self.position = "a step"  # where the loop is, for messages
        self._bad_loss: torch.Tensor | None = None  # on this rank's device: any non-finite loss this step
        # "raise" with every rank holding the same gradient reads the verdict a step late (see the module)
        self.late = late and self.policy == "raise" and agreement == "gradient"
        self._pending: _Verdict | None = None  # the last step's verdict, on its way to the host
        # "exchanges": whether the step about to be applied meets the other workers, and where this
        # rank first went non-finite since they last met ("raise"; the others do not know yet)
        self.meets = meets
        self._unshared: tuple[str, bool] | None = None  # (position, whether the loss was non-finite)

    def begin_step(self, position: str) -> None:
        self.position, self.skipped, self._bad_loss = position, False, None

    def watching(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` whose every loss passes through :meth:`for_backward` (for reproducible mode's micro-batches)."""
        return lambda *args: self.for_backward(loss_fn(*args))

    def for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` to run backward on: itself (times exactly 1), or times NaN where it is not finite."""
        if self.policy == "ignore":
            return loss
        bad = ~torch.isfinite(loss.detach())
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad
        return loss * torch.where(bad, math.nan, 1.0).to(loss.dtype)

    def allows_step(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the step on ``params``' reduced gradients may be applied; raises under ``"raise"``
        on every rank alike."""
        if self.policy == "ignore":
            return True
        if self.precision == "16-mixed":
            return True  # the scaler skips it, on every rank alike; see :meth:`after_overflow`
        if self.late:
            self.settle()
            self._pending = _Verdict(self.position, self._flags(params), self._bad_loss)
            return True
        bad_loss, bad_gradient = self._flags(params).tolist()
        if self.agreement == "exchanges":
            return self._own_step(bool(bad_loss), bool(bad_gradient))
        if self.agreement == "collective":
            flags = collectives.allreduce(torch.tensor([float(bad_loss), float(bad_gradient)]), "max", check=False)
            bad_loss, bad_gradient = bool(flags[0] > 0), bool(flags[1] > 0)
        if not (bad_loss or bad_gradient):
            return True
        self.fail()
        return False

    @property
    def steps_on_its_own(self) -> bool:
        """Whether a step this guard refused is still to be taken, empty, on this rank: workers that
        step on their own decide alone, and their strategy counts every step (see the module)."""
        return self.agreement == "exchanges"

    def _own_step(self, bad_loss: bool, bad_gradient: bool) -> bool:
        """A worker that steps on its own decides its step alone; under ``"raise"`` a non-finite one
        is held against the next step that meets the other workers, where every rank stops."""
        if bad_loss or bad_gradient:
            self.skipped = True
            if self.policy == "skip":
                self.skipped_steps += 1
                logger.warning("phalanx: rank %d skipped its own step at %s (on_nonfinite='skip'): its %s went "
                               "non-finite (NaN or Inf); the other workers' steps stand, as they step on their own "
                               "between exchanges", runtime.rank(), self.position, "loss" if bad_loss else "gradient")
            elif self._unshared is None:
                self._unshared = (self.position, bad_loss)
        if self.policy == "raise" and self.meets():
            self._agree_on_own_steps(f"before {self.position}, which exchanges with the other workers")
        return not self.skipped

    def _agree_on_own_steps(self, where: str) -> None:
        """Every rank learns whether any held back a non-finite step (one allreduce), and all raise if so."""
        mine, self._unshared = self._unshared, None
        reports = [mine]
        if runtime.size() > 1:
            flag = collectives.allreduce(torch.tensor([float(mine is not None)]), "max", check=False)
            if float(flag) > 0:
                reports = collectives.allgather_object(mine, safe=True)
        found = [(rank, report) for rank, report in enumerate(reports) if report is not None]
        if not found:
            return
        ranks = [rank for rank, (_, bad_loss) in found if bad_loss]
        first = "; ".join(f"rank {rank}'s {'loss' if bad_loss else 'gradient'} at {position}"
                          for rank, (position, bad_loss) in found)
        error = NonFiniteLossError if ranks else NonFiniteGradientError
        raise error(f"a step went non-finite (NaN or Inf) while the workers stepped on their own (the first of each "
                    f"rank that had one: {first}). Every "
                    f"rank stops here, {where}: no worker applied a non-finite step, so the weights (and every "
                    f"checkpoint) are finite. {self._advice(ranks)}", ranks=ranks)

    def settle(self) -> None:
        """Decide the step whose verdict is still on its way (``late``), or this rank's own steps not
        yet agreed on (``"exchanges"``): raise on every rank if one went non-finite. Every rank settles
        at the same point of the loop (the epoch's end), so they raise alike."""
        if self.agreement == "exchanges" and self.policy == "raise":
            self._agree_on_own_steps(f"at the end of the epoch, after {self.position}")
        pending, self._pending = self._pending, None
        if pending is None or not pending.went_wrong():
            return
        self.position, self._bad_loss = pending.position, pending.bad_loss
        self.fail(applied=True)

    def forget_pending(self) -> None:
        """Drop a verdict still on its way: the loop goes back to a committed state (elastic recovery),
        and the steps after it run again, their losses and gradients checked afresh."""
        self._pending = self._unshared = None

    def after_overflow(self, scale: float) -> None:
        """The float16 scaler skipped this step (on every rank) and its scale is now ``scale``: when it
        has fallen below 1, skipping no longer helps, and the run stops under ``"raise"``."""
        if self.policy == "raise" and scale < 1.0:
            self.fail(context=f"; the float16 scaler skipped step after step until its scale fell to {scale:g}")

    def fail(self, cause: BaseException | None = None, context: str = "", applied: bool = False) -> None:
        """The step went non-finite on some rank: raise (``"raise"``) or note the skip, the same on every rank;
        ``applied``: the verdict came a step late, after the step was applied."""
        ranks = self._ranks_with_bad_loss()
        where = self.position
        if self.policy == "skip":
            if not self.skipped:
                self.skipped, self.skipped_steps = True, self.skipped_steps + 1
                logger.log(logging.WARNING if runtime.is_master() else logging.INFO,
                           "phalanx: skipped %s on every rank (on_nonfinite='skip'): %s", where, _what(ranks))
            return
        error = NonFiniteLossError if ranks else NonFiniteGradientError
        when = ("every rank stops at the next step: on a GPU the check is read one step late (waiting for it "
                "would stall the GPU every step), so this step's update was applied to the weights in memory; "
                "no checkpoint holds them, resume from the last one" if applied else
                "every rank stops here, before the step is applied, so the weights (and every checkpoint) are "
                "the last finite ones")
        raise error(f"{_what(ranks)} at {where}{context}; {when}. {self._advice(ranks)}", ranks=ranks) from cause

    def _flags(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """(this rank saw a non-finite loss, the gradient it holds is not finite), on the device."""
        grads = [_values(p.grad.detach()) for p in params if p.grad is not None and p.grad.numel()]
        if grads:
            bad_gradient = _any_nonfinite(grads)
        else:
            bad_gradient = torch.zeros((), dtype=torch.bool)
        bad_loss = (self._bad_loss.reshape(()).to(bad_gradient.device) if self._bad_loss is not None
                    else torch.zeros((), dtype=torch.bool, device=bad_gradient.device))
        return torch.stack([bad_loss, bad_gradient])

    def _ranks_with_bad_loss(self) -> list[int]:
        """The ranks that saw a non-finite loss this step (a collective, except for workers that never meet)."""
        mine = float(bool(self._bad_loss)) if self._bad_loss is not None else 0.0
        if self.agreement == "local" or runtime.size() == 1:
            return [runtime.rank()] if mine else []
        flags = collectives.allgather(torch.tensor([mine]), check=False)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _advice(self, ranks: list[int]) -> str:
        """What to try, fitting this run's settings."""
        tips = []
        if self.precision == "16-mixed":
            tips.append("float16 overflows above 65504: precision='bf16-mixed' has float32's range")
        if self.clipping is None or self.clipping.max_norm is None:
            tips.append("clip the gradients (clip_grad_norm=1.0)" if not ranks else
                        "lower the learning rate or clip the gradients (clip_grad_norm=1.0) if the loss grew first")
        else:
            tips.append(f"gradients are already clipped (clip_grad_norm={self.clipping.max_norm:g}): lower the "
                        "learning rate")
        if ranks:
            tips.append(f"look for NaN or Inf in the inputs or targets of rank {ranks[0]}'s batch")
        skipped = "on the rank that had one" if self.agreement == "exchanges" else "on every rank"
        tips.append(f"on_nonfinite='skip' skips such steps {skipped}, on_nonfinite='ignore' trains on as before")
        return "What to do: " + "; ".join(tips) + "."


class _Verdict:
    """A step's flags on their way to the host: copied without waiting, read by :meth:`went_wrong`."""

    def __init__(self, position: str, flags: torch.Tensor, bad_loss: torch.Tensor | None):
        self.position, self.bad_loss = position, bad_loss
        if flags.is_cuda:
            self.flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.flags.copy_(flags, non_blocking=True)
            self.copied: torch.cuda.Event | None = torch.cuda.Event()
            self.copied.record()
        else:
            self.flags, self.copied = flags, None

    def went_wrong(self) -> bool:
        """Whether the loss or the gradient was non-finite (waits for the copy, long done by then)."""
        if self.copied is not None:
            self.copied.synchronize()
        return bool(self.flags.any())


def _what(ranks: list[int]) -> str:
    if not ranks:
        return "the averaged gradient went non-finite (NaN or Inf) though every rank's loss was finite"
    named = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"the loss went non-finite (NaN or Inf) on {named}"


def _any_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of ``grads`` holds NaN or Inf, as a 0-d bool tensor on their device.

    A GPU takes every tensor's largest magnitude in one fused kernel. On a CPU that kernel is 10x
    slower than a tensor's min and max, and its sum is cheaper still (0.16 ms against 0.40 for the 30
    gradients of bench_slow_link.py's model): a sum is finite only where every entry is (NaN and Inf
    never sum back to a finite number), so a finite sum settles a tensor, and only a sum that went
    non-finite (a NaN or Inf, or finite entries that overflowed) is looked at again, entry by entry."""
    if grads[0].is_cuda:
        return torch.stack(torch._foreach_norm(grads, math.inf)).isfinite().all().logical_not()
    sums = [grad.sum() for grad in grads]
    if len({total.dtype for total in sums}) > 1:
        sums = [total.to(torch.float64) for total in sums]  # exact for every float dtype: no new overflow
    if bool(torch.stack(sums).isfinite().all()):
        return torch.zeros((), dtype=torch.bool)
    return torch.tensor(not all(bool(torch.stack(torch.aminmax(grad)).isfinite().all()) for grad in grads))


def _values(gradient: torch.Tensor) -> torch.Tensor:
    """The stored entries of a gradient (a sparse one's values)."""
    return gradient.coalesce().values() if gradient.is_sparse else gradient


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor of ``tensors`` that holds NaN or Inf, or ``None``."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None
