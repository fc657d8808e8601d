"""px.LocalSGD and px.DiLoCo: each worker steps on its own gradients, and they synchronize every
``period`` steps. DiLoCo at period 1 with an outer SGD of lr 1 is px.DataParallel step for step;
runs repeat bitwise; LocalSGD and streaming DiLoCo equal references computed here by hand for two
workers (streaming exchanges overlap the inner steps that follow them); a run resumed from a
checkpoint continues exactly; an elastic job survives a worker killed between outer steps; and
what cannot work is refused before anything trains.

Every scenario but the resume runs in one launch of two workers (``_launch``, shared by the tests).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch loads it at the first optimizer: once here, not in every forked worker)
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx import faults, profile
from phalanx.parallel.clipping import Clipping
from phalanx.strategies.base import FitOptions
from phalanx.train import finite
from tests.elastic import fit_job
from tests.elastic.launch import free_port, launched
from tests.harness import run_workers

SAMPLES, BATCH, LR = 48, 8, 0.1  # 6 steps an epoch; each of the 2 workers takes 4 samples of each batch


def _data(samples: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 6, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))  # 123 parameters


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


class Record:
    """This rank's batch of every step and the weights after it (a step_fn and a callback)."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.weights: list[torch.Tensor] = []
        self.final: torch.Tensor | None = None

    def step_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        self.batches.append((inputs.clone(), targets.clone()))
        return F.cross_entropy(model(inputs), targets)

    def on_step_end(self, step: int, logs: dict, state: Any) -> None:
        self.weights.append(_flat(state.model))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _trained(strategy: Any, optimizer: Any = _sgd, epochs: int = 1, **options: Any) -> Record:
    model, record = _model(), Record()
    px.fit(model, optimizer(model), None, _data(), epochs=epochs, global_batch_size=BATCH, verbose=0,
           strategy=strategy, step_fn=record.step_fn, callbacks=[record], **options)
    record.final = _flat(model)
    return record


def _local_sgd_by_hand(period: int) -> Record:
    """LocalSGD in a loop of one's own, as docs/strategies.md shows it: 7 steps, then finish()."""
    strategy, record = px.LocalSGD(period=period), Record()
    model = _model()
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    for inputs, targets in px.data.DistributedLoader(_data(56), global_batch_size=BATCH):
        optimizer.zero_grad()
        record.step_fn(model, (inputs, targets)).backward()  # nothing is sent
        optimizer.step()  # every `period` steps, the parameters are averaged
        record.weights.append(_flat(model))
    strategy.finish()
    record.final = _flat(model)
    return record


STREAMING = {"period": 4, "fragments": 2, "delay": 2}  # fragment 1 starts at steps 2, 6, 10; fragment 0 at 4, 8
OUTER_LR, OUTER_MOMENTUM = 0.5, 0.5


def _streaming() -> dict[str, Any]:
    """Streaming DiLoCo over 12 steps with the doctor's recorder on: the exchanges' start and merge,
    and every forward, as timestamped events."""
    profile.recorder = profile.Recorder(lambda reduction: reduction)
    try:
        strategy = px.DiLoCo(**STREAMING, outer_optimizer=functools.partial(torch.optim.SGD, lr=OUTER_LR,
                                                                            momentum=OUTER_MOMENTUM))
        record = _trained(strategy, epochs=2)
        events = list(profile.recorder.events)
    finally:
        profile.recorder = None
    return {"record": record, "events": events, "fragments": [f.indices for f in strategy.optimizer.fragments]}


class NaNOnRank1(Record):
    """A Record whose loss on rank 1 at global step ``NAN_STEP`` is NaN."""

    def step_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        loss = super().step_fn(model, batch)
        return loss * math.nan if px.rank() == 1 and len(self.batches) - 1 == NAN_STEP else loss


NAN_STEP = 1  # under STREAMING the workers next meet before global step 3, where fragment 1's exchange merges


class CountedAllreduces:
    """phalanx.train.finite's collectives, counting its allreduces (the non-finite check's flags)."""

    def __init__(self, collectives: Any):
        self.collectives, self.allreduces = collectives, 0

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        self.allreduces += 1
        return self.collectives.allreduce(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collectives, name)


def _nonfinite() -> dict[str, Any]:
    """Streaming DiLoCo without a NaN, counting the non-finite check's allreduces; with a NaN loss on
    rank 1 under on_nonfinite="raise" (the error) and under "skip" (the run, and the steps skipped)."""
    counted = finite.collectives = CountedAllreduces(finite.collectives)
    try:
        clean = _trained(px.DiLoCo(**STREAMING), epochs=2)
    finally:
        finite.collectives = counted.collectives
    raised = NaNOnRank1()
    model = _model()
    try:
        px.fit(model, _sgd(model), None, _data(), epochs=2, global_batch_size=BATCH, verbose=0,
               strategy=px.DiLoCo(**STREAMING), step_fn=raised.step_fn, callbacks=[raised])
        error: px.NonFiniteLossError | None = None
    except px.NonFiniteLossError as caught:
        error = caught
    skipped, model = NaNOnRank1(), _model()
    skips = []

    class Skips(px.callbacks.Callback):
        def on_train_end(self, state: Any) -> None:
            skips.append(state.guard.skipped_steps)

    px.fit(model, _sgd(model), None, _data(), epochs=2, global_batch_size=BATCH, verbose=0,
           strategy=px.DiLoCo(**STREAMING), step_fn=skipped.step_fn, callbacks=[skipped, Skips()],
           on_nonfinite="skip")
    skipped.final = _flat(model)
    return {"allreduces": counted.allreduces, "clean_steps": len(clean.weights), "raised": raised,
            "message": str(error) if error else None, "ranks": error.ranks if error else None,
            "skipped": skipped, "skips": skips}


def _desynchronized() -> str | None:
    """A loop of one's own in which rank 1 loads a state two steps ahead of rank 0's: the message."""
    strategy, model = px.DiLoCo(period=4, fragments=2), _model()
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    if px.rank() == 1:
        state = optimizer.state_dict()
        optimizer.load_state_dict({**state, "local_steps": {**state["local_steps"], "steps": 2}})
    try:
        for inputs, targets in px.data.DistributedLoader(_data(), global_batch_size=BATCH):
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    except px.CollectiveMismatchError as error:
        return str(error)
    finally:
        strategy.close()
    return None


def _everything() -> dict[str, Any]:
    """Every scenario but the resume, on each of the two workers."""
    period_one = px.DiLoCo(period=1, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0))
    repeated = [_trained(px.DiLoCo(period=3, fragments=2, reduction="bf16"), optimizer=_adam).final for _ in range(2)]
    return {"data_parallel": _trained(None), "period_one": _trained(period_one), "repeated": repeated,
            "local_sgd": _local_sgd_by_hand(period=3), "streaming": _streaming(), "nonfinite": _nonfinite(),
            "desynchronized": _desynchronized()}


@functools.lru_cache(maxsize=1)
def _launch() -> list[dict[str, Any]]:
    return run_workers(_everything, 2, timeout=120)


# --- references by hand ---------------------------------------------------------------------------


def _gradient(weights: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    model = _model()
    torch.nn.utils.vector_to_parameters(weights, model.parameters())
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _ranges(indices: list[int]) -> torch.Tensor:
    """The flat positions of the parameters ``indices`` (in the model's order)."""
    sizes = [p.numel() for p in _model().parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(starts[i], starts[i] + sizes[i]) for i in indices])


def _streaming_reference(batches: list[list], fragments: list[list[int]]) -> list[list[torch.Tensor]]:
    """Streaming DiLoCo on two workers as docs/strategies.md states it, with plain SGD inside and
    SGD with momentum outside: each worker's weights after every step, then after finish()."""
    period, delay = STREAMING["period"], STREAMING["delay"]
    offsets = [i * period // len(fragments) for i in range(len(fragments))]
    where = [_ranges(indices) for indices in fragments]
    start = _flat(_model())
    local, saved, momentum = [start.clone(), start.clone()], start.clone(), [None] * len(fragments)
    pending: dict[int, tuple[int, torch.Tensor]] = {}
    synced = [0] * len(fragments)
    after: list[list[torch.Tensor]] = [[], []]

    def merge(i: int, step: int) -> None:
        outer_gradient = pending.pop(i)[1]
        momentum[i] = outer_gradient if momentum[i] is None else OUTER_MOMENTUM * momentum[i] + outer_gradient
        saved[where[i]] -= OUTER_LR * momentum[i]
        for weights in local:
            weights[where[i]] = saved[where[i]]
        synced[i] = step

    def begin(i: int, step: int) -> None:
        pending[i] = (step, sum((saved[where[i]] - weights[where[i]]) * 0.5 for weights in local))

    for step in range(1, len(batches[0]) + 1):
        for rank in (0, 1):
            local[rank] = local[rank] - LR * _gradient(local[rank], batches[rank][step - 1])
        for i, offset in enumerate(offsets):
            if step % period == offset:
                begin(i, step)
        for i in [i for i, (began, _) in pending.items() if step - began >= delay]:
            merge(i, step)
        for rank in (0, 1):
            after[rank].append(local[rank].clone())
    last = len(batches[0])
    for i in list(pending):
        merge(i, last)
    for i in [i for i in range(len(fragments)) if synced[i] != last]:
        begin(i, last)
        merge(i, last)
    for rank in (0, 1):
        after[rank].append(local[rank].clone())
    return after


# --- the tests ------------------------------------------------------------------------------------


def test_diloco_at_period_one_is_data_parallel_step_for_step() -> None:
    """With SGD inside, a worker's change over one step is -lr times its gradient, so the averaged
    outer gradient is lr times the averaged gradient, and an outer SGD of lr 1 takes data parallel's
    step. Checked against px.DataParallel and against the average computed here from each rank's
    batches, which a missing average (each rank alone) or a sum would miss by far."""
    ranks = _launch()
    batches = [rank["period_one"].batches for rank in ranks]
    weights = _flat(_model())
    for step, (data_parallel, period_one) in enumerate(zip(ranks[0]["data_parallel"].weights,
                                                          ranks[0]["period_one"].weights)):
        gradients = [_gradient(weights, batches[rank][step]) for rank in (0, 1)]
        alone, summed = weights - LR * gradients[0], weights - LR * (gradients[0] + gradients[1])
        weights = weights - LR * (gradients[0] + gradients[1]) / 2
        torch.testing.assert_close(period_one, data_parallel, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(period_one, weights, rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[1]["period_one"].weights[step], period_one)
        assert min((alone - weights).abs().max(), (summed - weights).abs().max()) > 1e-3
    assert len(batches[0]) == SAMPLES // BATCH and not torch.equal(batches[0][0][0], batches[1][0][0])


def test_the_same_seed_gives_the_same_weights_run_to_run() -> None:
    """Streaming DiLoCo with Adam inside, the paper's outer optimizer and a bf16 exchange, twice."""
    for rank in _launch():
        assert torch.equal(rank["repeated"][0], rank["repeated"][1])
    assert torch.equal(_launch()[0]["repeated"][0], _launch()[1]["repeated"][0])  # finish() synchronized them


def test_local_sgd_averages_every_period_and_equals_two_workers_computed_by_hand() -> None:
    """Two replicas with SGD and momentum, each on its rank's batches, averaged after steps 3 and 6
    and by finish() after step 7: the workers' weights after every step, equal across ranks right
    after a synchronization and different between them."""
    ranks = [rank["local_sgd"] for rank in _launch()]
    models = [_model(), _model()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    for step in range(len(ranks[0].batches)):
        for model, optimizer, rank in zip(models, optimizers, ranks):
            optimizer.zero_grad()
            inputs, targets = rank.batches[step]
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        if (step + 1) % 3 == 0:
            _average(models)
        for model, rank in zip(models, ranks):
            torch.testing.assert_close(rank.weights[step], _flat(model), rtol=1e-6, atol=1e-7)
        synchronized = torch.equal(ranks[0].weights[step], ranks[1].weights[step])
        assert synchronized == ((step + 1) % 3 == 0), step
    _average(models)
    assert len(ranks[0].batches) == 7 and torch.equal(ranks[0].final, ranks[1].final)
    torch.testing.assert_close(ranks[0].final, _flat(models[0]), rtol=1e-6, atol=1e-7)


def _average(models: list[nn.Module]) -> None:
    with torch.no_grad():
        for params in zip(*(m.parameters() for m in models)):
            mean = sum(p * 0.5 for p in params)
            for p in params:
                p.copy_(mean)


def test_streaming_exchanges_overlap_the_next_inner_steps_and_equal_a_reference_by_hand() -> None:
    """Fragment i starts its exchange after each step t with t % 4 == 2i and merges it after step
    t + 2: between its start and its wait the worker ran the forward passes of the next two steps.
    The weights of every step, and after finish(), equal the reference computed here."""
    ranks = [rank["streaming"] for rank in _launch()]
    for rank in ranks:
        events = rank["events"]
        started = {(f["fragment"], f["step"]): t for name, t, f in events if name == "outer_start"}
        merged = [(f["fragment"], f["step"], t) for name, t, f in events if name == "outer_merge"]
        forwards = [t for name, t, _ in events if name == "forward"]
        overlapped = [(fragment, step) for fragment, step, waited in merged
                      if (fragment, step - STREAMING["delay"]) in started]
        assert overlapped == [(1, 4), (0, 6), (1, 8), (0, 10), (1, 12)], merged
        for fragment, step in overlapped:
            begun = started[(fragment, step - STREAMING["delay"])]
            waited = next(t for f, s, t in merged if (f, s) == (fragment, step))
            assert sum(begun < t < waited for t in forwards) == STREAMING["delay"], (fragment, step)
    assert ranks[0]["fragments"] == [[0], [1, 2, 3]]  # 72 and 51 elements: each parameter where it begins
    reference = _streaming_reference([rank["record"].batches for rank in ranks], ranks[0]["fragments"])
    for rank, expected in zip(ranks, reference):
        for step, weights in enumerate([*rank["record"].weights, rank["record"].final]):
            torch.testing.assert_close(weights, expected[step], rtol=1e-5, atol=1e-6)
    assert torch.equal(ranks[0]["record"].final, ranks[1]["record"].final)


def test_workers_that_step_on_their_own_check_each_step_alone_and_agree_only_where_they_meet() -> None:
    """No flag crosses the link every step: over 12 steps of streaming DiLoCo the non-finite check
    allreduces only before the 5 steps that merge an exchange and at the 2 epochs' ends (12 + 0
    before). A NaN loss on rank 1 at global step 1 is not applied there (rank 1 takes that step
    empty) and every rank stops before global step 3, where the workers next meet, naming rank 1
    and its step."""
    ranks = [rank["nonfinite"] for rank in _launch()]
    for rank in ranks:
        assert rank["clean_steps"] == 12 and rank["allreduces"] == 5 + 2
        assert rank["ranks"] == [1], rank["message"]
        assert ("rank 1's loss at global step 1 (epoch 0, its step 1" in rank["message"]
                and "before global step 3 (epoch 0, its step 3" in rank["message"]
                and "on_nonfinite='skip' skips such steps on the rank that had one" in rank["message"]), rank["message"]
        assert len(rank["raised"].weights) == 3 and all(w.isfinite().all() for w in rank["raised"].weights)
    raised = [rank["raised"].weights for rank in ranks]
    assert torch.equal(raised[1][1], raised[1][0]) and not torch.equal(raised[0][1], raised[0][0])
    assert not torch.equal(raised[1][2], raised[1][1])  # the steps after it are rank 1's again


def test_under_skip_a_worker_that_steps_on_its_own_skips_only_its_own_step() -> None:
    """Under on_nonfinite="skip" rank 1 drops its NaN step alone (rank 0's stands), the schedule of
    exchanges stays the same on both, and the run ends with equal, finite weights."""
    ranks = [rank["nonfinite"] for rank in _launch()]
    assert [rank["skips"] for rank in ranks] == [[0], [1]]
    skipped = [rank["skipped"] for rank in ranks]
    assert torch.equal(skipped[1].weights[1], skipped[1].weights[0])
    assert not torch.equal(skipped[0].weights[1], skipped[0].weights[0])
    assert len(skipped[0].weights) == len(skipped[1].weights) == 12
    assert torch.equal(skipped[0].final, skipped[1].final) and skipped[0].final.isfinite().all()


def test_workers_whose_states_disagree_on_the_schedule_get_an_error_on_every_rank_not_an_abort() -> None:
    """Rank 1 loads a state two steps ahead: its first exchange (fragment 0's, after its count reaches
    4) meets rank 0's first (fragment 1's, after step 2), and both ranks raise the same error naming
    each rank's, instead of exchanging buffers of different sizes (Gloo aborts the process on those)."""
    messages = [rank["desynchronized"] for rank in _launch()]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "rank 0 after step 2 (fragment 1), rank 1 after step 4 (fragment 0)" in messages[0], messages[0]


def _resumed(folder: str) -> dict[str, Any]:
    """Each strategy for 2 epochs at once, and for 1 epoch then resumed for the second from its
    checkpoint (new objects, as in a new run). DiLoCo streams with TopK, Adam, bf16, clipping and a
    schedule; both of its fragments' exchanges are in flight when the first epoch ends."""
    def run(strategy: Any, directory: Path, epochs: int, optimizer: Any) -> dict[str, Any]:
        model, record = _model(), Record()
        inner = optimizer(model)
        px.fit(model, inner, F.cross_entropy, _data(), epochs=epochs, global_batch_size=BATCH, verbose=0,
               strategy=strategy(), checkpoint_dir=directory, clip_grad_norm=0.5, precision="bf16-mixed",
               lr_schedule=torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5), callbacks=[record])
        return {"weights": _flat(model), "steps": len(record.weights)}

    diloco = functools.partial(px.DiLoCo, period=4, fragments=2, delay=3, reduction=px.TopK(0.5))
    local_sgd = functools.partial(px.LocalSGD, period=4)
    sgd = functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)
    results = {}
    for name, strategy, optimizer in (("diloco", diloco, _adam),
                                      ("local_sgd", local_sgd, lambda model: sgd(model.parameters()))):
        whole, parts = Path(folder) / name / "whole", Path(folder) / name / "parts"
        results[name] = {"whole": run(strategy, whole, 2, optimizer), "first": run(strategy, parts, 1, optimizer),
                         "resumed": run(strategy, parts, 2, optimizer)}
    return results


def test_a_run_resumed_from_its_checkpoint_continues_exactly(tmp_path: Path) -> None:
    ranks = run_workers(_resumed, 2, str(tmp_path), timeout=120)
    for name in ("diloco", "local_sgd"):
        for rank in ranks:
            assert torch.equal(rank[name]["resumed"]["weights"], rank[name]["whole"]["weights"]), name
            assert not torch.equal(rank[name]["first"]["weights"], rank[name]["whole"]["weights"])
            assert [rank[name][run]["steps"] for run in ("whole", "first", "resumed")] == [12, 6, 6]
        whole = px.checkpoint_weights(sorted((tmp_path / name / "whole").glob("checkpoint-*.pt"))[-1])
        resumed = px.checkpoint_weights(sorted((tmp_path / name / "parts").glob("checkpoint-*.pt"))[-1])
        assert set(whole) == set(_model().state_dict()) and all(torch.equal(whole[k], resumed[k]) for k in whole)


REFUSED = [
    (FitOptions(reproducible=True), r"px.DiLoCo\(period=4\) with reproducible=True: reproducible mode sums"),
    (FitOptions(manual_step=True), r"px.DiLoCo\(period=4\) with a step_fn that steps its own optimizers"),
    (FitOptions(several_optimizers=True), r"px.DiLoCo\(period=4\) with a list of optimizers"),
]


@pytest.mark.parametrize("options, message", REFUSED, ids=["reproducible", "manual step", "several optimizers"])
def test_what_cannot_work_is_refused_before_training_naming_the_pair(options: FitOptions, message: str) -> None:
    with pytest.raises(px.ConfigurationError, match=message):
        px.DiLoCo(period=4).check(options)
    with pytest.raises(px.ConfigurationError, match=message.replace(r"px.DiLoCo", "px.LocalSGD")):
        px.LocalSGD(period=4).check(options)


def test_what_works_is_accepted() -> None:
    for precision in ("bf16-mixed", "16-mixed"):  # float16's overflows are agreed by every rank: skipped alike
        px.DiLoCo(period=4, fragments=2).check(FitOptions(
            precision=precision, clipping=Clipping(max_norm=1.0), torch_scheduler=True,
            elastic=True, checkpoint_dir="runs", checkpoint_every=3))


def test_a_job_launched_with_parameter_servers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    launched = {"PHALANX_RANK": "0", "PHALANX_WORLD_SIZE": "1", "PHALANX_LOCAL_RANK": "0",
                "PHALANX_LOCAL_WORLD_SIZE": "1", "PHALANX_SERVERS": "2"}  # a worker of `phalanx run --servers 2`
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    for strategy in (px.LocalSGD(period=4), px.DiLoCo(period=4)):
        with pytest.raises(px.ConfigurationError, match="launched with parameter servers"):
            strategy.check(FitOptions())


@pytest.mark.parametrize("make, message", [
    (lambda: px.LocalSGD(period=0), r"period must be a whole number of steps >= 1, got 0"),
    (lambda: px.DiLoCo(period=2, fragments=3), r"fragments=3\) .* needs period >= fragments"),
    (lambda: px.DiLoCo(period=4, delay=4), r"delay=4\) must merge an exchange before .* delay < period=4"),
    (lambda: px.DiLoCo(period=4, outer_optimizer=torch.optim.SGD([torch.zeros(1)], lr=1)), r"takes a function"),
    (lambda: px.DiLoCo(period=4, reduction="int8"), r"reduction must be None, 'fp16', 'bf16'"),
    (lambda: px.DiLoCo(period=8, fragments=8).setup(nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=1)),
     r"cuts the model's 2 trainable parameters, in order, into 8 fragment"),
])
def test_settings_that_cannot_work_are_refused(make: Any, message: str) -> None:
    with pytest.raises(px.ConfigurationError, match=message):
        make()


def test_a_worker_killed_between_outer_steps_costs_the_job_nothing_but_that_step(tmp_path: Path) -> None:
    """Streaming DiLoCo at 3 workers; worker 1 dies after its 6th step, with fragment 1's exchange
    in flight: the two others re-form from their commit of step 6 (the exchange dropped: that
    fragment synchronizes at its next turn), redo step 7 and train the 30 steps to the end."""
    args = ["-n", "3", "--min-workers", "2", "--timeout", "40"]
    with launched(tmp_path, args, ["--diloco", "--checkpoints", str(tmp_path / "checkpoints")],
                  job=Path(fit_job.__file__), env={faults.ENV: "step.end@1#6"}) as job:
        assert job.wait(timeout=120) == 0, job.output()
    assert job.stderr.count("was lost: signal SIGKILL") == 1, job.output()
    # members are numbered from 1: rank 1 is member 2
    assert re.search(r"generation 1 with 2 worker\(s\) \(lost member\(s\) \[2\]\): first step done", job.stderr), \
        job.output()
    assert job.step() == fit_job.EPOCHS * fit_job.SAMPLES // fit_job.GLOBAL_BATCH
    assert len(job.result()["digest"]) == 64


def test_a_worker_that_joins_takes_a_peers_state_the_outer_state_with_it(tmp_path: Path) -> None:
    """Two workers of streaming DiLoCo hold after step 10 for a third, started later from other initial
    weights: it joins at a step boundary and takes a peer's state (the step count that schedules the
    exchanges, the outer optimizer's state, the parameters of the last outer step), and the three
    train to the end. A joiner that kept its own step count would exchange at other steps than its
    peers, and the job would fail."""
    port = str(free_port())
    common = ["--nnodes", "1:2", "--master-port", port, "--timeout", "30"]
    hold = ["--diloco", "--seed-by-rank", "--hold", f"10:{tmp_path / 'joining'}"]
    with launched(tmp_path, ["-n", "2", *common], hold, job=Path(fit_job.__file__)) as job:
        job.wait_for_step(10)
        with launched(tmp_path, ["-n", "1", "--node-rank", "1", *common],
                      [*hold, "--started-file", str(tmp_path / "joining")], job=Path(fit_job.__file__),
                      name="node1") as joiner:
            assert job.wait(timeout=120) == 0, job.output()
            assert joiner.wait(timeout=120) == 0, joiner.output()
    assert "joined worker" in job.stderr, job.output()
    assert job.size() == 3 and job.step() == fit_job.EPOCHS * fit_job.SAMPLES // fit_job.GLOBAL_BATCH
