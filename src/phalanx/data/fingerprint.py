"""Checking that every rank holds the same dataset, with one small collective per loader.

Global-batch semantics cut each global batch of one shared permutation into per-rank shares, so
a rank's share is only the right samples if every rank indexes the same dataset in the same
order. Unseeded random data or per-rank files break that silently. Each rank therefore
describes its loader by a record (length, seed, batch settings and a digest of a few samples
chosen by a fixed seed), the records are allgathered once, and any difference raises
:class:`~phalanx.errors.DataMismatchError` on every rank, naming the ranks that differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from phalanx import faults, rng
from phalanx.data._batch import MapData, TensorData
from phalanx.global_batch import mix_seed
from phalanx.errors import DataMismatchError

__all__ = ["FIELDS", "SAMPLES_CHECKED", "check_same_data", "content_digest", "record_of", "sample_digest"]

FIELDS = ("samples", "seed", "global_batch_size", "shuffle", "drop_last", "content")
SAMPLES_CHECKED = 8
_UNKNOWN_LENGTH = -1
_SALT = 0x5EED


def content_digest(obj: Any) -> int:
    """A 63-bit digest of tensors, arrays, numbers, strings and containers of them.

    Objects it cannot read reliably (their bytes may hold addresses) contribute their type only.
    """
    hasher = hashlib.blake2b(digest_size=8)
    _update(hasher, obj)
    return int.from_bytes(hasher.digest(), "little") >> 1


def sample_digest(data: TensorData | MapData) -> int:
    """The digest of ``SAMPLES_CHECKED`` samples drawn by a fixed seed, identically on every rank.

    The random generators are seeded for the fetch and restored afterwards, so random
    augmentation in a dataset's ``__getitem__`` gives the same samples on every rank.
    """
    n = len(data)
    if n == 0:
        return 0
    chosen_seed = mix_seed(_SALT, n)
    indices = torch.randint(n, (min(SAMPLES_CHECKED, n),), generator=torch.Generator().manual_seed(chosen_seed))
    with rng.seeded(chosen_seed):
        return content_digest(data.fetch(indices))


def record_of(samples: int | None, seed: int, global_batch_size: int, shuffle: bool, drop_last: bool,
              content: int) -> list[int]:
    """The integers every rank must agree on, in the order of :data:`FIELDS`."""
    return [_UNKNOWN_LENGTH if samples is None else int(samples), int(seed), int(global_batch_size), int(shuffle),
            int(drop_last), int(content)]


def check_same_data(record: list[int], opt_out_hint: str) -> None:
    """Allgather ``record`` (one collective) and raise on every rank if any rank's differs; the message ends
    with ``opt_out_hint``, how to skip the check in the call that built the loader."""
    from phalanx.comm.collectives import allgather

    faults.point("loader.check")

    rows = allgather(torch.tensor(record, dtype=torch.int64), check=False).view(-1, len(FIELDS)).tolist()
    if any(row != rows[0] for row in rows):
        raise DataMismatchError(_mismatch_message(rows, opt_out_hint))


def _mismatch_message(rows: list[list[int]], opt_out_hint: str) -> str:
    differing = [field for k, field in enumerate(FIELDS) if len({row[k] for row in rows}) > 1]
    others = [rank for rank, row in enumerate(rows) if row != rows[0]]
    described = "; ".join(f"rank {rank}: " + ", ".join(_describe(field, rows[rank][FIELDS.index(field)])
                                                           for field in differing)
                          for rank in range(len(rows)))
    return (
        f"DistributedLoader: the ranks do not hold the same data ({', '.join(differing)} differ): {described}. "
        f"Ranks {others} differ from rank 0. Every rank must load the same dataset with the same loader "
        "settings, because each global batch is split over the ranks: build random data from a seeded "
        "generator (torch.Generator().manual_seed(0)), read the same files, and pass the same seed and batch "
        f"settings everywhere. If each rank's data is its own by design, {opt_out_hint}."
    )


def _describe(field: str, value: int) -> str:
    if field == "samples":
        return "length unknown" if value == _UNKNOWN_LENGTH else f"{value} samples"
    if field == "content":
        return f"sample digest {value:016x}"
    return f"{field}={bool(value) if field in ('shuffle', 'drop_last') else value}"


def _update(hasher: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        _update_tensor(hasher, obj)
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            _update(hasher, obj.tolist())
        else:
            hasher.update(f"nd{obj.dtype}{obj.shape}".encode())
            hasher.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, (bytes, bytearray)):
        hasher.update(bytes(obj))
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, np.generic)):
        hasher.update(f"{type(obj).__name__}:{obj!r}".encode())
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _update(hasher, key)
            _update(hasher, value)
    elif isinstance(obj, (list, tuple)):
        hasher.update(f"{type(obj).__name__}[{len(obj)}]".encode())
        for item in obj:
            _update(hasher, item)
    elif callable(getattr(obj, "tobytes", None)):  # images and similar buffers
        hasher.update(type(obj).__name__.encode())
        hasher.update(obj.tobytes())
    else:
        hasher.update(type(obj).__name__.encode())


def _update_tensor(hasher: Any, tensor: torch.Tensor) -> None:
    hasher.update(f"t{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    hasher.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())
