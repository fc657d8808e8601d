"""Distributed data with global-batch semantics.

Every rank walks the same permutation in chunks of ``global_batch_size`` samples and takes a
contiguous share of each chunk, so each sample is used exactly once per epoch across all ranks
and all ranks run the same number of steps. See ``docs/data.md``.
"""

from __future__ import annotations

from phalanx.data.loader import DistributedLoader
from phalanx.data.torch_loaders import from_dataloader
from phalanx.global_batch import (
    epoch_permutation,
    epoch_plan,
    epoch_seed,
    local_share,
    mix_seed,
    num_steps,
    share_bounds,
)

__all__ = [
    "DistributedLoader",
    "from_dataloader",
    "epoch_permutation",
    "epoch_plan",
    "epoch_seed",
    "local_share",
    "mix_seed",
    "num_steps",
    "share_bounds",
]
