"""This process's random generators (torch with CUDA, Python's ``random``, NumPy) as one thing.

At the bottom beside ``global_batch.py``: loader workers seed all of them, the same-data check draws
samples under a fixed seed and puts them back, and elastic recovery restores them for a redone
step; none of those layers may import another.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed torch (every device), ``random`` and NumPy from one integer."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def get_state() -> dict[str, Any]:
    """Every generator's state, to hand back to :func:`set_state`."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_state(state: dict[str, Any]) -> None:
    """Put every generator back as :func:`get_state` found it."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Every generator seeded with ``seed`` inside the block, and as it was again after it."""
    saved = get_state()
    seed_all(seed)
    try:
        yield
    finally:
        set_state(saved)
