"""Objects as bytes for another rank: the one codec of every object phalanx sends.

Two ways, chosen by the caller with ``safe``:

- **safe**: nothing a receiver reads can run code, so it suits what comes from anywhere (an
  elastic state's values, a parameter server's requests, Horovod's negotiation records). It carries
  tensors, numbers, strings, bytes, ``None``, dtypes and lists, tuples and dicts of them, in one of
  two forms that the first byte tells apart:

  - *plain data* (``None``, ``bool``, ``int``, ``float``, ``str``, and lists and dicts with string
    keys of those, exactly those types) is a tag byte and JSON: microseconds, a few hundred bytes
    for a small record. JSON gives it back equal and of the same types; it arrives as a copy of its
    values (a list that appeared twice arrives as two lists). A tuple, a dict with other keys, a
    subclass (an ``OrderedDict``, an ``IntEnum``) or a recursive list is not plain: JSON would turn
    it into something else, so it takes the other form;
  - anything else is a ``torch.save`` archive, read back with ``torch.load(weights_only=True)``.

  An object that would not load is refused before it is sent, with the reason.
- **trusted** (``pickle``): any picklable object. Unpickling can run code, so it trusts every peer
  of the group; under ``phalanx run`` they are processes that proved they hold the job's secret
  (docs/security.md). Used by ``px.broadcast_object`` / ``px.allgather_object`` by default.

Both give a uint8 tensor that a collective or a channel carries like any other.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import torch

from phalanx.errors import ConfigurationError

__all__ = ["SAFE_CONTENTS", "encode", "decode", "encoded"]

#: What the safe way carries, in the words every error about it uses.
SAFE_CONTENTS = ("tensors, numbers, strings, bytes, None, dtypes, and lists, tuples and dicts of them (what "
                 "torch.load(weights_only=True) reads)")

PLAIN = b"J"  # the first byte of a safe message of plain data (JSON); a torch.save archive starts with b"PK"
_SCALARS = frozenset({str, int, float, bool, type(None)})
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # _plain has walked it: no cycle


def encoded(obj: Any, safe: bool) -> tuple[torch.Tensor, str | None]:
    """``obj`` as a uint8 tensor, or an empty one and why it cannot travel this way (every rank
    must learn that, so the caller sends the reason's existence before any payload)."""
    try:
        data = _safe_bytes(obj) if safe else pickle.dumps(obj)
    except Exception as error:  # noqa: BLE001 - pickling and torch.save raise many types
        return torch.empty(0, dtype=torch.uint8), _first_line(error)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8), None


def encode(obj: Any, safe: bool) -> torch.Tensor:
    """``obj`` as a uint8 tensor; raises :class:`ConfigurationError` naming why it cannot travel this way."""
    data, problem = encoded(obj, safe)
    if problem is not None:
        kind = f"safely (only {SAFE_CONTENTS})" if safe else "by pickle"
        raise ConfigurationError(f"a {type(obj).__name__} cannot be sent to another rank {kind}: {problem}")
    return data


def decode(data: torch.Tensor | bytes, safe: bool) -> Any:
    """The object :func:`encode` made of ``data`` (with the same ``safe``; its bytes, or the uint8 tensor).
    The safe way reads plain data as JSON and anything else with ``torch.load(weights_only=True)``:
    neither runs code."""
    raw = data if isinstance(data, bytes) else data.numpy().tobytes()
    if not safe:
        return pickle.loads(raw)
    if raw[:1] == PLAIN:
        return json.loads(raw[1:])
    return torch.load(io.BytesIO(raw), weights_only=True)


def _safe_bytes(obj: Any) -> bytes:
    """The safe way's bytes of ``obj``: plain data as JSON; else ``torch.save``'s, checked to load
    back with ``weights_only=True``."""
    try:
        if _plain(obj):
            return PLAIN + _JSON.encode(obj).encode("ascii")
    except (RecursionError, ValueError):  # a recursive list; an int of more digits than str() gives
        pass
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    torch.load(io.BytesIO(data), weights_only=True)  # raises on what a receiver would refuse
    return data


def _plain(obj: Any) -> bool:
    """Whether ``obj`` is plain data that JSON gives back equal and of the same types (see the module).
    Loops rather than ``all()``: this walk is most of what the plain form costs."""
    kind = type(obj)
    if kind is list:
        for item in obj:
            if type(item) not in _SCALARS and not _plain(item):
                return False
        return True
    if kind is dict:
        for key, value in obj.items():
            if type(key) is not str or type(value) not in _SCALARS and not _plain(value):
                return False
        return True
    return kind in _SCALARS


def _first_line(error: BaseException) -> str:
    """The line of ``error`` that says why (``torch.load``'s refusal names the global it would not load
    several lines down)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    telling = [line for line in lines if "Unsupported global" in line or "Can't pickle" in line]
    return (telling or lines or [type(error).__name__])[0][:200]
