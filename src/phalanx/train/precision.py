"""Mixed precision and gradient clipping around one optimizer step, agreed by every rank.

``precision`` takes Lightning's names: ``"32"`` (float32 throughout), ``"bf16-mixed"`` (forward and
loss under ``torch.autocast`` in bfloat16; parameters, gradients and the optimizer stay float32)
and ``"16-mixed"`` (the same in float16, with torch's ``GradScaler``: the loss is scaled before
backward, the gradients unscaled before clipping and the step, and a step whose gradients
overflowed is skipped while the scale shrinks). Every rank must skip the same steps, or the
replicas drift apart: before unscaling, the ranks agree by one tiny allreduce whether any of them
saw a non-finite gradient, and a rank that saw none marks its own, so that every scaler skips and
every scale shrinks alike. The scaler's state is checkpointed with the run.

Clipping (``clip_grad_norm``, ``clip_grad_value``) applies to the gradient the optimizer is about
to apply: after the reduction, where every rank holds the global average, so its norm is the
global norm and every rank clips alike; with a float16 scaler, after unscaling.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError
from phalanx.parallel.clipping import Clipping

logger = logging.getLogger(__name__)

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
#: The dtype each mixed precision computes in (autocast's; a strategy may gather parameters in it).
COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_ALIASES = {"32-true": "32", "bf16": "bf16-mixed", "16": "16-mixed", 32: "32", 16: "16-mixed"}


def resolve(precision: str | int) -> str:
    """Lightning's name for ``precision`` (``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``), or an error."""
    name = _ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ConfigurationError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}.")
    return str(name)


class Precision:
    """How one step's forward, backward and optimizer step run in ``name`` precision on ``device``."""

    def __init__(self, name: str | int = "32", device: torch.device | str = "cpu"):
        self.name = resolve(name)
        self.device = torch.device(device)
        self.dtype = COMPUTE_DTYPES.get(self.name)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.name == "16-mixed" else None
        if self.name == "16-mixed" and self.device.type == "cpu":
            logger.warning("phalanx: precision='16-mixed' on the CPU computes float16 in software: 28x slower than "
                           "float32 on benchmarks/bench_precision.py's MLP here. Use precision='bf16-mixed' on CPUs.")

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The context forward and loss run in (nothing at ``"32"``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled first under a float16 scaler."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clipping: Clipping | None) -> bool:
        """Clip and apply the reduced gradients, then update the scale; whether the step was taken
        (``False``: every rank skipped it because some rank's gradients overflowed)."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        self.apply(optimizer, clipping)
        self.update()
        return self.scaler is None or self.scaler.get_scale() >= scale

    def apply(self, optimizer: torch.optim.Optimizer, clipping: Clipping | None) -> None:
        """Clip and apply one optimizer's reduced gradients (several per step in a step of your own;
        :meth:`update` once after the last)."""
        if self.scaler is None:
            if clipping is not None:
                clipping.clip(optimizer)
            optimizer.step()
            return
        self.scaler.scale(torch.ones((), device=self.device))  # starts the scale on a rank that had no samples
        self._agree_on_overflow(optimizer)
        self.scaler.unscale_(optimizer)
        if clipping is not None:
            clipping.clip(optimizer)
        self.scaler.step(optimizer)

    def update(self) -> None:
        """The float16 scale for the next step (shrunk after an overflow, grown after many steps without)."""
        if self.scaler is not None:
            self.scaler.update()

    def backward_outside_autocast(self, loss: torch.Tensor) -> None:
        """:meth:`backward` from inside the forward's autocast (a step of your own): backward runs without it."""
        with torch.autocast(self.device.type, enabled=False):
            self.backward(loss)

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """Where any rank's gradients are not finite, make this rank's not finite too (before the
        scaler looks), so that every rank's scaler skips the step and shrinks its scale alike."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None and p.grad.numel()]
        finite = all(bool(torch.isfinite(grad).all()) for grad in grads)
        anywhere = collectives.allreduce(torch.tensor([0.0 if finite else 1.0]), "max", check=False)
        if float(anywhere) > 0 and finite and grads:
            grads[0].view(-1)[0] = math.inf

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["precision"] != self.name:
            raise ConfigurationError(f"the checkpoint was trained with precision={state['precision']!r} and this run "
                                     f"uses {self.name!r}: resume with the same precision.")
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
