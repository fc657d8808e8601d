"""px.Sharded: each level trains as px.DataParallel does (bitwise alike for any worker count in
reproducible mode), holds only its shard of the optimizer state and gradients, clips by the whole
norm, resumes at another worker count and level, and refuses what it cannot do."""

from __future__ import annotations

import gc
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.strategies import shard_copies, shard_layout, sharded
from phalanx.strategies.base import FitOptions, held_bytes
from phalanx.train import checkpoint_io
from tests.cli.test_launcher import run_on_hosts, worker_env
from tests.harness import run_workers
from tests.train.test_fit import GLOBAL_BATCH, SAMPLES, _dataset

LR = 0.01
EPOCHS = 2  # 10 steps, each epoch ending on a short batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": model[0].parameters()},
                             {"params": [*model[2].parameters(), *model[4].parameters()], "lr": LR / 2}],
                            lr=LR, weight_decay=0.01)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _fit(level: int, epochs: int = EPOCHS, optimizer: Any = _adam, shared_memory: bool | str = "auto",
         **options: Any) -> dict[str, Any]:
    """Train with px.Sharded(level) (level 0: px.DataParallel); units of a few hundred bytes, so
    that a model this small is still cut into several units and every rank holds a chunk of each.
    On this host levels 1-2 keep the units in shared memory unless ``shared_memory=False``."""
    model = _model()
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=shared_memory) if level else None
    history = px.fit(model, optimizer(model), F.cross_entropy, _dataset(), epochs=epochs,
                     global_batch_size=GLOBAL_BATCH, metrics=["accuracy"], verbose=0, strategy=strategy, **options)
    return {"weights": _weights(model), "history": history.history}


def _fit_with(level: int, options: dict[str, Any]) -> dict[str, Any]:
    return _fit(level, **options)


def _unsharded_and_sharded(level: int, options: dict[str, Any]) -> tuple[dict, dict]:
    shared_memory = options.pop("shared_memory", "auto")
    return _fit(0, **options), _fit(level, shared_memory=shared_memory, **options)


@pytest.mark.parametrize("world_size, level, options", [
    (1, 2, {}),
    (2, 1, {"clip_grad_norm": 0.05}),  # clipping every step (the gradient norms are about 0.3)
    (2, 1, {"shared_memory": False}),  # each worker its copy of the units, kept equal by all-gathers
    (3, 2, {"clip_grad_norm": 0.05, "accumulate_steps": 2}),
    (3, 2, {"clip_grad_norm": 0.05, "shared_memory": False}),  # reduce-scattered
    (4, 2, {"precision": "bf16-mixed"}),
    (4, 1, {}),
    (2, 3, {"clip_grad_norm": 0.05, "accumulate_steps": 2}),
    (3, 3, {"precision": "bf16-mixed"}),
    (4, 3, {}),
])
def test_each_level_trains_as_data_parallel(world_size: int, level: int, options: dict) -> None:
    """Equal weights and history at 1 to 4 workers; 140 samples in batches of 30 end on a short batch."""
    for unsharded, sharded in run_workers(_unsharded_and_sharded, world_size, level, options, timeout=150):
        for name, value in unsharded["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-5, atol=1e-6)
        for key, values in unsharded["history"].items():
            assert sharded["history"][key] == pytest.approx(values, rel=1e-5)
    assert unsharded["history"]["accuracy"][-1] > 0.6


def _short_last_step(level: int) -> dict[str, Any]:
    """62 samples in global batches of 30 at 4 workers: the last step's 2 samples leave two workers
    without any, and with accumulate_steps=2 the other two a chunk of one sample and an empty one; the
    3 validation samples leave a worker without any too. Level 3 with each worker its own copy of the
    units (as between hosts) gathers every block in every pass."""
    (x, y), model = _dataset(), _model()
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=False) if level else None
    history = px.fit(model, _adam(model), F.cross_entropy, (x[:62], y[:62]), val_data=(x[62:65], y[62:65]),
                     epochs=2, global_batch_size=30, accumulate_steps=2, verbose=0, strategy=strategy)
    return {"weights": _weights(model), "history": history.history}


def _unsharded_and_level_3_short() -> tuple[dict[str, Any], dict[str, Any]]:
    return _short_last_step(0), _short_last_step(3)


def test_level_3_gathers_on_a_worker_without_samples_and_trains_as_data_parallel() -> None:
    for unsharded, sharded in run_workers(_unsharded_and_level_3_short, 4, timeout=150):
        for name, value in unsharded["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-5, atol=1e-6)
        for key, values in unsharded["history"].items():
            assert sharded["history"][key] == pytest.approx(values, rel=1e-5)
    assert "val_loss" in unsharded["history"]


def test_every_level_across_two_hosts_trains_as_data_parallel(tmp_path: Path, two_hosts: list[str]) -> None:
    """Two workers on each of two hosts (network namespaces; shared memory within each). Sharded
    across the hosts (``shared_memory=False``; level 3 by default) level 2 reduce-scatters
    hierarchically (shared memory, then the chunks of the other host's ranks over the network) and
    every level all-gathers the same way, level 3 on a worker without samples too (sharded_hosts.py's
    last step). By default levels 1-2 keep the units once per host (holding no more per worker), as
    ``shared_memory=True`` does at every level: the hosts replicas, nothing is gathered, a
    checkpoint written by one replica of each chunk resumes (there, and at 3 workers of one host at
    level 3) and reads back whole, and reproducible mode gives the bits of sharding across the hosts."""
    common = ["--timeout", "60", "-n", "2", "--nnodes", "2", "--master-addr", "198.18.0.1", "--master-port", "29533"]
    out, checkpoints = tmp_path / "levels.pt", tmp_path / "checkpoints"
    script = [str(Path(__file__).with_name("sharded_hosts.py")), str(out), str(checkpoints)]
    codes, outputs = run_on_hosts(two_hosts, common, script, tmp_path, worker_env(), 150)
    assert codes == [0, 0], outputs
    weights = torch.load(out)
    for run in ((1, False), (2, False), (3, "auto"), (1, "auto"), (2, "auto"), (3, True)):
        for name, value in weights[(0, "auto")].items():
            torch.testing.assert_close(weights[run][name], value, rtol=1e-5, atol=1e-6, msg=f"{run} {name}")
    said = "".join(stdout for stdout, _ in outputs)
    replicas = "allreduce, sharded step, one copy per host"
    # 4 ranks a run; level 2 runs twice by default (then resumed) and once more each way reproducibly
    assert said.count("level 2 shared_memory=False: reduce-scatter to shards, a copy per worker") == 8, said
    assert said.count("level 3 shared_memory=auto: reduce-scatter to shards, chunks gathered per block") == 4, said
    assert said.count(f"level 1 shared_memory=auto: {replicas}") == 4, said
    assert said.count(f"level 2 shared_memory=auto: {replicas}") == 12, said
    assert said.count(f"level 3 shared_memory=True: {replicas}") == 4, said
    newest = sorted(checkpoints.glob("checkpoint-*.pt"))[-1]
    whole = px.checkpoint_weights(newest)
    for name, value in weights[(2, "auto")].items():
        assert torch.equal(whole[name], value), name
    for name, value in weights[(2, False, "reproducible")].items():  # one copy per host or not: the same bits
        assert torch.equal(weights[(2, "auto", "reproducible")][name], value), name
    # that checkpoint (one copy per host, 4 workers) goes on at 3 workers on one host, level 3, for a third
    # epoch: from other initial weights, so that only a resume can end where the straight run does
    resumed = run_workers(_third_epoch, 3, 3, str(checkpoints), 1, timeout=150)
    straight = run_workers(_third_epoch, 3, 0, None, 0)[0]
    for result in resumed:
        for name, value in straight.items():
            torch.testing.assert_close(result[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _third_epoch(level: int, checkpoints: str | None, seed: int) -> dict[str, torch.Tensor]:
    """sharded_hosts.py's model after 3 epochs at ``level``, resumed from ``checkpoints`` if given."""
    from tests.strategies import sharded_hosts

    model, _ = sharded_hosts.train(level, "auto", 3, checkpoints, seed=seed)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _every_level(options: dict[str, Any], unsharded: bool, own_copies: bool) -> dict[Any, dict[str, torch.Tensor]]:
    """Weights after training at each level (0 too where ``unsharded``; with ``own_copies`` also each
    level with every worker its own copy of the units, keyed ``(level, "own copies")``)."""
    weights: dict[Any, dict[str, torch.Tensor]] = {
        level: _fit(level, **options)["weights"] for level in ((0,) if unsharded else ()) + (1, 2, 3)}
    if own_copies:
        weights.update({(level, "own copies"): _fit(level, shared_memory=False, **options)["weights"]
                        for level in (1, 2, 3)})
    return weights


def test_reproducible_mode_gives_the_same_bits_for_any_worker_count_at_every_level() -> None:
    """Ranks run different numbers of micro-batches (the short batch of 20 is 4 of them)."""
    options = {"reproducible": True, "micro_batch_size": 5, "clip_grad_norm": 0.05, "epochs": 1}
    runs = {world: run_workers(_every_level, world, options, world == 2, world == 4, timeout=180)
            for world in (1, 2, 3, 4)}
    reference = runs[1][0][1]
    for world, results in runs.items():
        for result in results:
            for level in [key for key in result if key != 0]:
                for name, value in reference.items():
                    assert torch.equal(result[level][name], value), (world, level, name)
    assert all((3, "own copies") in result for result in runs[4])
    for name, value in runs[2][0][0].items():  # unsharded reproducible training
        torch.testing.assert_close(reference[name], value, rtol=1e-6, atol=1e-7)


def _held_after_a_step(level: int) -> dict[str, int]:
    """Elements this worker holds after a step: optimizer state, gradients, parameters (each worker
    its own copy of the units: not in shared memory); "others": tensors made in the second step
    that outlive it (what the first made once, a cache, is not counted)."""
    model, (x, y) = _model(), _dataset()
    model, optimizer = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=False).setup(model, _adam(model))
    # no prefetch thread: batches it fetched ahead would still be held when the tensors are counted
    loader = px.data.DistributedLoader((x, y), global_batch_size=GLOBAL_BATCH, prefetch=0)
    for step, (inputs, targets) in enumerate(loader):
        if step == 1:
            before = _reachable_storages()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        if step == 1:
            break
    state = sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() // 4
             for p in model.parameters() if p.grad is not None}
    buckets = sum(b.flat.untyped_storage().nbytes() // 4 for b in model.reducer._buckets)
    whole = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() // 4 for p in model.parameters()}
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *optimizer.stepping.param_groups[0]["params"],
             *optimizer.stepping.param_groups[1]["params"], *(b.flat for b in model.reducer._buckets),
             *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)), inputs, targets]}
    others = sorted(n // 4 for ptr, n in _reachable_storages().items() if ptr not in before and ptr not in known)
    return {"state": state, "grads": sum(grads.values()), "buckets": buckets, "whole": sum(whole.values()),
            "other": sum(others), "others": others,
            "chunks": sum(p.numel() for p in optimizer.stepping.param_groups[0]["params"] +
                          optimizer.stepping.param_groups[1]["params"]),
            "params": sum(p.numel() for p in model.parameters())}


def _held_after_a_step_at_each_level() -> dict[int, dict[str, int]]:
    """:func:`_held_after_a_step` for levels 1 to 3 in turn, in one launch of the workers."""
    return {level: _held_after_a_step(level) for level in (1, 2, 3)}


def _reachable_storages() -> dict[int, int]:
    """Every tensor storage Python can reach: its address and bytes."""
    gc.collect()
    return {obj.untyped_storage().data_ptr(): obj.untyped_storage().nbytes() for obj in gc.get_objects()
            if torch.is_tensor(obj) and obj.untyped_storage().nbytes()}


def test_a_worker_holds_its_shard_of_each_level_and_nothing_more_between_steps() -> None:
    """Four workers: Adam's moments of a quarter of the parameters at every level (give or take a
    unit's rounding); at levels 2 and 3 no gradient memory between steps; at level 3 no whole
    parameter; no other tensor (a finished collective's output) outlives the step."""
    per_worker = run_workers(_held_after_a_step_at_each_level, 4, timeout=180)
    held = {level: [worker[level] for worker in per_worker] for level in (1, 2, 3)}
    params = held[1][0]["params"]
    outliving = [(level, rank, worker["others"]) for level, workers in held.items()
                 for rank, worker in enumerate(workers) if worker["other"]]
    assert not outliving, f"(level, rank, elements of each tensor) that outlived the step: {outliving}"
    for level, workers in held.items():
        for worker in workers:
            assert 2 * params / 4 - 2 * 4 * 8 <= worker["state"] <= 2 * params / 4 + 2 * 4 * 8, (level, worker)
            assert params / 4 - 4 * 8 <= worker["chunks"] <= params / 4 + 4 * 8, (level, worker)
    assert all(worker["buckets"] >= params and worker["whole"] == params for worker in held[1])
    assert all(worker["grads"] == 0 and worker["buckets"] == 0 and worker["whole"] == params for worker in held[2])
    assert all(worker["grads"] == 0 and worker["buckets"] == 0 and worker["whole"] == 0 for worker in held[3])


def _hand_loop(level: int, clip: float | None = None) -> dict[str, Any]:
    """A loop of one's own with a torch scheduler on one's own optimizer, clipping every step to
    ``clip`` if given: unsharded with torch's clip_grad_norm_, sharded with the optimizer's."""
    model, (x, y) = _model(), _dataset()
    optimizer = _adam(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.001) if level else None
    if strategy is not None:
        model, optimizer = strategy.setup(model, optimizer)
    else:
        model = px.DataParallel(model)
    norms = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for inputs, targets in px.data.DistributedLoader((x, y), global_batch_size=GLOBAL_BATCH):
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            if clip is not None and strategy is None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            elif clip is not None:
                norms.append(float(optimizer.clip_grad_norm_(clip)))
            optimizer.step()
            schedule.step()
    if strategy is not None:
        strategy.finish()  # level 3: the whole parameters back in the model
    return {"weights": _weights(model.module), "norms": norms,
            "warnings": [str(w.message) for w in warned if "lr_scheduler" in str(w.message)]}


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_hand_written_loop_clips_and_trains_as_with_data_parallel(level: int) -> None:
    unsharded = run_workers(_hand_loop, 3, 0, 0.05)[0]
    assert max(unsharded["norms"]) > 0.05  # the gradient norms are about 0.3: the clipping binds
    for sharded in run_workers(_hand_loop, 3, level, 0.05):
        assert sharded["warnings"] == []  # the schedule is not told that the optimizer never stepped
        assert sharded["norms"] == pytest.approx(unsharded["norms"], rel=1e-5)
        for name, value in unsharded["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-5, atol=1e-6)


def _resumed(level: int, epochs: int, directory: str, every: int | None = None) -> dict[str, Any]:
    return _fit(level, epochs=epochs, checkpoint_dir=directory, checkpoint_every=every)


@pytest.mark.parametrize("first, then", [((2, 2), (3, 1)), ((3, 3), (2, 2))])
def test_a_checkpoint_resumes_at_another_worker_count_and_level(tmp_path: Path, first: tuple, then: tuple) -> None:
    """One epoch at one (workers, level), the next at another: as two epochs unsharded."""
    run_workers(_resumed, first[0], first[1], 1, str(tmp_path))
    resumed = run_workers(_resumed, then[0], then[1], EPOCHS, str(tmp_path), timeout=150)
    straight = run_workers(_fit, 2, 0)[0]
    for result in resumed:
        for name, value in straight["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert result["history"]["loss"] == pytest.approx(straight["history"]["loss"], rel=1e-5)


def test_each_rank_writes_its_own_pieces_which_torch_and_a_plain_model_read(tmp_path: Path) -> None:
    """Nothing gathered: rank 0's file holds no weights, every rank wrote its pieces (DCP); the
    newest checkpoint whose pieces are damaged is skipped; an unsharded run, torch's dcp_to_torch_save
    and px.checkpoint_weights read them whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    trained = run_workers(_resumed, 3, 3, 1, str(tmp_path), 3)[0]  # checkpoints at steps 3 and 5
    newest = sorted(tmp_path.glob("checkpoint-*.pt"))[-1]
    pieces = newest.with_suffix(".pieces")
    assert torch.load(newest, weights_only=True)["model"] is None
    assert sorted(p.name for p in pieces.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    whole = px.checkpoint_weights(newest)
    plain = _model()
    plain.load_state_dict(whole)
    for name, value in trained["weights"].items():
        assert torch.equal(plain.state_dict()[name], value), name
    dcp_to_torch_save(pieces, tmp_path / "torch.pt")
    assert torch.equal(torch.load(tmp_path / "torch.pt")["model/0.weight"].view(32, 10), trained["weights"]["0.weight"])
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path, damaged, ignore=shutil.ignore_patterns("damaged", "torch.pt"))
    (damaged / pieces.name / ".metadata").unlink()  # a crash that left the pieces incomplete: the one before is used
    with pytest.warns(UserWarning, match="missing or incomplete"):
        assert checkpoint_io.find_latest(damaged)[0].name != newest.name
    resumed = run_workers(_resumed, 2, 0, EPOCHS, str(tmp_path), timeout=150)[0]  # px.DataParallel goes on
    straight = run_workers(_fit, 2, 0)[0]
    for name, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-5, atol=1e-6)


def _refusal(case: str) -> str:
    model = _model()
    options: dict[str, Any] = {}
    optimizer: Any = _adam(model)
    strategy = px.Sharded(level=2)
    if case == "lbfgs":
        optimizer = torch.optim.LBFGS(model.parameters())
    elif case == "two optimizers":
        optimizer = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    elif case == "frozen in the optimizer":
        optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(px.ConfigurationError) as refused:
        px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH, verbose=0,
               strategy=strategy, **options)
    return str(refused.value)


@pytest.mark.parametrize("case, words", [
    ("lbfgs", "LBFGS is not known to be one"),
    ("two optimizers", "px.Sharded(level=2) with a list of optimizers"),
    ("frozen in the optimizer", "give the optimizer every parameter that requires grad"),
])
def test_what_sharding_cannot_do_is_refused_before_training(case: str, words: str) -> None:
    assert words in run_workers(_refusal, 1, case)[0]


def test_a_level_that_does_not_exist_is_refused() -> None:
    with pytest.raises(px.ConfigurationError, match="must be one of"):
        px.Sharded(level=4)


@pytest.mark.parametrize("commit_every", [0, 2.5, "4"])
def test_a_commit_interval_that_is_not_a_whole_number_of_steps_is_refused(commit_every: Any) -> None:
    with pytest.raises(px.ConfigurationError, match="commit_every"):
        px.Sharded(commit_every=commit_every)


def test_an_elastic_jobs_commit_interval_follows_where_the_copies_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 4 steps with the copies in host memory, every 8 with buddies (each commit also crosses the
    network), after every step without copies; a chosen interval whatever the copies."""
    elastic = FitOptions(elastic=True, checkpoint_dir="unused")
    kept, chosen, none = px.Sharded(level=2), px.Sharded(level=2, commit_every=3), px.Sharded(level=2, copies=False)
    for strategy in (kept, chosen, none):
        strategy.check(elastic)
    for one_host, expected in ((True, sharded.COMMIT_EVERY), (False, sharded.COMMIT_EVERY_TO_BUDDIES)):
        monkeypatch.setattr(shard_copies, "in_host_memory", lambda: one_host)
        assert (kept.commit_every, chosen.commit_every, none.commit_every) == (expected, 3, 1)
    assert (sharded.COMMIT_EVERY, sharded.COMMIT_EVERY_TO_BUDDIES) == (4, 8)


class _Lion(torch.optim.Optimizer):
    """An elementwise optimizer of the user's own (sign of a momentum blend)."""

    def __init__(self, params: Any, lr: float = 1e-3, beta: float = 0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.add_(torch.sign(group["beta"] * momentum + (1 - group["beta"]) * p.grad), alpha=-group["lr"])
                momentum.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])


def _lion(level: int) -> dict[str, torch.Tensor]:
    model = _model()
    strategy = px.Sharded(level=level, elementwise=[_Lion], fusion_threshold_mb=0.001) if level else None
    px.fit(model, _Lion(model.parameters()), F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
           verbose=0, strategy=strategy)
    return _weights(model)


def test_an_elementwise_optimizer_of_your_own_is_stepped_once_named() -> None:
    unsharded = run_workers(_lion, 2, 0)[0]
    for weights in run_workers(_lion, 2, 2):
        for name, value in unsharded.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


assert SAMPLES % GLOBAL_BATCH, "the data must end on a short batch"


def _compiled(level: int, shared_memory: bool | str = "auto") -> dict[str, Any]:
    model, (x, y) = _model(), _dataset()
    optimizer = _adam(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)  # as _hand_loop's
    try:
        model, optimizer = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=shared_memory).setup(
            torch.compile(model, backend="eager"), optimizer)
    except px.ConfigurationError as refused:
        return {"refused": str(refused)}
    for inputs, targets in px.data.DistributedLoader((x, y), global_batch_size=GLOBAL_BATCH):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        schedule.step()
    return {"weights": _weights(model.module._orig_mod)}


def _unsharded_compiled_and_refused() -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The hand loop unsharded, then compiled at level 2, then compiled at level 3 with each worker its
    own copy of the units, as between hosts (refused: its blocks are freed and gathered by hooks)."""
    return _hand_loop(0)["weights"], _compiled(2), _compiled(3, shared_memory=False)


def test_torch_compile_trains_at_level_2_and_is_refused_at_level_3_between_hosts() -> None:
    for reference, compiled, refused in run_workers(_unsharded_compiled_and_refused, 2, timeout=150):
        for name, value in reference.items():
            torch.testing.assert_close(compiled["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert "level 3 frees and gathers" in refused["refused"]


def _within_memory(level: int) -> dict[str, Any]:
    """px.fit with a per-worker limit just above what level 3 holds at this worker count."""
    model = _model()
    limit = held_bytes(model, _adam(model), level=3, workers=px.size()) * 1.01 / 2**30
    try:
        result = _fit(level, max_memory_gb=limit)
    except px.ConfigurationError as refused:
        return {"refused": str(refused)}
    return {"trained": result["history"]["loss"][-1]}


def _within_memory_at_levels(levels: tuple[int, ...]) -> list[dict[str, Any]]:
    return [_within_memory(level) for level in levels]


def test_a_run_over_its_memory_limit_is_refused_naming_the_need_and_the_level_that_fits() -> None:
    """Unsharded Adam (16 B a parameter) and level 2 are over the limit; level 3 trains under it."""
    for unsharded, level_2, level_3 in run_workers(_within_memory_at_levels, 2, (0, 2, 3)):
        assert "px.DataParallel needs about" in unsharded["refused"]
        assert "strategy=px.Sharded(level=3) holds" in unsharded["refused"]
        assert "Adam's state of 931 parameters" in unsharded["refused"]
        assert "px.Sharded(level=2) needs about" in level_2["refused"]
        assert "trained" in level_3, level_3


def test_the_memory_each_level_holds_is_the_parameters_gradients_and_state_it_keeps() -> None:
    """Adam in float32: 16 bytes a parameter unsharded; at 4 workers 2*4 + 8/4 at level 1,
    4 + 12/4 at level 2, 16/4 at level 3; SGD without momentum keeps no state."""
    model = _model()
    parameters = sum(p.numel() for p in model.parameters())
    adam = torch.optim.Adam(model.parameters())
    expected = {0: 16, 1: 10, 2: 7, 3: 4}
    for level, per_parameter in expected.items():
        assert held_bytes(model, adam, level, workers=4) == per_parameter * parameters
    assert held_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, workers=1) == 8 * parameters
    assert held_bytes(model, torch.optim.Adam(model.parameters(), amsgrad=True), 0, workers=1) == 20 * parameters


class _Reversed(nn.Module):
    """Two layers of one size, called in the order opposite to their registration."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.head = nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.first(torch.tanh(self.second(x)))))


def _saved_by_rank_0_alone(level: int) -> dict[str, Any]:
    """DDP's habit: rank 0 alone takes the model's state dict between steps, to save it."""
    model = _Reversed()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.0002, shared_memory=False) if level else None
    wrapped, optimizer = strategy.setup(model, optimizer) if strategy else (px.DataParallel(model), optimizer)
    x, y = _dataset()
    saved = None
    for step, (inputs, targets) in enumerate(px.data.DistributedLoader((x, y), global_batch_size=GLOBAL_BATCH)):
        optimizer.zero_grad()
        F.cross_entropy(wrapped(inputs), targets).backward()
        optimizer.step()
        if step == 2 and px.rank() == 0:
            saved = {name: value.clone() for name, value in wrapped.state_dict().items()}
    if strategy is not None:
        strategy.finish()
    return {"saved": saved, "weights": _weights(model)}


def test_a_state_dict_rank_0_takes_alone_at_level_3_is_whole_and_changes_no_rank_s_training() -> None:
    """Its gathers meet the others' next forward, in the forward's order (here not the registration's:
    in that order the equal blocks' chunks would land in each other's places on the other rank)."""
    expected = run_workers(_saved_by_rank_0_alone, 2, 0)[0]
    results = run_workers(_saved_by_rank_0_alone, 2, 3)
    for name, value in expected["saved"].items():
        torch.testing.assert_close(results[0]["saved"][name], value, rtol=1e-5, atol=1e-6)
    for result in results:
        for name, value in expected["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)


def _optimizer_state_by_rank_0_alone() -> None:
    model = _model()
    _, optimizer = px.Sharded(level=2).setup(model, _adam(model))
    if px.rank() == 0:
        optimizer.state_dict()
    px.barrier()


def test_the_optimizer_state_dict_taken_by_one_rank_alone_is_refused_naming_what_to_do() -> None:
    """Its gathers would meet the others' collectives (silently, where the sizes agree): the rank
    alone raises, naming the call and the way, before the others' timeouts."""
    errors = run_workers(_optimizer_state_by_rank_0_alone, 2, collective_timeout=4, expect_failure=True)
    assert "optimizer.state_dict() on rank 0: only 1 of 2 ranks reached it" in errors[0], errors[0]
    assert "if px.rank() == 0: torch.save(state, path)" in errors[0], errors[0]


def _evaluated_by_rank_0_alone() -> None:
    """DDP's habit: rank 0 alone evaluates, under no_grad, between steps."""
    model = _model()
    wrapped, optimizer = px.Sharded(level=3, fusion_threshold_mb=0.0002, shared_memory=False).setup(model, _adam(model))
    x, y = _dataset()
    optimizer.zero_grad()
    F.cross_entropy(wrapped(x[:8]), y[:8]).backward()
    optimizer.step()
    if px.rank() == 0:
        with torch.no_grad():
            wrapped(x)
    px.barrier()


def test_an_evaluation_rank_0_runs_alone_at_level_3_is_refused_naming_what_to_do() -> None:
    """Its gathers would meet the others' training gathers (a wrong model, silently, where the sizes
    agree): a forward without gradients waits for every rank, and the one alone says what to do."""
    errors = run_workers(_evaluated_by_rank_0_alone, 2, collective_timeout=4, expect_failure=True)
    assert "a forward without gradients at px.Sharded(level=3) on rank 0: only 1 of 2 ranks reached it" in errors[0], \
        errors[0]
    assert "evaluate on every rank" in errors[0], errors[0]


def _state_dict_before_training(alone: bool) -> dict[str, torch.Tensor] | None:
    model = _Reversed()
    wrapped, _ = px.Sharded(level=3, fusion_threshold_mb=0.0002, shared_memory=False).setup(
        model, torch.optim.Adam(model.parameters(), lr=LR))
    taken = wrapped.state_dict() if px.rank() == 0 or not alone else None
    px.barrier()
    return taken


def test_a_state_dict_before_the_first_step_is_taken_by_every_rank_or_refused_on_the_one_alone() -> None:
    """Before the first forward its order is unknown, so a lone rank's gathers could not be made to
    meet the others' first forward: every rank takes it (the initial weights, whole), or the rank
    alone raises."""
    for taken in run_workers(_state_dict_before_training, 2, False):
        for name, value in _Reversed().state_dict().items():
            assert torch.equal(taken[name], value)
    errors = run_workers(_state_dict_before_training, 2, True, collective_timeout=4, expect_failure=True)
    assert "model.state_dict() before the first training step at px.Sharded(level=3) on rank 0" in errors[0], errors[0]


class _Scale(nn.Module):
    """Features multiplied by a parameter: an elementwise product autocast leaves in float32, so
    whether the parameter was rounded to bfloat16 shows in the result."""

    def __init__(self, features: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(features) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _RoundedToBf16(nn.Module):
    """A parametrization: the forward sees the parameter rounded to bfloat16 and back, its gradient
    passes straight through to the float32 weight (what gathering in bfloat16 computes)."""

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value + (value.to(torch.bfloat16).to(value.dtype) - value).detach()


def _scaled_model(rounded: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), _Scale(32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))
    if rounded:
        for module in model:
            for name, _ in list(module.named_parameters(recurse=False)):
                nn.utils.parametrize.register_parametrization(module, name, _RoundedToBf16())
    return model


def _bf16(variant: str) -> dict[str, Any]:
    """Trained at bf16-mixed: ``plain`` and ``rounded`` with px.DataParallel (``rounded``: its forward
    sees the parameters rounded to bfloat16), ``gathered`` and ``float32`` at level 3 gathering each
    block in bfloat16 (px.fit's compute dtype) or in float32; with the dtypes of the gathers made."""
    model = _scaled_model(rounded=variant == "rounded")
    strategy = None
    if variant in ("gathered", "float32"):
        strategy = px.Sharded(level=3, fusion_threshold_mb=0.0002, shared_memory=False,
                              gather_dtype="auto" if variant == "gathered" else torch.float32)
    made: list[torch.dtype] = []
    gather = shard_layout.collectives.allgather

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        made.append(tensor.dtype)
        return gather(tensor, *args, **kwargs)

    shard_layout.collectives.allgather = counted
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01)
        history = px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
                         precision="bf16-mixed", verbose=0, strategy=strategy)
    finally:
        shard_layout.collectives.allgather = gather
    weights = {name.replace("parametrizations.", "").replace(".original", ""): value
               for name, value in _weights(model).items()}
    units = len(strategy.gathering.units) if strategy is not None and strategy.gathering is not None else 0
    return {"weights": weights, "loss": history.history["loss"], "made": made, "units": units}


def _bf16_variants() -> dict[str, dict[str, Any]]:
    return {variant: _bf16(variant) for variant in ("plain", "rounded", "gathered", "float32")}


@pytest.mark.parametrize("world_size", [1, 3])
def test_level_3_gathers_in_the_compute_dtype_and_trains_as_on_parameters_rounded_to_it(world_size: int) -> None:
    """At bf16-mixed, level 3 gathers each block in bfloat16 (half the bytes) and the weights and the
    optimizer stay float32: it trains as px.DataParallel whose forward sees the parameters rounded to
    bfloat16, not as plain px.DataParallel; gathering in float32 trains as plain px.DataParallel.
    Only the model handed back at the end is gathered in float32."""
    for result in run_workers(_bf16_variants, world_size, timeout=150):
        plain, rounded = result["plain"], result["rounded"]
        gathered, float32 = result["gathered"], result["float32"]
        for name, value in rounded["weights"].items():
            torch.testing.assert_close(gathered["weights"][name], value, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(float32["weights"][name], plain["weights"][name], rtol=1e-5, atol=1e-6)
        assert gathered["loss"] == pytest.approx(rounded["loss"], rel=1e-5)
        assert not torch.allclose(rounded["weights"]["1.scale"], plain["weights"]["1.scale"], rtol=1e-5, atol=1e-6)
        if world_size == 1:  # a world of one rounds its own chunks, gathering nothing
            continue
        units = gathered["units"]
        assert gathered["made"].count(torch.float32) == units  # the whole model handed back
        assert gathered["made"].count(torch.bfloat16) >= 2 * EPOCHS * units  # a forward and a backward a step
        assert {dtype for dtype in float32["made"] if dtype.is_floating_point} == {torch.float32}


def _refused_gather_dtype(case: str) -> str:
    model = _model()
    with pytest.raises(px.ConfigurationError) as refused:
        if case == "level 2":
            px.Sharded(level=2, gather_dtype=torch.bfloat16)
        elif case == "not a dtype":
            px.Sharded(level=3, gather_dtype="bf16")
        else:
            px.fit(model, _adam(model), F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
                   verbose=0, reproducible=True, micro_batch_size=2,
                   strategy=px.Sharded(level=3, gather_dtype=torch.bfloat16))
    return str(refused.value)


@pytest.mark.parametrize("case, words", [
    ("level 2", "only level 3 gathers the parameters for the forward and backward"),
    ("not a dtype", "must be 'auto' or a floating torch dtype"),
    ("reproducible", "gather_dtype=torch.bfloat16 in reproducible mode"),
])
def test_a_gather_dtype_that_cannot_be_honoured_is_refused(case: str, words: str) -> None:
    assert words in run_workers(_refused_gather_dtype, 1, case)[0]


def _state_dict_by_rank_0_alone_in_bf16() -> None:
    model = _model()
    strategy = px.Sharded(level=3, fusion_threshold_mb=0.0002, shared_memory=False, gather_dtype=torch.bfloat16)
    wrapped, optimizer = strategy.setup(model, _adam(model))
    x, y = _dataset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(wrapped(x[:8]), y[:8])
    loss.backward()
    optimizer.step()
    if px.rank() == 0:
        wrapped.state_dict()
    px.barrier()


def test_a_state_dict_one_rank_takes_alone_while_gathering_in_bf16_is_refused_naming_what_to_do() -> None:
    """The passes gather rounded parameters, so the float32 weights of a state dict need every rank."""
    errors = run_workers(_state_dict_by_rank_0_alone_in_bf16, 2, collective_timeout=4, expect_failure=True)
    assert "model.state_dict() at px.Sharded(level=3) gathering in bfloat16 on rank 0: only 1 of 2" in errors[0], \
        errors[0]
    assert "every rank takes it" in errors[0], errors[0]


def _one_block_gathered_in_bf16() -> dict[str, Any]:
    model = _model()
    strategy = px.Sharded(level=3, fusion_threshold_mb=0.0002, shared_memory=False, gather_dtype=torch.bfloat16)
    strategy.setup(model, _adam(model))
    assert strategy.gathering is not None
    block = strategy.gathering.blocks[0]
    block.launch(torch.bfloat16)
    in_flight = [unit.flat.untyped_storage().nbytes() for unit in block.units]
    block.wait(torch.bfloat16)
    rounded = [unit.flat.clone() for unit in block.units]
    strategy.gathering.gather_all()  # the weights themselves: gathered again, in float32
    names = {id(param): name for name, param in model.named_parameters()}
    return {"in_flight": in_flight, "rounded": rounded, "whole": [unit.flat.clone() for unit in block.units],
            "names": [names[id(param)] for unit in block.units for param in unit.params]}


def test_a_block_gathered_in_bf16_holds_no_float32_memory_in_flight_and_is_gathered_again_whole() -> None:
    """While its bfloat16 gather is in flight a block's float32 buffers hold nothing (the gather half
    of a float32 one); once there they hold the weights rounded to bfloat16, and a gather of the weights
    themselves (a state dict's) brings the float32 values back."""
    initial = _model().state_dict()
    for result in run_workers(_one_block_gathered_in_bf16, 2):
        assert result["in_flight"] == [0] * len(result["in_flight"])
        whole = torch.cat(result["whole"])
        assert torch.equal(whole, torch.cat([initial[name].reshape(-1) for name in result["names"]]))
        assert torch.equal(torch.cat(result["rounded"]), whole.to(torch.bfloat16).float())
        assert not torch.equal(torch.cat(result["rounded"]), whole)
