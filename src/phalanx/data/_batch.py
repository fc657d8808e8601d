"""Batch helpers: building the data of one step, and zero-row batches for empty shares.

A rank whose share of the last global batch is empty still runs the step (so collectives
line up), and the training loop still needs a batch with the right structure, trailing shapes
and dtypes. :func:`empty_like_batch` slices a one-sample batch to zero rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["TensorData", "MapData", "empty_like_batch", "identity", "map_tensors"]

_ARRAYS = (torch.Tensor, np.ndarray)


def identity(batch: Any) -> Any:
    """A picklable no-op collate function for batches that are built already."""
    return batch


def map_tensors(batch: Any, apply: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``apply(t)`` in place of every tensor ``t``, through tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return apply(batch)
    if isinstance(batch, (list, tuple)):
        items = [map_tensors(part, apply) for part in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, dict):
        return {key: map_tensors(value, apply) for key, value in batch.items()}
    return batch


def empty_like_batch(batch: Any) -> Any:
    """``batch`` with zero rows: tensors and arrays sliced ``[:0]`` through tuples, lists and dicts.

    A list or tuple whose items are all plain values (strings, numbers) is taken to be a
    per-sample list, as ``default_collate`` returns for strings, and becomes empty itself.
    Anything else that is not a container is returned unchanged.
    """
    if isinstance(batch, _ARRAYS):
        return batch[:0] if batch.ndim > 0 else batch
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {key: empty_like_batch(value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        return _empty_sequence(batch)
    return batch


def _empty_sequence(batch: list | tuple) -> list | tuple:
    """Empty a per-sample list, or map :func:`empty_like_batch` over a structure of fields."""
    if not any(isinstance(item, (*_ARRAYS, Mapping, list, tuple)) for item in batch):
        return batch[:0]
    items = [empty_like_batch(item) for item in batch]
    if hasattr(batch, "_fields"):
        return type(batch)(*items)
    return type(batch)(items)


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    """A mapping of the original's type when it can be built from a dict, else a dict."""
    try:
        return type(original)(items)
    except Exception:
        return items


class TensorData:
    """Equal-length tensors indexed together: the fast path, one gather per tensor, no collate.

    Indexing with an int gives one sample (a row of each tensor); indexing with an index
    tensor gives a whole batch, which is how DataLoader workers fetch it (``batch_size=None``).
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], single: bool):
        self.tensors = tensors
        self.single = single

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int | torch.Tensor) -> Any:
        if isinstance(index, torch.Tensor):
            return self.fetch(index)
        rows = tuple(t[index] for t in self.tensors)
        return rows[0] if self.single else rows

    def fetch(self, indices: torch.Tensor) -> Any:
        """The rows ``indices`` of every tensor, as one tensor or a tuple."""
        rows = tuple(t.index_select(0, indices.to(t.device)) for t in self.tensors)
        return rows[0] if self.single else rows

    def empty(self, template_index: int) -> Any:
        """A zero-row batch of the right shapes and dtypes."""
        return self.fetch(torch.empty(0, dtype=torch.int64))


class MapData:
    """A map-style dataset plus a collate function: samples fetched one by one, then collated."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any]):
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: torch.Tensor) -> Any:
        """The collated samples ``indices`` (uses the dataset's ``__getitems__`` when it has one)."""
        index_list = indices.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(index_list) if getitems else [self.dataset[i] for i in index_list]
        return self.collate_fn(samples)

    def empty(self, template_index: int) -> Any:
        """A zero-row batch, sliced from the collated sample ``template_index``."""
        return empty_like_batch(self.collate_fn([self.dataset[template_index]]))
