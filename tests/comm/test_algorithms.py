"""phalanx's own allreduce algorithms (ring, tree, recursive halving-doubling) give the backend's
result, bitwise the same on every rank, for every op and dtype, odd sizes and empty tensors."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.comm.algorithms import ALGORITHMS
from phalanx.errors import CollectiveMismatchError
from tests.harness import run_workers

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
SIZES = (0, 1, 2, 3, 7, 1000, 4099)


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(1, 4, (numel,), generator=generator).to(dtype)


def _reference(world: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    stacked = torch.stack([_input(r, numel, dtype).double() for r in range(world)])
    reduced = {"sum": stacked.sum(0), "avg": stacked.mean(0), "min": stacked.min(0).values,
               "max": stacked.max(0).values, "product": stacked.prod(0)}[op]
    return reduced


def _all_results() -> dict:
    out = {}
    for algorithm in ALGORITHMS:
        for dtype in DTYPES:
            for numel in SIZES:
                for op in ("sum", "avg", "min", "max", "product"):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    tensor = _input(px.rank(), numel, dtype)
                    out[(algorithm, dtype, numel, op)] = px.allreduce(tensor, op, algorithm=algorithm)
        shaped = _input(px.rank(), 24, torch.float32).view(2, 3, 4).transpose(0, 2)  # not contiguous
        out[(algorithm, "shaped")] = px.allreduce_(shaped, "sum", algorithm=algorithm)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_algorithm_op_dtype_and_size_gives_the_reference(world_size: int) -> None:
    results = run_workers(_all_results, world_size)
    for key, got in results[0].items():
        for rank in range(1, world_size):
            assert torch.equal(results[rank][key], got), (key, rank)  # bitwise the same everywhere
        if key[1] == "shaped":
            expected = sum(_input(r, 24, torch.float32) for r in range(world_size)).view(2, 3, 4).transpose(0, 2)
            torch.testing.assert_close(got, expected)
            assert got.shape == (4, 3, 2)
            continue
        algorithm, dtype, numel, op = key
        expected = _reference(world_size, numel, dtype, op)
        assert got.dtype == dtype and got.shape == (numel,)
        if dtype.is_floating_point:
            tolerance = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-5)
            torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance, msg=str(key))
        else:
            assert torch.equal(got, expected.to(dtype)), key


def _mismatched_algorithms() -> str:
    try:
        px.allreduce(torch.ones(8), algorithm="ring" if px.rank() == 0 else "tree")
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_ranks_choosing_different_algorithms_get_a_mismatch_error() -> None:
    messages = run_workers(_mismatched_algorithms, 2)
    for message in messages:
        assert "Mismatched algorithm: rank 0: allreduce(torch.float32, shape=[8], algorithm=ring); " \
               "rank 1: allreduce(torch.float32, shape=[8], algorithm=tree)" in message, message


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(px.ConfigurationError, match="algorithm must be one of"):
        px.allreduce(torch.ones(2), algorithm="butterfly")


def test_the_cost_model_prefers_few_messages_when_small_and_few_bytes_when_large() -> None:
    from phalanx.comm.cost import Link, choose, predict

    link = Link(alpha_s=50e-6, beta_s_per_byte=1e-9)  # 50 us, 1 GB/s
    assert choose(4 << 10, 8, link, ("ring", "tree")) == "tree"  # 6 latencies against the ring's 14
    assert choose(64 << 20, 8, link, ("ring", "tree")) == "ring"  # moves 2(p-1)/p n, not 2 log2(p) n
    assert choose(4 << 10, 8, link, ("ring", "tree", "halving_doubling")) == "halving_doubling"  # both
    assert predict("ring", 1 << 20, 4, link) == pytest.approx(6 * 50e-6 + 2 * 0.75 * (1 << 20) * 1e-9)
    assert predict("halving_doubling", 1 << 20, 3, link) > predict("halving_doubling", 1 << 20, 4, link)
    assert predict("tree", 123, 1, link) == 0.0


def test_auto_weighs_the_backends_own_ring_by_its_own_figures() -> None:
    from phalanx.comm.cost import Link, choose_with_backend

    slow_messages = Link(alpha_s=2e-3, beta_s_per_byte=1e-9, backend=Link(alpha_s=50e-6, beta_s_per_byte=1e-9))
    assert choose_with_backend(4 << 10, 4, slow_messages) == "backend"  # loopback here: Python messages are slow
    alike = Link(alpha_s=50e-6, beta_s_per_byte=1e-9)  # no figures of its own: the backend is the ring
    assert choose_with_backend(4 << 10, 8, alike) == "halving_doubling"
    assert choose_with_backend(64 << 20, 2, alike) == "backend"


def _auto_over_messages() -> tuple[float, float, list[str], list[float], float]:
    from phalanx.comm import collectives

    tensors = [torch.full((n,), float(px.rank() + 1)) for n in (1, 1000, 300_000)]
    chosen = [px.communicator().cheapest_algorithm(tensor) for tensor in tensors]  # what "auto" runs without shared memory
    results = [float(px.allreduce(tensor, algorithm=name)[0]) for tensor, name in zip(tensors, chosen)]
    measured = collectives.link()
    return measured.alpha_s, measured.beta_s_per_byte, chosen, results, measured.backend.alpha_s


def test_auto_measures_the_link_once_and_every_rank_agrees() -> None:
    results = run_workers(_auto_over_messages, 3)
    assert len({(alpha, beta, tuple(chosen)) for alpha, beta, chosen, *_ in results}) == 1  # rank 0's figures
    assert all(alpha > 0 for alpha, *_ in results)
    assert all(backend_alpha > 0 for *_, backend_alpha in results)
    assert all(values == [6.0, 6.0, 6.0] for _, _, _, values, _ in results)


def _links_of_two_generations() -> tuple[bool, int, bool, int]:
    from phalanx.comm import collectives, runtime

    collectives.measure_link()
    before = (collectives.link() is not None, len(runtime.links()))
    px.shutdown()
    px.init()  # a new group: it must measure its own link, never inherit the old group's by id
    return (*before, collectives.link() is not None, len(runtime.links()))


def test_a_new_group_starts_without_the_old_groups_measured_link() -> None:
    assert run_workers(_links_of_two_generations, 2) == [(True, 1, False, 0)] * 2


def _reduce_scatters() -> dict:
    """The exchanged reduce-scatter, which the shared-memory reduce-scatter runs between hosts."""
    import torch.distributed as dist

    from phalanx.comm import algorithms

    out = {}
    for dtype in (torch.float64, torch.int64, torch.float32):
        for numel in (0, 1, 7, 1001, 1003):  # 1003: chunks of unequal lengths (torch.tensor_split's)
            for op in ("sum", "max", "product"):
                whole = _input(px.rank(), numel, dtype)
                chunks = whole.tensor_split(px.size())
                got = algorithms.reduce_scatter(chunks, op, dist.group.WORLD)
                assert torch.equal(whole, _input(px.rank(), numel, dtype)), "the input was changed"
                out[("reduce_scatter", dtype, numel, op)] = got
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_exchanged_reduce_scatter_gives_each_rank_its_reduced_chunk(world_size: int) -> None:
    """The cross-host step of the shared-memory reduce-scatter: rank r ends with chunk r reduced
    (torch.tensor_split's chunks), the input untouched."""
    results = run_workers(_reduce_scatters, world_size)
    for key in results[0]:
        if key[0] == "reduce_scatter":
            _, dtype, numel, op = key
            expected = _reference(world_size, numel, dtype, op).tensor_split(world_size)
            for rank in range(world_size):
                got = results[rank][key]
                assert got.dtype == dtype and got.shape == expected[rank].shape
                torch.testing.assert_close(got.double(), expected[rank], rtol=1e-5, atol=1e-5, msg=str(key))
