"""The reduction a doctor session puts around a model's own: bucket timing and gradient norms.

Every bucket records its launch (index, bytes) and the time backward's end waited for it, which
is the communication the backward did not hide. On the steps the session picks it also records
the squared norm of this rank's gradient (``bucket.gradient`` divided by the rank's share of the
global batch) and of the global average after the sum: the two batch sizes the gradient noise
scale needs (see :mod:`phalanx.doctor.noise`). Norms cost two dot products per bucket, so those
steps are kept out of the timing.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from phalanx.parallel.buckets import Bucket
from phalanx.parallel.reductions import Average, Cast, Reduction, Waitable
from phalanx.parallel.weights import Weights
from phalanx.profile import Recorder


class Probe(Reduction):
    """``inner`` as it is, with each bucket's launch, wait and (when asked) norms recorded."""

    def __init__(self, inner: Reduction, recorder: Recorder):
        self.inner = inner
        self.recorder = recorder
        self.name = inner.name
        self.measure_norms = False  # set by the session for the coming step
        # Only plain and cast sums leave this rank's gradient and the global average in the bucket.
        self._has_norms = type(inner) in (Reduction, Average, Cast)

    def weights(self) -> Weights:
        return self.inner.weights()

    def agree_order(self, observed: list[int], count: int) -> list[int] | None:
        return self.inner.agree_order(observed, count)

    def reduce(self, bucket: Bucket) -> Waitable:
        """Record the launch (and this rank's gradient norm), then reduce as the model's reduction does."""
        norms = self.measure_norms and self._has_norms
        local = float(bucket.trailer[-1]) if norms else 0.0
        small = _squared_norm(bucket.gradient) if norms else 0.0
        self.recorder.mark("launch", bucket=bucket.index, bytes=bucket.flat.numel() * bucket.flat.element_size())
        return _TimedWait(self.inner.reduce(bucket), bucket, self.recorder, (local, small) if norms else None)

    def bucket_groups(self, groups: list[list[int]], params: Sequence[torch.Tensor]) -> list[list[int]]:
        return self.inner.bucket_groups(groups, params)

    def split_state(self, state: dict[str, Any], lengths: list[int]) -> list[torch.Tensor | None]:
        return self.inner.split_state(state, lengths)

    def join_state(self, parts: list[torch.Tensor | None], lengths: list[int]) -> dict[str, Any]:
        return self.inner.join_state(parts, lengths)

    def rollback(self, state: dict[str, Any]) -> None:
        self.inner.rollback(state)


class _TimedWait:
    """A bucket's handle whose ``wait()`` records how long it blocked, and the global norm after it."""

    def __init__(self, handle: Waitable, bucket: Bucket, recorder: Recorder, local: tuple[float, float] | None):
        self.handle, self.bucket, self.recorder, self.local = handle, bucket, recorder, local

    def wait(self) -> Any:
        started = time.perf_counter()
        result = self.handle.wait()
        self.recorder.mark("wait", started=started, bucket=self.bucket.index)
        if self.local is not None:
            samples, small = self.local
            total = float(self.bucket.trailer[-1])
            share = samples / total if total else 0.0
            if share > 0:
                self.recorder.mark("norms", small=small / share**2, big=_squared_norm(self.bucket.gradient),
                                   local=samples, total=total)
        return result


def _squared_norm(tensor: torch.Tensor) -> float:
    flat = tensor.reshape(-1).float()
    return float(torch.dot(flat, flat))
