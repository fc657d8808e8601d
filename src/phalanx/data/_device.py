"""Getting batches onto the accelerator: ``DistributedLoader(device=...)``.

Two ways, chosen once per loader. A dataset of tensors that fits comfortably in the device's free
memory is copied there once and every batch is gathered on the device (no copy per step: what the
fastest hand-written loops do). Anything else is copied batch by batch on a side stream, one batch
ahead of the one being used, so the copy of the next batch overlaps the current step's compute.

The copy-ahead logic is written against :class:`Transfer`, so it is tested on the CPU with a
recording stand-in for the stream (tests/data/test_device.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from phalanx.data._batch import TensorData, map_tensors
from phalanx.errors import ConfigurationError

__all__ = ["RESIDENT_SHARE", "Placement", "free_bytes", "place", "Transfer", "transfer_to", "copy_ahead"]

logger = logging.getLogger(__name__)

RESIDENT_SHARE = 0.5
"""A dataset of tensors is kept on the device when it takes at most this share of the device's free
memory (the rest is left to the model, its optimizer state and activations)."""

T = TypeVar("T")


class Placement(NamedTuple):
    """Where a loader's batches are built: from ``resident`` (the dataset's tensors on ``device``), or
    copied there batch by batch when it is ``None``; ``reason`` says which and why, in a clause a user
    reads (``px.fit``'s plan line, the log)."""

    device: torch.device
    resident: TensorData | None
    reason: str


def free_bytes(device: torch.device) -> int | None:
    """The device's free memory as its driver reports it (``torch.cuda.mem_get_info``); ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def place(data: TensorData | Any, device: torch.device, keep: bool | None) -> Placement:
    """Decide where ``data``'s batches are built for ``device``.

    ``keep=None`` keeps a dataset of tensors on the device when it takes at most
    :data:`RESIDENT_SHARE` of the free memory (:func:`free_bytes`; a device that does not report it
    gets copies); ``True`` keeps it there whatever its size (refused for data that is not tensors),
    ``False`` never. Data already on ``device`` is gathered where it is.
    """
    placement = _placement(data, device, keep)
    logger.info("phalanx: %s", placement.reason)
    return placement


def _placement(data: TensorData | Any, device: torch.device, keep: bool | None) -> Placement:
    tensors = data.tensors if isinstance(data, TensorData) else None
    if keep and tensors is None:
        raise ConfigurationError("data_on_device=True keeps a dataset of tensors on the device; this dataset is "
                                 "read sample by sample (or is a stream), so its batches are copied as they are "
                                 "made: drop data_on_device, or pass the data as tensors.")
    if tensors is not None and all(t.device == device for t in tensors):
        return Placement(device, data, f"batches gathered on {device}, where the data is")
    if tensors is None or keep is False:
        why = "data_on_device=False" if keep is False else "the data is read sample by sample"
        return Placement(device, None, f"batches copied to {device} one step ahead ({why})")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    free = free_bytes(device)
    if keep is None and free is None:
        return Placement(device, None, f"batches copied to {device} one step ahead (its free memory is unknown; "
                                       "data_on_device=True keeps the data there)")
    if keep is None and nbytes > RESIDENT_SHARE * free:
        return Placement(device, None, f"batches copied to {device} one step ahead (the data, {_size(nbytes)}, is "
                                       f"more than {RESIDENT_SHARE:.0%} of the {_size(free)} free there; "
                                       "data_on_device=True keeps it there anyway)")
    on_device = TensorData(tuple(t.to(device) for t in tensors), single=data.single)
    room = "" if free is None else f", {_size(free)} free"
    chosen = "data_on_device=True" if keep else "data_on_device=False copies batch by batch instead"
    return Placement(device, on_device, f"the data ({_size(nbytes)}) kept on {device} for the run ({chosen}{room})")


class Transfer(Protocol):
    """Moves batches to a device: ``start`` issues a copy and returns a ticket, ``finish`` hands
    the batch over once the compute that will use it may (the copy need not be over yet)."""

    def start(self, batch: Any) -> Any: ...

    def finish(self, ticket: Any) -> Any: ...


class _StreamTransfer:
    """Copies on a CUDA side stream; the compute stream waits for each copy's event, not the stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            moved = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return moved, copied

    def finish(self, ticket: tuple[Any, torch.cuda.Event]) -> Any:
        moved, copied = ticket
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        # the memory was allocated on the side stream: the allocator must not reuse it while compute reads it
        map_tensors(moved, lambda t: t.record_stream(compute) if t.is_cuda else None)
        return moved


class _PlainTransfer:
    """Any other device: a plain copy (nothing to overlap with)."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self, batch: Any) -> Any:
        return map_tensors(batch, lambda t: t.to(self.device))

    def finish(self, ticket: Any) -> Any:
        return ticket


def transfer_to(device: torch.device) -> Transfer:
    """The :class:`Transfer` for ``device``: a side stream on a GPU, a plain copy elsewhere."""
    return _StreamTransfer(device) if device.type == "cuda" else _PlainTransfer(device)


def copy_ahead(items: Iterator[T], transfer: Transfer, batch_of: Callable[[T], Any],
               with_batch: Callable[[T, Any], T]) -> Iterator[T]:
    """``items`` with each one's batch on the device, the copy of item k+1 started before item k is
    handed over (so it runs while item k is computed on)."""
    pending: tuple[T, Any] | None = None
    for item in items:
        ticket = transfer.start(batch_of(item))
        if pending is not None:
            yield with_batch(pending[0], transfer.finish(pending[1]))
        pending = (item, ticket)
    if pending is not None:
        yield with_batch(pending[0], transfer.finish(pending[1]))
