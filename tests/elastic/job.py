"""An elastic training job for the tests, run by ``phalanx run``: an MLP over a DistributedLoader.

It trains with ``px.elastic.State`` and ``px.elastic.run`` (the custom-loop API; ``--sharded LEVEL``:
px.Sharded's model and optimizer, committed by the strategy), writes its pid
to ``--pids`` and its progress to ``--progress`` (rank 0, every commit), and at the end rank 0
saves the final weights, the generation changes it saw and its recoveries to ``--out``.
``reference()`` trains the same model on the same global batches in one process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.atomic import write_text_atomically
from phalanx.comm.membership import Membership

torch.set_num_threads(1)

SAMPLES, FEATURES, GLOBAL_BATCH, EPOCHS = 300, 8, 10, 2  # 30 steps per epoch; 3 workers get 4/3/3 samples


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return x, y


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference() -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, the same global batches in the same order."""
    from phalanx.data import DistributedLoader

    model = build_model()
    optimizer = make_optimizer(model)
    loader = DistributedLoader(dataset(), GLOBAL_BATCH, seed=3, rank=0, world_size=1)
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def refuses(communicator: object) -> bool:
    """Whether an earlier generation's communicator raises GenerationClosedError when used."""
    import phalanx as px

    try:
        communicator.barrier()  # type: ignore[attr-defined]
    except px.GenerationClosedError:
        return True
    return False


def hold(path: str, view: Membership, timeout: float = 60.0) -> None:
    """Wait for the test's file; when a joiner wrote it, also until the coordinator asks this generation
    to end for it, so that it joins at the next commit whatever the load. Where the joiner asked early
    enough to join at the commit just made, this generation is the one formed for it: nothing to wait
    for (waiting for its end would hold the job until the timeout)."""
    from phalanx.comm import runtime

    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.path.exists(path) and Path(path).read_text() == "join" and not view.joined:
        while runtime.generation_ending(view.generation) is None and time.monotonic() < deadline:
            time.sleep(0.02)


def watch_world(path: str) -> tuple["threading.Event", "threading.Thread"]:
    """Another thread of the worker, as a logger or a loader's would be: every (rank, size, is_master)
    it reads, across re-formings, written to ``path`` at each new one, until the event returned is set
    (before ``px.shutdown()``, after which a process is a world of one again)."""
    import json
    import threading

    import phalanx as px

    seen: set[tuple[int, int, bool]] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            world = (px.rank(), px.size(), px.is_master())
            if world not in seen:
                seen.add(world)
                write_text_atomically(path, json.dumps(sorted(seen)))
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, daemon=True, name="watch-world")
    watcher.start()
    return stop, watcher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE",
                        help="after STEP, wait for FILE to exist (and, when a joiner wrote it, for its admission)")
    parser.add_argument("--started-file", default=None,
                        help="created once this worker started: 'join' when it is about to ask to join, else 'founder'")
    parser.add_argument("--freeze-rank", type=int, default=-1, help="this rank stops itself (SIGSTOP) just "
                        "before its first step, after the job formed")
    parser.add_argument("--watch-world", action="store_true", help="a thread reads px.rank(), px.size() and "
                        "px.is_master() in a loop; each worker writes the worlds it saw to --pids/worlds-PID.json")
    parser.add_argument("--sharded", type=int, default=0, metavar="LEVEL", help="train with px.Sharded(level=LEVEL)")
    parser.add_argument("--no-copies", action="store_true", help="px.Sharded(copies=False)")
    parser.add_argument("--central-storage", action="store_true", help="set px.CentralStorage up (refused here)")
    parser.add_argument("--state-dicts-from", type=int, default=0, metavar="STEP",
                        help="from STEP on every rank takes the optimizer's state dict after each step; member 2 "
                        "(the first rank 1) dies (SIGKILL) just before its first, the others waiting for it")
    args = parser.parse_args()
    holds = {int(step): path for step, path in (hold.split(":", 1) for hold in args.hold)}
    with open(os.path.join(args.pids, f"{os.environ['PHALANX_RANK']}.pid"), "w") as handle:
        handle.write(str(os.getpid()))

    import phalanx as px
    from phalanx import elastic
    from phalanx.data import DistributedLoader

    px.init()
    watching = watch_world(os.path.join(args.pids, f"worlds-{os.getpid()}.json")) if args.watch_world else None
    loader = DistributedLoader(dataset(), GLOBAL_BATCH, seed=3)
    if args.central_storage:
        plain = build_model()
        px.CentralStorage().setup(plain, make_optimizer(plain))
    if args.sharded:
        strategy = px.Sharded(level=args.sharded, copies=not args.no_copies)
        plain = build_model()
        model, optimizer = strategy.setup(plain, make_optimizer(plain))
        committed = strategy.committed(model, optimizer)  # each rank's chunks, laid out again after a re-form
    else:
        model = px.DataParallel(build_model())
        optimizer = make_optimizer(model)
        committed = {"model": model, "optimizer": optimizer}
    state = elastic.State(**committed, loader=loader, epoch=0, step=0, checkpoint_path=args.checkpoint)
    changes: list[dict] = []
    communicators = [px.communicator()]  # one per generation seen: each earlier one must refuse to be used
    if args.started_file:  # membership None: started after the job did
        write_text_atomically(args.started_file, "join" if elastic.membership() is None else "founder")

    @elastic.run
    def train(state: elastic.State) -> int:
        for epoch in range(state.epoch, EPOCHS):
            loader.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                F.mse_loss(model(x), y).backward()
                optimizer.step()
                state.step += 1
                if args.state_dicts_from and state.step >= args.state_dicts_from:
                    if os.environ["PHALANX_RANK"] == "1":
                        os.kill(os.getpid(), signal.SIGKILL)
                    optimizer.state_dict()
                time.sleep(args.step_sleep)
                state.commit()
                view = elastic.membership() or elastic.Membership(0, px.rank(), px.size(), ())  # static launch
                if not changes or changes[-1]["generation"] != view.generation:
                    changes.append({"generation": view.generation, "size": view.size, "time": time.time(),
                                    "step": state.step, "lost": list(view.lost), "joined": list(view.joined),
                                    "stale_refused": refuses(communicators[-1]) if changes else None})
                    communicators.append(px.communicator())
                if px.rank() == 0:
                    with open(args.progress + ".tmp", "w") as handle:
                        handle.write(f"{state.step} {view.generation} {view.size}")
                    os.replace(args.progress + ".tmp", args.progress)
                if state.step in holds:
                    hold(holds[state.step], view)
        return state.step

    if px.rank() == args.freeze_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    steps = train(state)
    if args.sharded:
        strategy.finish()  # level 3: the whole parameters back in the model
    if px.rank() == 0 and steps is not None:
        torch.save({"weights": model.state_dict(), "changes": changes, "steps": steps, "size": px.size(),
                    "recoveries": [r.__dict__ for r in state.recoveries]}, args.out)
    print(f"done: rank {px.rank()} of {px.size()} after {steps} steps", flush=True)
    if watching is not None:
        watching[0].set()
        watching[1].join()
    px.shutdown()


if __name__ == "__main__":
    sys.exit(main())
