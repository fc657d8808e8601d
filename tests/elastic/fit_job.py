"""An elastic px.fit job for the tests: a CNN with batch norm and dropout in reproducible mode.

Run by ``phalanx run`` (elastic) or as a plain process (the uninterrupted reference). It writes
its pid to ``--pids`` (and there, on SIGUSR1, every thread's stack: ``stacks-PID.txt``), rank 0
writes the global step to ``--progress`` after every step, and at the end rank 0 saves the SHA-256
digest of the final state dict to ``--out``. With
``--checkpoints`` it also validates every epoch and writes checkpoints there (neither changes the
weights, so the reference is the same); ``--level L`` trains under ``px.Sharded(level=L)``,
``--diloco`` under streaming ``px.DiLoCo`` (outside reproducible mode, which it refuses).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

SAMPLES, GLOBAL_BATCH, MICRO, EPOCHS = 240, 24, 2, 3  # 10 steps an epoch, 30 in all


class Progress:
    """Rank 0 writes the global step after every step; at a step of ``holds`` every worker waits for
    the test's file (see tests/elastic/job.py's ``hold``: a joiner's arrival)."""

    def __init__(self, path: Path, holds: dict[int, str] | None = None):
        self.path, self.holds = path, holds or {}

    def on_step_end(self, step: int, logs: dict, state) -> None:
        if px.is_master():
            self.path.write_text(f"{state.global_step} {state.epoch} {px.size()}\n")
        if state.global_step in self.holds:  # once: a resume from a checkpoint passes the step again
            from job import hold  # beside this script

            hold(self.holds.pop(state.global_step), px.elastic.membership())


def digest(state: dict) -> str:
    hasher = hashlib.sha256()
    for name, tensor in state.items():
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def train(progress: Path | None = None, checkpoints: Path | None = None, level: int = 0,
          shared_memory: bool | str = "auto", holds: dict[int, str] | None = None, diloco: bool = False,
          copies: bool | str = "auto", seed: int = 0, commit_every: int | None = 1) -> str:
    """The job's training (``level`` > 0: under px.Sharded at that level; ``diloco``: under
    px.DiLoCo(period=4, fragments=2)), the model initialized from ``seed``, committed every
    ``commit_every`` steps (None: the strategy's default); the digest of its weights."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 1, 8, 8, generator=generator)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    validation = (x[:48], y[:48]) if checkpoints else None
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                          nn.Dropout(0.2), nn.Linear(6 * 8 * 8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = (px.DiLoCo(period=4, fragments=2) if diloco else
                px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=shared_memory, copies=copies,
                           commit_every=commit_every)
                if level else None)
    px.fit(model, optimizer, F.cross_entropy, (x, y), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
           reproducible=not diloco, micro_batch_size=None if diloco else MICRO, verbose=0, metrics=["accuracy"],
           callbacks=[Progress(progress, holds)] if progress else [], val_data=validation, checkpoint_dir=checkpoints,
           strategy=strategy)
    return digest(model.state_dict())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pids", type=Path, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path)
    parser.add_argument("--level", type=int, default=0, help="train under px.Sharded(level=LEVEL)")
    parser.add_argument("--own-copies", action="store_true", help="px.Sharded(shared_memory=False)")
    parser.add_argument("--no-shard-copies", action="store_true", help="px.Sharded(copies=False)")
    parser.add_argument("--diloco", action="store_true", help="train under px.DiLoCo(period=4, fragments=2)")
    parser.add_argument("--hold", metavar="STEP:FILE", help="after global step STEP, wait for FILE (a joiner's)")
    parser.add_argument("--started-file", help="written once started: 'join' when about to ask to join")
    parser.add_argument("--seed-by-rank", action="store_true", help="each rank initializes the model from its rank")
    parser.add_argument("--default-commits", action="store_true",
                        help="px.Sharded commits at its default interval (else after every step)")
    parser.add_argument("--transport", default="auto", help="px.init(transport=...): gloo keeps no shared memory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stacks = open(args.pids / f"stacks-{os.getpid()}.txt", "w")  # SIGUSR1: every thread's stack (an overrun job)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    px.init(transport=args.transport)
    joining = px.elastic.membership() is None if px.elastic.enabled() else False
    (args.pids / (f"joiner-{os.getpid()}.pid" if joining else f"{px.rank()}.pid")).write_text(str(os.getpid()))
    if args.started_file:
        Path(args.started_file).write_text("join" if joining else "founder")
    holds = {int(step): path for step, path in [args.hold.split(":", 1)]} if args.hold else None
    result = train(args.progress, args.checkpoints, args.level, False if args.own_copies else "auto", holds,
                   args.diloco, False if args.no_shard_copies else "auto", px.rank() if args.seed_by_rank else 0,
                   None if args.default_commits else 1)
    if px.is_master():
        torch.save({"digest": result}, args.out)
