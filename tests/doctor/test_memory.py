"""The doctor's memory figures: the per-level prediction (strategies/base.held_per_worker) against
what px.Sharded holds, counted in-test at 2 workers as benchmarks/bench_shard.py counts and as
that benchmark recorded at 2 and 4 workers; the doctor's own count against the benchmark's; the
lowest level that fits a host of a given memory; and the section in the report and the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.doctor import footprint, report
from phalanx.doctor.diagnosis import diagnose_records
from phalanx.doctor.memory import HOST_SHARE, MeasuredMemory, predict
from phalanx.doctor.predict import Layout
from phalanx.strategies.base import held_per_worker
from tests.doctor import records as fake
from tests.harness import run_workers

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shard.py"

#: bench_shard's variants: (sharding level, units in host shared memory).
VARIANTS = {"px": (0, False), "s1": (1, True), "s2": (2, True), "s3": (3, True),
            "s1x": (1, False), "s2x": (2, False), "s3x": (3, False)}

#: benchmarks/RESULTS.md, "Sharded data parallelism: memory and speed": held after a step, bytes per
#: parameter of the MLP, Adam in float32, at 2 and 4 workers.
RECORDED = {2: {"px": 16.00, "s1": 10.00, "s2": 6.00, "s3": 6.00, "s1x": 12.00, "s2x": 8.00, "s3x": 6.00},
            4: {"px": 16.00, "s1": 7.00, "s2": 3.00, "s3": 3.00, "s1x": 10.00, "s2x": 6.00, "s3x": 3.00}}

TOLERANCE = 0.10  # the issue's: the prediction within 10 % of the benchmark


def test_the_prediction_is_what_the_sharding_benchmark_recorded() -> None:
    for workers, recorded in RECORDED.items():
        for variant, per_parameter in recorded.items():
            level, shared = VARIANTS[variant]
            predicted = held_per_worker(4.0, 8.0, level, workers, shared).total  # Adam: 4 B of weights, 8 of state
            assert predicted == pytest.approx(per_parameter, rel=TOLERANCE), (workers, variant)


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_shard", BENCHMARK)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _held_after_steps(bench: Any, variant: str) -> dict[str, Any]:
    """An MLP of 85 k parameters trained 2 Adam steps by ``variant``, then this rank's bytes counted by
    the benchmark's code and by the doctor's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped, optimizer, strategy, _ = bench.set_up(variant, model)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(2):  # the first step settles the buckets' order
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    sizes = bench.held(variant, wrapped, optimizer)
    counted = {kind: bench._own(sizes, kind, px.size()) for kind in ("params", "grads", "state")}
    doctor, _ = footprint.held(getattr(optimizer, "stepping", optimizer), [wrapped])
    if strategy is not None:
        strategy.finish()
    return {"bench": counted, "doctor": doctor, "weights": weights}


def _at_each_variant() -> dict[str, dict[str, Any]]:
    bench = _bench()
    return {variant: _held_after_steps(bench, variant) for variant in VARIANTS}


def test_the_prediction_matches_what_each_level_holds_at_two_workers_and_the_doctor_counts_as_the_benchmark() -> None:
    for rank in run_workers(_at_each_variant, 2):
        for variant, found in rank.items():
            level, shared = VARIANTS[variant]
            weights, counted, doctor = found["weights"], found["bench"], found["doctor"]
            predicted = held_per_worker(weights, 2 * weights, level, 2, shared)
            pairs = {"params": predicted.parameters, "grads": predicted.gradients, "state": predicted.optimizer_state}
            for kind, expected in pairs.items():
                assert counted[kind] == pytest.approx(expected, rel=TOLERANCE, abs=0.01 * weights), (variant, kind)
            assert sum(counted.values()) == pytest.approx(predicted.total, rel=TOLERANCE), variant
            assert (doctor["parameters"], doctor["gradients"], doctor["optimizer_state"]) == \
                pytest.approx((counted["params"], counted["grads"], counted["state"])), variant
            assert (doctor["level"], doctor["shared"], doctor["trained_bytes"]) == (level, shared, weights), variant


N = 1_000_000  # parameters of a made-up model, Adam in float32


def _measured(elastic: bool = False) -> MeasuredMemory:
    """A run of 4 workers on one host that held 16 B a parameter and saved 1 B a parameter of activations
    in a forward of 64 samples."""
    return MeasuredMemory(parameters=4 * N, gradients=4 * N, step_gradients=4 * N, optimizer_state=8 * N,
                          strategy=0.0, activations=N, activation_samples=64, parameter_count=N, weights=4 * N, state=8 * N,
                          level=0, shared=False, elastic=elastic, world_size=4, copies=12 * N, host_memory=None)


def test_the_lowest_level_that_fits_the_given_host_memory_is_recommended() -> None:
    """At the step, with 1 B/param of activations: on one host of 4 workers 17 B/param unsharded, 8 at
    levels 1-3 (units in shared memory, the step's gradient buckets whole); 16 workers across hosts of 4:
    17, then 8 at levels 1-2 (one copy per host, px.Sharded's default there: it holds less than the
    9.5 of sharding across the hosts) and 5.75 at level 3; an elastic job shards across hosts: 9.5."""
    layouts = [Layout(4, 4), Layout(16, 4)]

    def lowest(budget_per_parameter: float, elastic: bool = False) -> list[int | None]:
        host = int(budget_per_parameter * N * 4 / HOST_SHARE)  # a host whose 4 workers each may hold that
        rows = predict(_measured(elastic), layouts, [64, 64], host_memory=host)
        assert all(row.budget == pytest.approx(budget_per_parameter * N, rel=1e-6) for row in rows)
        return [row.lowest_fitting for row in rows]

    assert lowest(20) == [0, 0]
    assert lowest(12) == [1, 1]
    assert lowest(8.5) == [1, 1]
    assert lowest(7) == [None, 3]
    assert lowest(5) == [None, None]
    assert lowest(20, elastic=True) == [1, 1]  # a whole copy of weights and state (12 B/param) on top unsharded
    assert lowest(12, elastic=True) == [None, 3]  # copies 6 / 3 on top; level 1 across hosts 9.5 + 3 (no replicas)
    unknown = predict(_measured(), layouts, [64, 64])
    assert [row.lowest_fitting for row in unknown] == [None, None] and unknown[0].levels[0].fits is None


def _with_memory(record: dict[str, Any], level: int) -> dict[str, Any]:
    """A fake record with the tensors a worker of 1,000 parameters counted (2 workers, Adam)."""
    shared = level > 0
    record["host"]["memory_bytes"] = 8 * 2**30
    record["memory"] = {"parameters": 2000 if shared else 4000, "gradients": 4000 if level <= 1 else 0,
                        "step_gradients": 4000, "optimizer_state": 8000 if level == 0 else 4000, "activations": 3200,
                        "activation_samples": 32, "trained_bytes": 4000, "parameter_count": 1000, "level": level,
                        "shared": shared, "elastic": False, "device": "cpu"}
    return record


def test_the_report_and_the_json_have_the_memory_section() -> None:
    diagnosis = diagnose_records([_with_memory(fake.record(rank), 2) for rank in range(2)],
                                 [fake.record(0, world=1, local=1, samples=64)], [])
    found = json.loads(json.dumps(diagnosis.as_dict()))["memory"]
    measured = found["measured"]
    assert measured["bytes_per_parameter"]["parameters"] == 2.0 and measured["optimizer_state_whole_bytes"] == 8000
    assert measured["copies_bytes"] == 2 * (4000 + 8000) / 2 and measured["copies_if_elastic"] is True
    rows = {(row["world_size"], row["workers_per_host"]): row for row in found["predicted"]}
    assert rows[(1, 1)]["activations_bytes"] == 2 * rows[(2, 2)]["activations_bytes"] == 6400
    assert [level["held_bytes"] for level in rows[(2, 2)]["levels"]] == [16000, 10000, 6000, 6000]
    assert found["recommended_level"] == 0 and rows[(2, 2)]["budget_bytes"] == HOST_SHARE * 8 * 2**30 / 2
    text = report.render(diagnosis, "train.py")
    assert "Memory per worker, px.Sharded(level=2), units in host shared memory" in text
    assert "recommended at 2 worker(s): px.DataParallel, the lowest level that fits (this run: px.Sharded(level=2))" \
        in text
    assert diagnose_records([fake.record(rank) for rank in range(2)], None, []).as_dict()["memory"] is None
