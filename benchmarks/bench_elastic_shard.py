"""What px.Sharded's in-memory copies cost an elastic job, and how fast a job recovers with them.

    python benchmarks/bench_elastic_shard.py [--reps 3] [--workers 2,3,4] [--levels 0,1,2,3] [--steps 12]
                                            [--transport auto|gloo]

Every measurement is one elastic ``python -m phalanx run -n W --min-workers 1`` job of this file:
px.fit of the MLP of benchmarks/bench_ddp.py (5.26 M parameters, 1024-2048-1024-1024-10, batch 96
per worker), Adam, commits at each strategy's default interval (px.DataParallel and copies=False: every
step; px.Sharded with copies: every 4 steps), one intra-op thread per
worker. Variants, alternating within each repetition in a shuffled order:

  L0          px.DataParallel: every commit copies the whole model and Adam's state
  L1..L3      px.Sharded(level=L): every commit copies the rank's chunks into host memory (copies="auto")
  L1..L3-off  px.Sharded(level=L, copies=False): no copy (a re-formed group would read the disk)

With ``--transport gloo`` the workers keep no shared memory, as between hosts: each px.Sharded worker
its own units, and the copies kept by buddies (each rank's chunks sent to the next rank at a commit).

Per variant: the mean time from one step's end to the next's on rank 0 over --steps steps (a
multiple of 4: whole commit intervals) after 3 of warm-up, the commits included, each spread over
its interval; the copies' share is that against the same level without them (another job). Within
each job with copies, a commit's cost is also read off paired intervals: the median interval that
follows a step with a commit less the median one without, and its share that cost over the steps
of a commit interval (less noisy than comparing two jobs: the same processes, the same minute).
Recovery: the same job (copies on) with rank 1 SIGKILLed after its 6th step's end, before that
step's commit (``PHALANX_FAULTS=step.end@1#6``); rank 0 reports the time from the launcher seeing
the death to the re-formed group's first completed step (the issue's measure: px.DataParallel's
step 6 again, px.Sharded's step 5, the first after its last commit at step 4) and to its first
commit after the death (px.DataParallel: the same step; px.Sharded: step 8, steps 5 and 6 trained
again). Held bytes per parameter: what each worker holds for
parameters, gradients and Adam's state between steps and what the commits' copies add
(phalanx.strategies.base.held_per_worker and elastic_copies_per_worker, which phalanx doctor uses).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 3


def job(level: int, copies: bool, steps: int, out: str, transport: str) -> None:
    """One elastic px.fit run over ``transport``; rank 0 writes the step intervals to ``out``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx as px

    torch.set_num_threads(1)
    px.init(transport=transport)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = 96 * px.size()
    samples = batch * (steps + WARMUP)
    x, y = torch.randn(samples, 1024), torch.randint(0, 10, (samples,))
    ends: list[tuple[int, float]] = []

    class Clock:
        def on_step_end(self, step: int, logs: dict, state) -> None:  # noqa: ANN001 - px.fit's callback
            ends.append((state.global_step, time.perf_counter()))

    strategy = px.Sharded(level=level, copies="auto" if copies else False) if level else None
    checkpoints = tempfile.mkdtemp(prefix="bench-elastic-") if level and not copies else None
    px.fit(model, optimizer, F.cross_entropy, (x, y), epochs=1, global_batch_size=batch, verbose=0,
           strategy=strategy, checkpoint_dir=checkpoints, checkpoint_every=10_000 if checkpoints else None,
           callbacks=[Clock()])
    if px.is_master():
        every = strategy.commit_every if strategy is not None else 1
        # each interval runs from a step's end (then its commit, where one is due) to the next step's end
        intervals = [(a_step % every == 0, b - a) for (a_step, a), (_, b) in zip(ends[WARMUP - 1:], ends[WARMUP:])]
        Path(out).write_text(json.dumps({"intervals": [seconds for _, seconds in intervals], "every": every,
                                         "after_commit": [seconds for committed, seconds in intervals if committed],
                                         "plain": [seconds for committed, seconds in intervals if not committed]}))


def launch(level: int, copies: bool, workers: int, steps: int, kill: bool, transport: str) -> dict:
    """One job; its step intervals, or the recovery time it reported."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kill:
            env["PHALANX_FAULTS"] = "step.end@1#6"
        command = [sys.executable, "-m", "phalanx", "run", "-n", str(workers), "--min-workers", "1", "--timeout", "60",
                   __file__, "--job", str(level), str(int(copies)), str(steps), out, transport]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=HERE.parent)
        if done.returncode != 0:
            return {"failed": (done.stdout + done.stderr)[-1500:]}
        result = json.loads(Path(out).read_text())
        recovered = re.findall(r"first step done ([\d.]+)s after the event", done.stderr)
        caught_up = re.findall(r"back past its last commit .* ([\d.]+)s after the event", done.stderr)
        if kill:
            result["recovery_s"] = float(recovered[0]) if recovered else None
            result["commit_s"] = float(caught_up[0]) if caught_up else result["recovery_s"]
        return result


def held_per_parameter(level: int, workers: int, shared: bool) -> tuple[float, float]:
    """Bytes a worker holds per parameter (Adam, float32; ``shared``: px.Sharded's units and copies in
    host shared memory, else its own and the copies with buddies) and what the elastic commits add,
    from the one place phalanx writes them down."""
    from phalanx.strategies.base import elastic_copies_per_worker, held_per_worker

    held = held_per_worker(4.0, 8.0, level, workers, shared=shared).total
    return held, elastic_copies_per_worker(4.0, 8.0, level, workers, one_host=shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", default="2,3,4")
    parser.add_argument("--levels", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--transport", default="auto", choices=["auto", "gloo"],
                        help="gloo: no shared memory, so px.Sharded's copies are kept by buddies (as between hosts)")
    parser.add_argument("--job", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        level, copies, steps, out, transport = args.job
        job(int(level), bool(int(copies)), int(steps), out, transport)
        return
    workers = [int(w) for w in args.workers.split(",")]
    levels = [int(level) for level in args.levels.split(",")]
    variants = [(level, True) for level in levels] + [(level, False) for level in levels if level]
    steps: dict[tuple[int, bool, int], list[float]] = {}
    recoveries: dict[tuple[int, int], list[float]] = {}
    commits: dict[tuple[int, int], list[float]] = {}
    in_job: dict[tuple[int, int], list[tuple[float, float]]] = {}  # a commit's cost and share, within one job
    failures: list[str] = []
    for rep in range(args.reps):
        order = [(w, v) for w in workers for v in variants] + [(w, (level, "kill")) for w in workers for level in levels]
        random.Random(rep).shuffle(order)
        for world, (level, mode) in order:
            kill = mode == "kill"
            result = launch(level, bool(mode), world, args.steps, kill, args.transport)
            name = f"L{level}{'' if mode else '-off'}{' killed' if kill else ''} at {world}"
            if "failed" in result:
                failures.append(f"{name}: {result['failed']}")
                print(f"rep {rep}: {name}: FAILED", flush=True)
                continue
            if kill:
                recoveries.setdefault((level, world), []).append(result["recovery_s"])
                commits.setdefault((level, world), []).append(result["commit_s"])
                print(f"rep {rep}: {name}: first step {result['recovery_s']} s, first commit {result['commit_s']} s "
                      "after the death", flush=True)
            else:
                mean = statistics.fmean(result["intervals"])  # a commit every few steps counts its share
                steps.setdefault((level, bool(mode), world), []).append(mean)
                said = f"rep {rep}: {name}: step + commit {mean * 1e3:.1f} ms"
                if result["every"] > 1 and result["plain"] and result["after_commit"]:
                    plain = statistics.median(result["plain"])
                    cost = statistics.median(result["after_commit"]) - plain
                    in_job.setdefault((level, world), []).append((cost, cost / (result["every"] * plain)))
                    said += f"; in the job a commit {cost * 1e3:.1f} ms, {in_job[(level, world)][-1][1]:+.1%} a step"
                print(said, flush=True)
    print("\n| workers | level | step + commit, copies (ms) | without copies (ms) | copies' share | "
          "a commit within the job: ms, share of its interval's steps | "
          "recovery to the first step (s) | to the first commit (s) | held B/param | copies B/param |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in workers:
        for level in levels:
            with_copies = steps.get((level, True, world), [])
            without = steps.get((level, False, world), [])
            ratio = (f"{statistics.median(with_copies) / statistics.median(without) - 1:+.1%}"
                     if with_copies and without else "")
            kept = [r for r in recoveries.get((level, world), []) if r is not None]
            caught_up = [r for r in commits.get((level, world), []) if r is not None]
            own, copies = held_per_parameter(level, world, shared=args.transport == "auto")
            print(f"| {world} | {'px.DataParallel' if level == 0 else f'px.Sharded({level})'} | "
                  f"{statistics.median(with_copies) * 1e3:.1f} | " if with_copies else f"| {world} | {level} | - | ",
                  end="")
            print(f"{statistics.median(without) * 1e3:.1f} | " if without else "- | ", end="")
            paired = in_job.get((level, world), [])
            print(f"{ratio} | " + (f"{statistics.median(c for c, _ in paired) * 1e3:.1f}, "
                                   f"{statistics.median(r for _, r in paired):+.1%} | " if paired else "- | "), end="")
            print(" | ".join(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
                                             if values else "-" for values in (kept, caught_up)) + " | ", end="")
            print(f"{own:.2f} | {copies:.2f} |")
    for failure in failures:
        print(f"\nFAILED {failure}")


if __name__ == "__main__":
    main()
