"""The cross-rank check of a collective call: every rank's record of it, judged alike on every rank.

Before anything else is exchanged, each rank's record of the call (operation, dtype, shape, a
``detail`` for what else must match: reduction op, root, algorithm; and the code of what is wrong
with its arguments, 0 for nothing) meets every other rank's, and every rank reaches the same
verdict: :class:`~phalanx.errors.ConfigurationError` for the first invalid arguments, naming every
rank that made them, else :class:`~phalanx.errors.CollectiveMismatchError` where the records differ.
So one rank never raises while the others hang or go on out of step.

The functions are the check itself and know nothing of how records travel; any caller that holds
every rank's record of a call can use them and raise with the same words:

- :func:`record` makes a rank's record (a fixed-length list of ints, so that it travels as one
  all_gather of int64s or in shared memory's first arrival); :func:`problem_code` judges a rank's
  own arguments into its ``problem``; :func:`reduction_detail` encodes an op with a root or an
  algorithm into its ``detail``.
- :func:`compare` judges the records of every rank, keyed by rank (so a subgroup's ranks keep their
  names): it raises, or returns when the call can go ahead. It is :func:`verdict` on the records
  read as calls, after a fast path for the usual case (every record alike, no problem, no join).
- :func:`verdict` is the check itself, on every rank's call as named fields ("operation", the
  tensors' "dtypes" and "shapes", a "problem" code, and anything else that must agree: op, root,
  algorithm...): the error every rank raises, or ``None``. Horovod's negotiation, which holds every
  rank's record of an operation as such fields, judges them with it: its kinds as the operation,
  the kinds a joined rank takes part in as ``joinable``, allgather's and alltoall's rows that may
  differ as ``ignore_first_dim``, its name in the ``label`` and the name matching in ``matched``;
  so both say what differs in the same words.
- :func:`read` turns a record back into its fields.

:class:`Agreeing` is how a generation's collectives run the check: gathering the records (through
shared memory when every rank is on this host, in order with the allreduces queued there), or
folding the check into shared memory's first exchange of an allreduce.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import shm, wire
from phalanx.comm.routing import ALLREDUCE_ALGORITHMS, REDUCE_OPS, Routing
from phalanx.errors import CollectiveMismatchError, ConfigurationError, PhalanxError

#: The operations a record can name ("join": a rank in ``join()``, which takes part only in allreduces).
OPERATIONS = ("allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "barrier", "join")
_JOIN = OPERATIONS.index("join")
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_DTYPES += tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - set(_DTYPES), key=str))
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(_DTYPES)}  # every dtype: each has its own code
_MAX_DIMS = 12
_OP, _DTYPE, _DETAIL, _PROBLEM, _NDIM, _SHAPE = range(6)  # a record's fields: op/root in detail, shape last
_RECORD_LEN = _SHAPE + _MAX_DIMS
#: Each reduction's code in a record's detail.
REDUCE_OPS_INDEX = {name: index for index, name in enumerate(REDUCE_OPS)}

#: What a rank's arguments can be wrong in, as a code in its record: every rank reads the same words.
_PROBLEMS = ("", "op must be one of {ops}", "algorithm must be one of {algorithms}", "root must be a rank in [0, {size})",
             "collectives take tensors of up to {dims} dimensions",
             "splits must hold {size} non-negative counts summing to dim 0 (without splits, dim 0 must be "
             "divisible by {size})")
_BAD_OP, _BAD_ALGORITHM, _BAD_ROOT, _TOO_MANY_DIMS, BAD_SPLITS = range(1, len(_PROBLEMS))

# Newer torch renamed the flat-tensor allgather; older releases (>= 2.4) have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Call(NamedTuple):
    """A record's fields (see :func:`record`)."""

    operation: str
    dtype: torch.dtype
    shape: list[int]
    detail: int
    problem: int


def record(operation: str, dtype: torch.dtype, shape: Sequence[int], detail: int = 0, problem: int = 0) -> list[int]:
    """One rank's record of a call of ``operation`` (one of :data:`OPERATIONS`) on a tensor of ``dtype``
    and ``shape``: what every rank's must match (``detail`` too), and its ``problem`` code."""
    row = [OPERATIONS.index(operation), _DTYPE_INDEX[dtype], detail, problem, len(shape),
           *(shape if len(shape) <= _MAX_DIMS else ())]
    return row + [-1] * (_RECORD_LEN - len(row))


def read(row: Sequence[int]) -> Call:
    """The fields of a :func:`record`."""
    return Call(OPERATIONS[row[_OP]], _DTYPES[row[_DTYPE]], list(row[_SHAPE: _SHAPE + row[_NDIM]]), row[_DETAIL],
                row[_PROBLEM])


def problem_code(shape: Sequence[int], size: int, *, op: str | None = None, algorithm: str | None = None,
                 root: int | None = None) -> int:
    """The code of what is wrong with a rank's arguments (0: nothing), for its record: an ``op``
    not in ``REDUCE_OPS``, an ``algorithm`` not in ``ALLREDUCE_ALGORITHMS``, a ``root`` outside a
    group of ``size``, or a tensor of too many dimensions to record."""
    if op is not None and op not in REDUCE_OPS:
        return _BAD_OP
    if algorithm is not None and algorithm not in ALLREDUCE_ALGORITHMS:
        return _BAD_ALGORITHM
    if root is not None and not 0 <= root < size:
        return _BAD_ROOT
    return _TOO_MANY_DIMS if len(shape) > _MAX_DIMS else 0


def reduction_detail(op: str, beside: int = 0) -> int:
    """A record's detail for a reduction with ``op`` and ``beside`` it what else must match (a reduce's
    root, an allreduce's algorithm), as one number. An unknown op counts as the first: its problem
    code reports it."""
    return REDUCE_OPS_INDEX.get(op, 0) + len(REDUCE_OPS) * beside


def reduction_of(detail: int) -> tuple[str, int]:
    """The op and what was beside it in a :func:`reduction_detail`."""
    beside, code = divmod(detail, len(REDUCE_OPS))
    return list(REDUCE_OPS)[code], beside


def compare(records: Mapping[int, Sequence[int]], operation: str, rank: int, size: int, *,
            ignore_first_dim: bool = False, problems_only: bool = False) -> None:
    """Judge every rank's :func:`record` of a call of ``operation`` (``records``: by rank, in rank order,
    of a group of ``size``) as every rank that holds them does, raising :func:`verdict`'s error as ``rank``."""
    rows = list(records.values())
    alike = {_comparable(row, ignore_first_dim) for row in rows} if not problems_only else set()
    if len(alike) <= 1 and all(row[_OP] != _JOIN and not row[_PROBLEM] for row in rows):
        return  # the usual case, without reading the records
    error = verdict({r: fields(row) for r, row in records.items()}, operation, rank, size,
                    ignore_first_dim=ignore_first_dim, problems_only=problems_only)
    if error is not None:
        raise error


def fields(row: Sequence[int]) -> dict[str, Any]:
    """A :func:`record` as the named fields :func:`verdict` judges (its detail read as op, root or algorithm)."""
    call = read(row)
    if call.operation == "join":
        return {"operation": "join"}
    named: dict[str, Any] = {"operation": call.operation, "dtypes": [call.dtype], "shapes": [call.shape],
                             "problem": call.problem}
    if call.operation in ("allreduce", "reduce", "reduce_scatter"):
        named["op"], beside = reduction_of(call.detail)
        if call.operation == "allreduce":
            named["algorithm"] = ALLREDUCE_ALGORITHMS[beside] if beside < len(ALLREDUCE_ALGORITHMS) else beside
        elif call.operation == "reduce":
            named["root"] = beside
    elif call.operation == "broadcast":
        named["root"] = call.detail
    elif call.detail:
        named["detail"] = call.detail
    return named


#: How collectives are matched across ranks, as :func:`verdict`'s advice says it.
BY_ORDER = "collectives are matched by the order of the calls"


def verdict(calls: Mapping[int, Mapping[str, Any]], operation: str, rank: int, size: int, *,
            label: str | None = None, joinable: Sequence[str] = ("allreduce",), ignore_first_dim: bool = False,
            problems_only: bool = False, matched: str = BY_ORDER) -> PhalanxError | None:
    """The error every rank raises for the ``calls`` of every rank of a group of ``size`` (by rank, in
    rank order) to ``operation``, worded for ``rank``; ``None`` where the call can go ahead.

    A call is named fields: its "operation" ("join" for a rank that has joined), its tensors' "dtypes"
    and "shapes" (lists, one entry per tensor), a "problem" code (0 or absent: none) and anything
    else that every rank must pass alike, by name (op, root, algorithm, scale factors...).

    A joined rank takes part only in the ``joinable`` operations: any other raises
    :class:`CollectiveMismatchError`. Otherwise the first invalid arguments raise
    :class:`ConfigurationError`, naming every rank that made them; then (unless ``problems_only``)
    calls that differ (shapes beyond dim 0 with ``ignore_first_dim``) raise
    :class:`CollectiveMismatchError` naming what differs and listing every rank's call. ``label`` names
    the call in the message (default: ``operation``); ``matched`` says how calls are matched.
    """
    label = label or operation
    joined = [r for r, call in calls.items() if call["operation"] == "join"]
    if joined and operation not in joinable:  # joined ranks add zeros to these, and take part in nothing else
        return CollectiveMismatchError(
            f"{label} on rank {rank}: rank(s) {joined} have joined (run out of data) and take part only in "
            f"{' and '.join(joinable)} until every rank has joined. Call {operation} before join(), or after it "
            "has returned on every rank.")
    active = {r: call for r, call in calls.items() if call["operation"] != "join"}
    problems = [(call.get("problem", 0), r) for r, call in active.items() if call.get("problem", 0)]
    if problems:
        code = problems[0][0]
        rule = _PROBLEMS[code].format(ops=sorted(REDUCE_OPS), algorithms=list(ALLREDUCE_ALGORITHMS), size=size,
                                      dims=_MAX_DIMS)
        ranks = [r for problem, r in problems if problem == code]
        return ConfigurationError(f"{label} on rank(s) {ranks} of {size}: {rule}.")
    return None if problems_only else _mismatch(active, label, rank, ignore_first_dim, matched)


_PER_TENSOR = ("dtypes", "shapes", "devices")  # a call's fields that hold one entry per tensor


def _mismatch(calls: Mapping[int, Mapping[str, Any]], label: str, rank: int, ignore_first_dim: bool,
              matched: str) -> CollectiveMismatchError | None:
    """Where the ``calls`` differ: what, and every rank's call."""
    if all(call == next(iter(calls.values())) for call in calls.values()):
        return None
    compared = {r: _agreed(call, ignore_first_dim) for r, call in calls.items()}
    first = next(iter(compared.values()), {})
    if all(call == first for call in compared.values()):
        return None
    keys = list(dict.fromkeys(key for call in compared.values() for key in call))
    differing = [key for key in keys if any(call.get(key) != first.get(key) for call in compared.values())]
    counts = {len(call.get("dtypes", ())) for call in calls.values()}
    if "operation" in differing or len(counts) > 1:
        differing = ["operation" if "operation" in differing else "number of tensors"]  # the rest follows from it
    names = [_label(key, counts == {1}, ignore_first_dim) for key in differing]
    shown = [key for key in differing if key not in ("operation", "number of tensors", "dtypes", "shapes")]
    described = "; ".join(f"rank {r}: {_described(call, shown)}" for r, call in calls.items())
    what = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return CollectiveMismatchError(f"{label} on rank {rank}: Mismatched {what}: {described}. Every rank must call it "
                                   f"with the same {what} ({matched}).")


def _agreed(call: Mapping[str, Any], ignore_first_dim: bool) -> dict[str, Any]:
    """What of ``call`` must agree across ranks: all but its problem code, shapes beyond dim 0 where rows may differ."""
    agreed = {key: value for key, value in call.items() if key != "problem"}
    if ignore_first_dim:
        agreed["shapes"] = [[len(shape), *shape[1:]] for shape in call.get("shapes", ())]
    return agreed


def _label(key: str, single: bool, ignore_first_dim: bool) -> str:
    """A field's name as an error says it: a single tensor's dtype or shape rather than a list of one."""
    name = key[:-1] if single and key in _PER_TENSOR else key
    return f"{name} beyond dim 0" if ignore_first_dim and key == "shapes" else name


def _described(call: Mapping[str, Any], shown: Sequence[str]) -> str:
    """A call as the user wrote it: ``allreduce(torch.float32, shape=[2, 3])``, with the ``shown`` fields."""
    dtypes, shapes = call.get("dtypes", []), call.get("shapes", [])
    if len(dtypes) == 1:
        tensors = [f"{dtypes[0]}, shape={list(shapes[0])}"]
    elif dtypes:
        tensors = [f"dtypes=[{', '.join(map(str, dtypes))}], shapes={[list(shape) for shape in shapes]}"]
    else:
        tensors = []
    single = len(dtypes) == 1
    extras = [f"{_label(key, single, False)}={call[key][0] if single and key in _PER_TENSOR else call.get(key)}"
              for key in shown]
    return f"{call['operation']}({', '.join(tensors + extras)})"


def refuse_scalar(tensor: torch.Tensor, operation: str, what: str) -> None:
    """Refuse a 0-dim tensor where dim 0 is split: it has no rows (the ranks agreed on its shape)."""
    if tensor.dim() == 0:
        raise ConfigurationError(f"{operation} needs a tensor with a dimension {what}, got a 0-dim one. Every rank "
                                 "raises this error; pass t.reshape(1).")


def _comparable(row: Sequence[int], ignore_first_dim: bool) -> tuple[int, ...]:
    return tuple(row[:_SHAPE]) + tuple(row[_SHAPE + 1:]) if ignore_first_dim else tuple(row)


class Agreeing(Routing):
    """How a generation's collectives run the check: the records gathered, or folded into shared memory."""

    def _agree(self, operation: str, tensor: torch.Tensor, detail: int, problem: int, check: bool,
               ignore_first_dim: bool = False) -> None:
        """Raise alike on every rank where any rank's arguments are wrong or the ranks' metadata differ.

        Without ``check`` (or alone) nothing is exchanged and only this rank's arguments are judged.
        """
        if check and self._size() > 1:
            self._compare(self._gather_records(operation, tensor, detail, problem), operation, ignore_first_dim)
        elif problem:  # its own record, judged alone
            compare({self._rank(): record(operation, tensor.dtype, tensor.shape, detail, problem)}, operation,
                    self.rank, self._size())

    def _agree_or_fold(self, operation: str, tensor: torch.Tensor, detail: int, problem: int, check: bool, folds: bool,
                       plan: Callable[[], wire.Reduction]) -> tuple[wire.Reduction, shm.Agreement | None]:
        """Agree on the call (:meth:`_agree`) and make its reduction ``plan``; or, where the reduction
        ``folds`` (it goes through this host's shared memory), return the check to travel with the
        data's first arrival instead of a round trip of its own. A rank whose arguments are wrong, or
        whose dtype cannot be reduced, checks alone first (one arrival too) and so raises what every
        rank raises: the others judge its record in their first arrival."""
        if not (folds and check and problem == 0 and self._size() > 1):
            self._agree(operation, tensor, detail, problem, check)
            return plan(), None
        try:
            made = plan()
        except PhalanxError:
            self._agree(operation, tensor, detail, problem, check)
            raise
        return made, (record(operation, tensor.dtype, tensor.shape, detail, problem),
                      lambda rows: self._judge(rows, operation))

    def _judge(self, rows: list[list[int]], operation: str) -> bool:
        """A folded check's verdict on every rank's record: raise as :meth:`_agree` does; False where a
        rank has joined (it sent its record alone: the data must go again, with its zeros)."""
        self._compare(rows, operation, ignore_first_dim=False)
        return all(row[_OP] != _JOIN for row in rows)

    def _gather_records(self, operation: str, tensor: torch.Tensor, detail: int = 0, problem: int = 0) -> list[list[int]]:
        """Every rank's record of this call, in rank order."""
        row = record(operation, tensor.dtype, tensor.shape, detail, problem)
        if self._size() == 1:
            return [row]
        shared = self._one_host_executor()
        if shared is not None:  # through shared memory, in order with the allreduces queued there
            with self.translate_errors(f"{operation} (metadata check)"):
                return shared.run(lambda: shared.group.gather_records(row))
        rows = torch.empty(self._size() * _RECORD_LEN, dtype=torch.int64)
        with self.translate_errors(f"{operation} (metadata check)"):
            _all_gather_single(rows, torch.tensor(row, dtype=torch.int64), group=self._group(None))
        return rows.view(self._size(), _RECORD_LEN).tolist()

    def _compare(self, rows: list[list[int]], operation: str, ignore_first_dim: bool, problems_only: bool = False) -> None:
        """:func:`compare` of the gathered ``rows``, raising as this rank."""
        compare(dict(enumerate(rows)), operation, self.rank, self._size(), ignore_first_dim=ignore_first_dim,
                problems_only=problems_only)
