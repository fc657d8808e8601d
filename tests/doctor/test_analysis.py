"""The doctor's analysis on recorded events: phases, predictions, causes, recommendations, the trace."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from phalanx.comm import cost
from phalanx.doctor import advice, noise, predict, report, trace
from phalanx.doctor.diagnosis import diagnose_records
from phalanx.doctor.measured import summarize
from tests.doctor import records as fake


def test_the_phases_of_a_step_are_recovered_from_its_events() -> None:
    run = summarize([fake.record(rank) for rank in range(2)])
    waited = sum(b[2] for b in fake.BUCKETS)
    assert run.step_s == pytest.approx(fake.DATA + fake.FORWARD + fake.BACKWARD + waited + fake.OPTIMIZER)
    assert (run.data_wait_s, run.forward_s, run.backward_s) == pytest.approx((fake.DATA, fake.FORWARD, fake.BACKWARD))
    assert (run.exposed_comm_s, run.optimizer_s, run.other_s) == pytest.approx((waited, fake.OPTIMIZER, 0.0), abs=1e-9)
    assert run.global_batch == 64 and run.bytes_per_step == sum(b[1] for b in fake.BUCKETS)
    assert [b.ready_s for b in run.buckets] == pytest.approx([s * fake.BACKWARD for s, _, _ in fake.BUCKETS])
    assert run.steps == 6


def test_the_global_batch_is_the_configured_one_and_a_short_last_batch_is_left_out() -> None:
    run = summarize([fake.record(rank, short_last=13) for rank in range(2)])  # the epoch's last: 26 samples
    full = summarize([fake.record(rank) for rank in range(2)])
    assert run.global_batch == 64 and run.short_batches == (26,) and run.steps == full.steps - 1
    assert run.step_s == pytest.approx(full.step_s) and run.compute_s == pytest.approx(full.compute_s)


def test_a_step_that_paid_for_an_epoch_end_is_left_out_of_the_timing() -> None:
    records = [fake.record(rank, count=8) for rank in range(2)]
    for record in records:  # 0.2 s of validation between the third and the fourth step
        cut = [i for i, event in enumerate(record["events"]) if event[0] == "step"][3]
        for event in record["events"][cut + 1:]:
            event[1] += 0.2
            if "started" in event[2]:
                event[2]["started"] += 0.2
    run, steady = summarize(records), summarize([fake.record(rank, count=8) for rank in range(2)])
    assert run.outliers == 1 and run.steps == steady.steps - 1
    assert run.step_s == pytest.approx(steady.step_s) and run.other_s == pytest.approx(0.0, abs=1e-9)


def test_the_model_reproduces_both_measured_configurations() -> None:
    run = summarize([fake.record(rank) for rank in range(2)])
    reference = summarize([fake.record(0, world=1, local=1, samples=64, compute_scale=1.7)])
    model = predict.fit(run, reference)
    assert predict.predict(model, predict.Layout(2, 2)).step_s == pytest.approx(run.step_s, rel=1e-6)
    assert predict.predict(model, predict.Layout(1, 1)).step_s == pytest.approx(reference.step_s, rel=1e-6)
    assert predict.unpredictable(model, predict.Layout(1, 1)) is None


def test_runs_that_disagree_predict_only_what_they_measured() -> None:
    run = [fake.record(rank) for rank in range(2)]
    faster = [fake.record(0, world=1, local=1, samples=64, compute_scale=0.6)]  # twice the batch in less time
    diagnosis = diagnose_records(run, faster, [])
    on_host = {p.layout.world_size for p in diagnosis.predictions if p.layout.hosts == 1}
    assert on_host == {1, 2}
    assert {layout.world_size for layout, _ in diagnosis.not_predicted} == {3, 4}
    assert not any(r.kind == "batch_size" for r in diagnosis.recommendations)
    measured = {p.layout.world_size: p.step_s for p in diagnosis.predictions if p.layout.hosts == 1}
    assert measured[1] == pytest.approx(diagnosis.reference.step_s) and measured[2] == pytest.approx(
        diagnosis.measured.step_s)


def test_across_hosts_the_buckets_cost_what_the_alpha_beta_ring_says() -> None:
    model = predict.fit(summarize([fake.record(rank, world=2, local=1) for rank in range(2)]))
    link = cost.Link(2e-4, 8e-9 / 1.0)  # the measured ring latency, 1 Gbit/s
    expected = sum(cost.predict("ring", nbytes, 2, link) for _, nbytes, _ in fake.BUCKETS)
    assert predict.predict(model, predict.Layout(2, 1, 1.0)).comm_s == pytest.approx(expected)


def test_more_workers_than_cores_are_predicted_only_at_the_measured_count() -> None:
    model = predict.fit(summarize([fake.record(rank) for rank in range(2)]))
    assert "phalanx doctor -n WORKERS" in predict.unpredictable(model, predict.Layout(3, 3))
    crowded = summarize([fake.record(rank, world=4, local=4, samples=16) for rank in range(4)])
    model = predict.fit(crowded)  # 4 workers on 2 cores: each computes at half speed
    assert predict.unpredictable(model, predict.Layout(4, 4)) is None
    assert predict.predict(model, predict.Layout(4, 4)).step_s == pytest.approx(crowded.step_s, rel=1e-6)
    assert predict.predict(model, predict.Layout(2, 2)).work_s == pytest.approx(model.per_sample_s * 32)
    assert model.per_sample_s * 16 == pytest.approx((crowded.step_s - crowded.exposed_comm_s) / 2)


def test_an_oversubscribed_run_is_told_so_and_to_run_fewer_workers() -> None:
    run = [fake.record(rank, world=4, local=4, samples=4, wait_scale=3.0) for rank in range(4)]
    reference = [fake.record(0, world=1, local=1, samples=16, compute_scale=1.5)]  # 4x the samples, 1.5x the time
    diagnosis = diagnose_records(run, reference, [1.0])
    assert any(cause.startswith("oversubscription: 4 workers") for cause in diagnosis.causes)
    assert any(cause.startswith("per-step communication") for cause in diagnosis.causes)
    first = next(r for r in diagnosis.recommendations if r.kind not in ("diloco", "streaming"))  # not between hosts
    assert first.kind == "workers" and first.action.startswith("run 2 worker(s)")
    assert first.step_s == pytest.approx(predict.predict(diagnosis.model, predict.Layout(2, 2)).step_s)
    assert first.gain == pytest.approx(diagnosis.measured.step_s / first.step_s) and first.gain > 1.2
    gains = [r.gain for r in diagnosis.recommendations]
    assert gains == sorted(gains, reverse=True) and min(gains) >= advice.MIN_GAIN


def test_the_json_object_holds_what_the_issue_promises() -> None:
    diagnosis = diagnose_records([fake.record(rank) for rank in range(2)], [fake.record(0, world=1, local=1)], [1.0])
    found = json.loads(json.dumps(diagnosis.as_dict()))
    assert {"world_size", "step_s", "compute_s", "exposed_comm_s", "data_wait_s"} <= set(found["measured"])
    predicted = {(p["world_size"], p["bandwidth_gbit"]) for p in found["predicted"]}
    assert {(1, None), (2, None), (1024, None), (1024, 1.0)} <= predicted
    assert [(p["world_size"], "take turns" in p["reason"]) for p in found["not_predicted"]] == [(3, True), (4, True)]
    assert any(a.startswith("a step without its allreduce wait") for a in found["assumptions"])
    assert all({"world_size", "bandwidth_gbit", "step_s", "efficiency"} <= set(p) for p in found["predicted"])
    assert set(found["noise_scale"] or {"b_simple": 0, "critical_batch": 0}) >= {"b_simple", "critical_batch"}


def test_the_trace_puts_every_rank_on_its_own_track_with_waits_inside_backward() -> None:
    events = trace.chrome_trace([fake.record(rank) for rank in range(2)])["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    for rank in (0, 1):
        backward = [e for e in slices if e["pid"] == rank and e["name"] == "backward"]
        waits = [e for e in slices if e["pid"] == rank and e["name"].startswith("exposed comm")]
        assert len(backward) == 6 and len(waits) == 12
        assert all(any(b["ts"] <= w["ts"] and w["ts"] + w["dur"] <= b["ts"] + b["dur"] + 1e-6 for b in backward)
                   for w in waits)
    assert {e["tid"] for e in slices if e["name"].startswith("allreduce")} == {1, 2}


def test_the_transport_not_in_use_is_weighed_by_its_own_figures() -> None:
    sockets = [fake.record(rank) for rank in range(2)]
    for record in sockets:  # a run with Gloo's ring at 0.5 GB/s on one host that copies at 10 GB/s
        record["transport"] = "gloo"
        record["transport_figures"].update(ring_beta_s_per_byte=2e-9, copy_s_per_byte=1e-10)
    diagnosis = diagnose_records(sockets, None, [])
    shared = [r for r in diagnosis.recommendations if r.kind == "transport"]
    assert len(shared) == 1 and "transport='auto'" in shared[0].action and shared[0].gain > advice.MIN_GAIN
    link = predict.shared_memory_link(1e-10, 2)
    assert link.beta_s_per_byte == pytest.approx(1e-10 * 2.75)  # in, out, and half a copy to reduce
    model = replace(diagnosis.model, transport="shm", engine=link, measured_local=2)
    assert shared[0].step_s == pytest.approx(predict.predict(model, predict.Layout(2, 2)).step_s)
    through_memory = diagnose_records([fake.record(rank) for rank in range(2)], None, [])
    back = [r for r in through_memory.recommendations if r.kind == "transport"]  # here Gloo's figures are better
    assert back and "transport='gloo'" in back[0].action
    assert back[0].step_s == pytest.approx(
        predict.predict(replace(through_memory.model, transport="gloo"), predict.Layout(2, 2)).step_s)


def test_accumulation_pays_the_exposed_allreduce_and_the_optimizer_once_per_k_batches() -> None:
    run = summarize([fake.record(rank) for rank in range(2)])
    model = predict.fit(run)
    scale = noise.NoiseScale(b_simple=None, gradient_sq=-1.0, trace_sigma=1000.0, samples=64, batch=64)  # noise rules
    found = {r.action.split("accumulate_steps=")[1][0]: r for r in advice.recommend(run, model, scale)
             if r.kind == "accumulation"}
    whole = predict.predict(model, predict.Layout(2, 2))
    for k in (2, 4):
        per_batch = whole.step_s - (whole.exposed_s + model.optimizer_s) * (1 - 1 / k)
        assert found[str(k)].step_s == pytest.approx(per_batch)
        assert found[str(k)].gain == pytest.approx(whole.step_s / per_batch) and found[str(k)].gain > 1.03
        assert found[str(k)].action.startswith(f"px.fit(..., global_batch_size={k * 64}, accumulate_steps={k})")


def test_a_busy_host_is_measured_and_nothing_is_predicted_from_it() -> None:
    def loaded(record: dict, other_cores: float) -> dict:  # 1 s measured, 0.9 s of it each worker's own CPU
        workers = record["local_size"]
        record["load"] = [{"wall": 0.0, "own_cpu": 0.0, "host_busy": 0.0},
                          {"wall": 1.0, "own_cpu": 0.9, "host_busy": 0.9 * workers + other_cores}]
        return record

    alone = loaded(fake.record(0, world=1, local=1), 0.0)
    quiet = diagnose_records([loaded(fake.record(rank), 0.05) for rank in range(2)], [alone], [])
    assert quiet.measured.other_load == pytest.approx(0.05) and quiet.reference.other_load == pytest.approx(0.0)
    assert quiet.predictions and not quiet.model.busy
    busy = diagnose_records([loaded(fake.record(rank), 1.0) for rank in range(2)], [alone], [])
    assert busy.model.busy and not busy.predictions and not busy.recommendations
    assert all(reason.startswith("the host was busy: other processes kept 1.0 of its 2 cores")
               for _, reason in busy.not_predicted)
    text = report.render(busy, "train.py")
    assert "Predicted: nothing; the host was busy" in text and "Recommendations: none; the host was too busy" in text


def test_page_faults_are_named_with_their_kernel_time_where_another_run_may_not_pay_it() -> None:
    run = [fake.record(rank, faults=30) for rank in range(2)]
    faulting = diagnose_records(run, [fake.record(0, world=1, local=1, samples=64, faults=2000)], [])
    assert faulting.reference.page_faults == 2000 and faulting.reference.system_s == pytest.approx(2000 * fake.FAULT_S)
    assert faulting.measured.page_faults == 30 and faulting.as_dict()["reference"]["page_faults"] == 2000
    header = report.render(faulting, "train.py").split("\n\n")[0].splitlines()
    assert "in the kernel" not in header[0] and "(6.0 ms of it in the kernel: 2000 page faults)" in header[1]
    assert "a run whose allocator keeps it is up to that much faster" in header[2]
    steady = diagnose_records(run, [fake.record(0, world=1, local=1, samples=64, faults=30)], [])
    assert len(report.render(steady, "train.py").split("\n\n")[0].splitlines()) == 2
