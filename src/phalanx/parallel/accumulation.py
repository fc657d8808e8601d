"""Gradient accumulation: which backwards of a step are reduced over ranks.

One mechanism for every loop. A step is ``steps`` backwards (forward-backward passes over parts of
a batch, or over several batches); gradients add up on this rank and only the step's last
backward is reduced. Backwards inside :meth:`Accumulation.no_sync` are never reduced. Used by
``px.DataParallel(accumulate_steps=k)`` and its ``no_sync()`` (so by ``px.fit``'s
``accumulate_steps``, which runs each batch in chunks, all but the last inside ``no_sync``), by
reproducible mode (a step is a rank's micro-batches) and by Horovod's ``DistributedOptimizer``
(``backward_passes_per_step``)::

    accumulation = Accumulation(4)
    for batch in batches:
        reduces = accumulation.next_backward()  # True on every 4th
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from phalanx.errors import ConfigurationError


class Accumulation:
    """Counts the backwards of a step and says which one is reduced (see the module's docstring)."""

    def __init__(self, steps: int = 1):
        if not isinstance(steps, int) or steps < 1:
            raise ConfigurationError(f"gradient accumulation needs a whole number of backwards of at least 1 per "
                                     f"step, got {steps!r}.")
        self.steps = steps
        self.pending = 0  # backwards counted since the last reduced one
        self._paused = 0

    def next_backward(self) -> bool:
        """Count a backward; whether it is reduced: the step's last, outside :meth:`no_sync`."""
        self.pending += 1
        if self.pending < self.steps or self._paused:
            return False
        self.pending = 0
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block, backwards accumulate on this rank and are not reduced."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def restart(self) -> None:
        """Start a new step: what was counted is forgotten (a reduction ran early, or the group changed)."""
        self.pending = 0
