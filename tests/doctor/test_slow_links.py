"""The doctor under strategies that communicate every few steps, and its advice over slow links.

A px.DiLoCo run's steps with an exchange are measured among their own kind and weighed by the
schedule; the report names the strategy and how often it communicates; at ``--bandwidth`` the
doctor recommends px.DiLoCo with the period that hides the link where px.DataParallel mostly waits
for it, and tells a run that already exchanges every few steps whether its period hides it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import phalanx as px
from phalanx.cli.doctor import collect
from phalanx.doctor import advice, predict, report
from phalanx.doctor.diagnosis import diagnose_records
from phalanx.doctor.measured import summarize
from phalanx.strategies.base import Exchanges
from tests.doctor import diloco, records as fake

QUIET_STEP = fake.DATA + fake.FORWARD + fake.BACKWARD + fake.OPTIMIZER


def test_a_diloco_run_counts_each_exchange_once_and_averages_it_over_the_period() -> None:
    # 16 timed steps after 1 warm-up: exchanges after steps 5, 10 and 15, so 3 in 16 where the schedule has 1 in 5
    run = summarize([fake.local_record(px.DiLoCo(period=5), rank, count=16, waited=0.1) for rank in range(2)])
    assert run.strategy == "px.DiLoCo(period=5)" and run.schedule == px.DiLoCo(period=5).exchanges()
    assert run.local_steps and run.exchanges == 3 and run.outliers == 0 and run.steps == 16
    assert run.exchange_wait_s == pytest.approx(0.1) and run.exchange_step_s == pytest.approx(0.1)
    assert run.exposed_comm_s == pytest.approx(0.1 / 5) and run.step_s == pytest.approx(QUIET_STEP + 0.1 / 5)
    assert run.bytes_per_step == pytest.approx(4_000_000 / 5) and run.model_bytes == 4_000_000
    assert run.other_s == pytest.approx(0.0, abs=1e-9) and run.buckets == ()


def test_streaming_fragments_started_in_one_step_and_merged_in_the_next_count_once() -> None:
    strategy = px.DiLoCo(period=10, fragments=2)  # delay 1: each merge waits in the step after its start
    run = summarize([fake.local_record(strategy, rank, count=30, waited=0.05, nbytes=2_000_000) for rank in range(2)])
    assert run.exchanges == 5 and run.exchange_wait_s == pytest.approx(0.05)  # the 6th merges after the window
    assert run.exposed_comm_s == pytest.approx(2 * 0.05 / 10) and run.bytes_per_step == pytest.approx(2 * 2e6 / 10)
    assert run.model_bytes == 4_000_000
    assert strategy.exchanges().describe().startswith("2 exchanges every 10 steps, each of 1/2 of the model")


def test_the_report_and_json_name_the_strategy_and_its_share_of_communicating_steps() -> None:
    diagnosis = diagnose_records([fake.local_record(px.DiLoCo(period=5), rank) for rank in range(2)], None, [0.1])
    text = report.render(diagnosis, "train.py")
    assert "Strategy: px.DiLoCo(period=5): 1 step in 5 communicates (the outer gradient" in text
    assert "Communication: px.DiLoCo(period=5) exchanged 4.00 MB 4 time(s) in the 20 timed steps" in text
    found = json.loads(json.dumps(diagnosis.as_dict()))
    measured = found["measured"]
    assert measured["strategy"] == "px.DiLoCo(period=5)" and measured["communicating_share"] == pytest.approx(0.2)
    what = px.DiLoCo(period=5).exchanges().what
    assert measured["schedule"] == {"period": 5, "fragments": 1, "delay": 0, "what": what}
    assert measured["exchange_wait_s"] == pytest.approx(0.1) and measured["exposed_comm_s"] == pytest.approx(0.02)
    check = found["slow_links"][0]
    assert (check["bandwidth_gbit"], check["world_size"], check["hidden"]) == (0.1, 4, False)
    assert "this run's period of 5 does not hide it" in check["verdict"]
    dataparallel = summarize([fake.record(rank) for rank in range(2)])
    assert dataparallel.strategy == "px.DataParallel" and dataparallel.schedule.describe() == "every step communicates"


def test_dataparallel_waiting_for_a_slow_link_is_told_the_diloco_period_that_hides_it() -> None:
    run = summarize([fake.record(rank) for rank in range(2)])  # 4 MB of gradients against 33 ms of compute
    model = predict.fit(run)
    layout = predict.Layout(4, 2, 0.1)  # two hosts like this one
    dataparallel = predict.predict(model, layout, 128)  # the measured batch per worker
    whole = predict.exchange_time(model, layout, 4_000_000)
    assert dataparallel.exposed_s > 0.5 * dataparallel.step_s and whole == pytest.approx(0.32, rel=0.02)
    found = {r.kind: r for r in advice.recommend(run, model, None, [advice.link_check(run, model, 0.1)])}
    period = advice.hiding_period(whole, dataparallel.work_s)
    assert period == 100 and whole / 100 <= 0.1 * dataparallel.work_s < whole / 50
    diloco_advice = found["diloco"]
    assert "strategy=px.DiLoCo(period=100)" in diloco_advice.action and "0.1 Gbit/s" in diloco_advice.action
    assert diloco_advice.step_s == pytest.approx(dataparallel.work_s + whole / 100)
    assert diloco_advice.gain == pytest.approx(dataparallel.step_s / diloco_advice.step_s) and diloco_advice.gain > 5
    assert "changes the optimization" in diloco_advice.note and "docs/strategies.md" in diloco_advice.note
    streaming = found["streaming"]  # fragments overlap the next inner step: faster still
    assert "px.DiLoCo(period=100, fragments=" in streaming.action and streaming.step_s < diloco_advice.step_s
    # a fast link: the allreduce hides behind backward
    fast = advice.recommend(run, model, None, [advice.link_check(run, model, 100.0)])
    assert not any(r.kind in ("diloco", "streaming") for r in fast)


def test_a_compute_bound_run_gets_no_diloco_and_a_diloco_run_hears_whether_its_period_hides_the_link() -> None:
    slow = diagnose_records([fake.record(rank, compute_scale=30) for rank in range(2)], None, [0.1])
    assert slow.slow_links and not slow.slow_links[0].dominated
    assert not any(r.kind in ("diloco", "streaming") for r in slow.recommendations)
    run = diagnose_records([fake.local_record(px.DiLoCo(period=5), rank, waited=0.001) for rank in range(2)], None,
                           [0.1, 10.0])
    at_slow, at_fast = run.slow_links
    assert not at_slow.hidden and at_fast.hidden and "this run's period of 5 hides it" in at_fast.verdict()
    longer = [r for r in run.recommendations if r.kind == "period"]
    assert len(longer) == 1 and longer[0].action.startswith(f"px.DiLoCo(period={at_slow.period})")
    then = predict.predict(replace(run.model, schedule=Exchanges(at_slow.period)), at_slow.layout, 128)
    assert longer[0].step_s == pytest.approx(then.step_s)
    assert longer[0].gain == pytest.approx(at_slow.step_s / then.step_s)


def test_the_doctor_names_a_diloco_script_and_measures_its_exchanges() -> None:
    records = collect(str(Path(diloco.__file__)), [], 2, steps=8, warmup=2)  # exchanges after steps 4 and 8
    diagnosis = diagnose_records(records, None, [0.1])
    run = diagnosis.measured
    assert run.strategy == f"px.DiLoCo(period={diloco.PERIOD})" and run.schedule.period == diloco.PERIOD
    assert run.exchanges >= 1 and run.exchange_bytes > 0 and run.model_bytes == 4 * (32 * 64 + 64 + 64 * 4 + 4)
    rendered = report.render(diagnosis, str(diloco.__file__))
    assert f"1 step in {diloco.PERIOD} communicates" in rendered
    # memory, counted before the first outer step: beside the model, its gradients and SGD (no state),
    # DiLoCo's exchange buffer (the weights and a trailer) and the parameters of the last outer step
    memory = diagnosis.memory.measured
    assert memory.optimizer_state == 0 and memory.strategy == run.exchange_bytes + run.model_bytes, memory
    assert memory.total == memory.parameters + memory.gradients + memory.strategy
    assert "strategy's own" in rendered
