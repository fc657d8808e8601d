"""Every collective on awkward inputs, on both transports: every dtype torch has; tensors that need
grad, non-contiguous, zero-sized and 0-dim ones; arguments that are wrong on one rank only. Each call
gives the right result on every rank (the same bits as a reference computed here from every rank's
input), or the same phalanx error on every rank; and the ranks stay in step for the next call.

One group of 2 workers per transport runs every case in a loop, each followed by an allreduce of its
index that must give the right sum (the ranks are still in step)."""

from __future__ import annotations

import pathlib
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.comm import runtime, shm
from tests.harness import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental",
                                        "ignore:torch.quantize_per_tensor")
WORLD = 2
OPS = ("sum", "avg", "min", "max", "product")
ALGORITHMS = ("ring", "tree", "halving_doubling")
QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))
#: What every collective reduces exactly (complex: sum and avg only); everything but quantized moves.
REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
             torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32,
             torch.uint32, torch.int64, torch.uint64)
INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Key = tuple[str, str, str, str, str]  # collective, dtype, layout, op, algorithm


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh [2, 6] tensor of small integers (exact in every dtype, as are their sums and products)."""
    base = torch.tensor([[1, 2, 3, 0, 1, 2], [2, 1, 0, 3, 1, 1]]) + rank
    if dtype in QUANTIZED:
        return torch.quantize_per_tensor(base.float(), 1.0, 0, dtype)
    try:
        return base.to(dtype)
    except (RuntimeError, NotImplementedError):  # bit and sub-byte dtypes: no conversion, only a view
        return base.to(INTEGER_OF_SIZE[dtype.itemsize]).view(dtype)


def _extreme(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers at the dtype's limits: sums and products wrap, int64 sums are beyond float64's 2**53."""
    info = torch.iinfo(dtype)
    return torch.tensor([[info.max - rank, info.min + rank], [info.max // 3 + 7 * rank, 3 + rank]], dtype=dtype)


def _input(rank: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    values = _values(rank, dtype)
    return {
        "contiguous": lambda: values, "strided": lambda: values[:, ::2], "transposed": lambda: values.t(),
        "empty": lambda: values[:0], "scalar": lambda: values[1, 2], "single": lambda: values[0, :1],
        "parameter": lambda: torch.nn.Parameter(values), "grad_view": lambda: values.requires_grad_()[:, ::2],
        "extreme": lambda: _extreme(rank, dtype),
    }[layout]()


def _layouts(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype not in REDUCIBLE:
        return ("contiguous",) if dtype in QUANTIZED or dtype.itemsize == 1 else ("contiguous", "strided")
    grad = ("parameter", "grad_view") if dtype.is_floating_point or dtype.is_complex else ()
    extreme = ("extreme",) if dtype != torch.bool and not (dtype.is_floating_point or dtype.is_complex) else ()
    return ("contiguous", "strided", "transposed", "empty", "scalar", "single", *grad, *extreme)


def _keys() -> Iterator[Key]:
    """Every case, in the same order on every rank."""
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for layout in _layouts(dtype):
            for op in OPS if dtype in REDUCIBLE else ("sum",):
                yield "allreduce", name, layout, op, "backend"
                if layout in ("strided", "extreme", "parameter"):
                    yield "allreduce_async", name, layout, op, "backend"
                    yield from (("allreduce", name, layout, op, algorithm) for algorithm in ALGORITHMS)
            for collective in ("allreduce_", "reduce", "reduce_", "reduce_scatter", "broadcast", "broadcast_",
                               "allgather", "alltoall"):
                yield collective, name, layout, "sum", "backend"
    for bad in ("op", "algorithm", "root", "splits", "pickle_root", "pickle_any", "safe_root", "safe_any"):
        yield "wrong_on_rank_1", "float32", "contiguous", bad, "backend"


def _call(key: Key, x: torch.Tensor) -> Any:
    collective, _, _, op, algorithm = key
    return {
        "allreduce": lambda: px.allreduce(x, op, algorithm=algorithm),
        "allreduce_": lambda: px.allreduce_(x, op, algorithm=algorithm),
        "allreduce_async": lambda: px.allreduce(x, op, async_op=True).wait(),
        "reduce": lambda: px.reduce(x, root=1, op=op), "reduce_": lambda: px.reduce_(x, root=1, op=op),
        "reduce_scatter": lambda: px.reduce_scatter(x, op), "broadcast": lambda: px.broadcast(x, root=1),
        "broadcast_": lambda: px.broadcast_(x, root=1), "allgather": lambda: px.allgather(x),
        "alltoall": lambda: px.alltoall(x), "wrong_on_rank_1": lambda: _wrong_on_rank_1(op, x),
    }[collective]()


def _wrong_on_rank_1(what: str, x: torch.Tensor) -> Any:
    """A call whose arguments only rank 1 gets wrong: rank 0 must not hang or go on alone."""
    wrong = px.rank() == 1
    return {
        "op": lambda: px.allreduce(x, "mean" if wrong else "sum"),
        "algorithm": lambda: px.allreduce(x, algorithm="butterfly" if wrong else "ring"),
        "root": lambda: px.broadcast(x, root=5 if wrong else 0),
        "splits": lambda: px.alltoall(x, splits=[2, 1] if wrong else [1, 1]),
        "pickle_root": lambda: px.broadcast_object((lambda: 0) if wrong else None, root=1),
        "pickle_any": lambda: px.allgather_object((lambda: 0) if wrong else 0),
        # picklable, but not what torch.load(weights_only=True) reads: refused by the safe codec
        "safe_root": lambda: px.broadcast_object(pathlib.PurePosixPath("x") if wrong else None, root=1, safe=True),
        "safe_any": lambda: px.allgather_object(pathlib.PurePosixPath("x") if wrong else 0, safe=True),
    }[what]()


def _bits(tensor: torch.Tensor | None) -> tuple | None:
    """A tensor's dtype, shape, whether it needs grad, and bytes: equal bits, not just close values."""
    if tensor is None:
        return None
    plain = tensor.detach()
    plain = plain.int_repr() if plain.is_quantized else plain
    plain = plain.view(INTEGER_OF_SIZE[plain.itemsize]) if plain.itemsize in INTEGER_OF_SIZE else plain
    data = plain.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad, data


def _outcome(key: Key) -> tuple:
    """("ok", result's bits, whether it is the input itself, whether the input kept its bits (None
    where it receives the result)) or ("raise", error type, message)."""
    x = _input(px.rank(), getattr(torch, key[1]), key[2])
    before = _bits(x)
    try:
        result = _call(key, x)
    except Exception as error:  # noqa: BLE001 - compared across ranks by the test
        return "raise", type(error).__name__, str(error)
    return "ok", _bits(result), result is x, None if key[0].endswith("_") else _bits(x) == before


def _in_step(index: int) -> bool | str:
    try:
        total = px.allreduce(torch.tensor([index, px.rank()]), check=False)  # out of step: a wrong sum
    except Exception as error:  # noqa: BLE001 - out of step, ranks can even read garbage records
        return f"{type(error).__name__}: {error}"
    return total.tolist() == [WORLD * index, sum(range(WORLD))] or f"got {total.tolist()}"


def _every_case(transport: str) -> list[tuple[Key, tuple, bool | str]]:
    """Each case's key, outcome and whether the ranks were in step after it, on ``transport``."""
    if transport == "gloo":
        px.shutdown()
        px.init(transport="gloo")
    assert runtime.shares_one_host() == (transport == "shm")
    outcomes = []
    for index, key in enumerate(_keys()):
        outcomes.append((key, _outcome(key), _in_step(index)))
        if outcomes[-1][2] is not True:
            break  # out of step: what follows would only wait for the timeout
    return outcomes


# --- the reference, from every rank's input --------------------------------------------------


def _reduced(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype.is_floating_point or dtype.is_complex:  # exact: small integers and halves
        wide = torch.stack([t.detach().to(torch.complex128 if dtype.is_complex else torch.float64) for t in tensors])
        return {"sum": lambda: wide.sum(0), "avg": lambda: wide.mean(0), "min": lambda: wide.min(0).values,
                "max": lambda: wide.max(0).values, "product": lambda: wide.prod(0)}[op]().to(dtype)
    arrays = np.stack([t.numpy() for t in tensors])  # numpy wraps as the dtype's own arithmetic does
    reduced = {"sum": lambda: arrays.sum(0, dtype=arrays.dtype), "product": lambda: arrays.prod(0, dtype=arrays.dtype),
               "min": lambda: arrays.min(0), "max": lambda: arrays.max(0)}[op]()
    return torch.from_numpy(np.array(reduced))  # 0-dim stays 0-dim


def _expected(key: Key, rank: int) -> tuple:
    """What rank ``rank`` must see: ("ok", bits, is the input, input kept) or ("raise", error type)."""
    collective, name, layout, op, _ = key
    dtype = getattr(torch, name)
    inputs = [_input(r, dtype, layout) for r in range(WORLD)]
    mine = inputs[rank]
    if _refused(collective, dtype, op, mine):
        return "raise", "ConfigurationError"
    in_place = collective.endswith("_")
    result = _result(collective, op, inputs, rank)
    bits = None if result is None else (str(dtype), tuple(result.shape), in_place and mine.requires_grad,
                                        _bits(result)[3])
    return "ok", bits, in_place and result is not None, None if in_place else True


def _refused(collective: str, dtype: torch.dtype, op: str, tensor: torch.Tensor) -> bool:
    if collective == "wrong_on_rank_1":
        return True
    if collective.startswith(("allreduce", "reduce")):
        if dtype not in REDUCIBLE or (dtype.is_complex and op in ("min", "max", "product")):
            return True
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            return True
    return dtype in QUANTIZED or (collective in ("reduce_scatter", "alltoall") and tensor.dim() == 0) or \
        (collective == "alltoall" and tensor.shape[0] % WORLD != 0)


def _result(collective: str, op: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor | None:
    rows = [t.detach().reshape(1) if t.dim() == 0 else t.detach() for t in inputs]
    return {
        "allreduce": lambda: _reduced(op, inputs), "allreduce_": lambda: _reduced(op, inputs),
        "allreduce_async": lambda: _reduced(op, inputs),
        "reduce": lambda: _reduced(op, inputs) if rank == 1 else None,
        "reduce_": lambda: _reduced(op, inputs) if rank == 1 else None,
        "reduce_scatter": lambda: torch.tensor_split(_reduced(op, inputs), WORLD)[rank],
        "broadcast": lambda: inputs[1], "broadcast_": lambda: inputs[1],
        "allgather": lambda: _concatenated(rows),
        "alltoall": lambda: _concatenated([torch.tensor_split(t, WORLD)[rank] for t in rows]),
    }[collective]()


def _concatenated(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` by bytes: it has no kernel for some dtypes (sub-byte ones)."""
    as_bytes = [t.view(torch.uint8) if t.itemsize == 1 else t.view(INTEGER_OF_SIZE.get(t.itemsize, t.dtype))
                for t in tensors]
    return torch.cat(as_bytes).view(tensors[0].dtype)


# --- the test --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_every_collective_gives_the_right_result_or_the_same_error_on_every_rank(transport: str) -> None:
    if transport == "shm" and not shm.available():
        pytest.skip("no /dev/shm here")
    runs = run_workers(_every_case, WORLD, transport, timeout=120, collective_timeout=10)
    failures: list[str] = []
    for cases in zip(*runs):
        failures += _judge(cases[0][0], [outcome for _, outcome, _ in cases], [step for _, _, step in cases])
    total = len(list(_keys()))
    if min(map(len, runs)) < total:
        failures.append(f"the ranks stopped after {[len(run) for run in runs]} of {total} cases")
    assert not failures, f"{transport}: {len(failures)} failures:\n" + "\n".join(failures[:20])


def _judge(key: Key, outcomes: list[tuple], in_step: list[bool | str]) -> list[str]:
    """What is wrong with one case's outcome on every rank: nothing, or a line per fault."""
    failures = [f"{key}: rank {r} out of step after it: {step}" for r, step in enumerate(in_step) if step is not True]
    expected = [_expected(key, rank) for rank in range(WORLD)]
    if expected[0][0] == "raise":
        if [outcome[:2] for outcome in outcomes] != expected or outcomes[0][2] != outcomes[1][2]:
            failures.append(f"{key}: expected the same {expected[0][1]} on every rank, got {outcomes}")
        return failures
    for rank, (got, want) in enumerate(zip(outcomes, expected)):
        if got != want:
            failures.append(f"{key}: rank {rank} got {_short(got)}, expected {_short(want)}")
    return failures


def _short(outcome: tuple) -> str:
    return str(outcome)[:400]
