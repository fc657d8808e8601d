"""How a bucket travels: as it is, cast to 16 bits, or sparsified to its top-k entries.

A compression launches the sum over ranks of one bucket's flat buffer and returns a handle whose
``wait()`` leaves the summed result in that same buffer. Buffers arrive already weighted (each
rank's share of the global average), so casting after this "divide first" cannot overflow where
the average itself would not. The trailer (see :mod:`phalanx.parallel.buckets`) is always sent
exactly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError


class Compression:
    """Sends buckets uncompressed: one in-place allreduce each."""

    name = "none"
    #: Whether scaling a bucket after the sum equals scaling every rank's buffer before it. True for
    #: an exact sum; a subclass is taken to be False unless it declares otherwise. The reducer
    #: relies on it to skip the per-step sample-count allreduce (see :mod:`phalanx.parallel.reducer`).
    rescalable = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "rescalable" not in cls.__dict__:
            cls.rescalable = False

    def launch(self, bucket_flat: torch.Tensor, gradient_numel: int, state: dict[str, Any]) -> Any:
        """Start summing ``bucket_flat`` over ranks; the returned handle's ``wait()`` completes it."""
        return collectives.allreduce_(bucket_flat, "sum", async_op=True, check=False)

    def split_state(self, state: dict[str, Any], lengths: list[int]) -> list[torch.Tensor | None]:
        """A bucket's carried state cut per parameter (``lengths`` elements each), so that it
        survives a new bucket layout; ``None`` where there is none. Plain sums carry nothing."""
        return [None] * len(lengths)

    def join_state(self, parts: list[torch.Tensor | None], lengths: list[int]) -> dict[str, Any]:
        """The state of a new bucket from its parameters' parts (the inverse of :meth:`split_state`)."""
        return {}

    def rollback(self, state: dict[str, Any]) -> None:
        """Undo what launching a bucket did to ``state``, for a step that is redone (elastic recovery)."""


class Cast(Compression):
    """Sends buckets as float16 or bfloat16: half the bytes, about three significant digits."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def launch(self, bucket_flat: torch.Tensor, gradient_numel: int, state: dict[str, Any]) -> Any:
        if bucket_flat.dtype == self.dtype or not bucket_flat.is_floating_point():
            return super().launch(bucket_flat, gradient_numel, state)
        compact = bucket_flat.to(self.dtype)
        handle = collectives.allreduce_(compact, "sum", async_op=True, check=False)
        return _Then(handle, lambda: bucket_flat.copy_(compact))


class TopK(Compression):
    """Sends only the ``ratio`` largest-magnitude entries of each bucket, over allgather.

    With ``error_feedback`` the entries left out are remembered per bucket and added to the next
    step's gradient, so nothing is lost for good, only delayed (Stich et al., 2018).
    """

    name = "topk"

    def __init__(self, ratio: float, error_feedback: bool = True):
        if not 0.0 < ratio <= 1.0:
            raise ConfigurationError(f"TopK ratio must be in (0, 1], got {ratio}.")
        self.ratio = ratio
        self.error_feedback = error_feedback

    def launch(self, bucket_flat: torch.Tensor, gradient_numel: int, state: dict[str, Any]) -> Any:
        gradient, trailer = bucket_flat[:gradient_numel], bucket_flat[gradient_numel:]
        if self.error_feedback and "residual" in state:
            gradient.add_(state["residual"])
        k = max(1, int(gradient_numel * self.ratio))
        indices = gradient.abs().topk(k, sorted=False).indices
        values = gradient[indices]
        if self.error_feedback:
            residual = gradient.clone()
            residual[indices] = 0
            state["before"], state["residual"] = state.get("residual"), residual
        gathered_values = collectives.allgather(torch.cat([values, trailer]), async_op=True, check=False)
        gathered_indices = collectives.allgather(indices, async_op=True, check=False)
        return _Then(gathered_values, lambda: self._scatter(bucket_flat, gradient_numel, k,
                                                            gathered_values.wait(), gathered_indices.wait()))

    def split_state(self, state: dict[str, Any], lengths: list[int]) -> list[torch.Tensor | None]:
        residual = state.get("residual")
        return [None] * len(lengths) if residual is None else list(residual.split(lengths))

    def join_state(self, parts: list[torch.Tensor | None], lengths: list[int]) -> dict[str, Any]:
        known = [part for part in parts if part is not None]
        if not known:
            return {}
        return {"residual": torch.cat([part if part is not None else known[0].new_zeros(length)
                                       for part, length in zip(parts, lengths)])}

    def rollback(self, state: dict[str, Any]) -> None:
        if "before" in state:
            previous = state.pop("before")
            if previous is None:
                state.pop("residual", None)
            else:
                state["residual"] = previous

    @staticmethod
    def _scatter(bucket_flat: torch.Tensor, gradient_numel: int, k: int, values: torch.Tensor,
                 indices: torch.Tensor) -> torch.Tensor:
        per_rank = values.view(-1, k + bucket_flat.numel() - gradient_numel)
        bucket_flat.zero_()
        bucket_flat[:gradient_numel].index_add_(0, indices, per_rank[:, :k].reshape(-1))
        bucket_flat[gradient_numel:] = per_rank[:, k:].sum(0)
        return bucket_flat


def resolve(compression: str | Compression | None) -> Compression:
    """Turn the user's ``compression=`` argument into a :class:`Compression`."""
    if compression is None or compression == "none":
        return Compression()
    if isinstance(compression, Compression):
        return compression
    casts = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if compression in casts:
        return Cast(casts[compression])
    raise ConfigurationError(
        f"compression must be None, 'fp16', 'bf16' or px.TopK(ratio), got {compression!r}."
    )


class _Then:
    """A handle that runs ``finish`` once the underlying collective completes."""

    def __init__(self, handle: Any, finish: Callable[[], Any]):
        self._handle = handle
        self._finish = finish
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            self._handle.wait()
            self._finish()
            self._done = True

    def is_completed(self) -> bool:
        return self._done or self._handle.is_completed()
