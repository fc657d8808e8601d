"""What an elastic job pays for waits its watchdog can abort (phalanx.comm.waiting).

    python benchmarks/bench_abortable_waits.py [--workers 2] [--reps 7] [--steps 20]
                                               [--models mlp,cnn,transformer] [--transport gloo]

An elastic job over Gloo waits for each collective on a helper thread, so that a survivor leaves a
broken generation at once even where Gloo holds a transfer cut part-way until its timeout. This
measures that hand-off against the backend's own wait in one elastic job (``python -m phalanx run
-n W --min-workers 1`` of this file), the two alternating in blocks within each repetition, on the
same processes: px.DataParallel training steps of benchmarks/bench_ddp.py's models (batch 64 per
worker, SGD, one intra-op thread per worker) and a lone allreduce of 1 KB. Rank 0 prints the median
step time of each and the ratio (abortable / backend's own: above 1 is the cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import bench_ddp
    import phalanx as px
    from phalanx.comm.waiting import Waits

    px.init(transport=args.transport)
    communicator = px.communicator()
    assert communicator.waits.abortable, "an elastic job over Gloo waits abortably"
    ways = {"abortable": communicator.waits, "backend": Waits()}
    times: dict[tuple[str, str], list[float]] = {}
    torch.manual_seed(0)
    for name in args.models.split(","):
        model = px.DataParallel(bench_ddp.build_model(name))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        shape = {"mlp": (64, 1024), "cnn": (64, 3, 32, 32), "transformer": (64, 32, 128)}[name]
        x, y = torch.randn(*shape), torch.randint(0, 10, (64,))
        for _ in range(3):  # warm-up: buckets laid out, caches filled
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        for rep in range(args.reps):
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            for way in order:
                communicator.waits = ways[way]
                px.barrier()
                started = time.perf_counter()
                for _ in range(args.steps):
                    optimizer.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
                times.setdefault((name, way), []).append((time.perf_counter() - started) / args.steps * 1e3)
    small = torch.ones(256)
    for rep in range(args.reps):
        for way in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
            communicator.waits = ways[way]
            px.barrier()
            started = time.perf_counter()
            for _ in range(200):
                px.allreduce(small)
            times.setdefault(("allreduce 1 KB", way), []).append((time.perf_counter() - started) / 200 * 1e3)
    communicator.waits = ways["abortable"]
    if px.rank() == 0:
        print(f"| {px.size()} workers, transport {args.transport} | backend's wait (ms) | abortable (ms) | ratio |")
        print("|---|---|---|---|")
        for name in [*args.models.split(","), "allreduce 1 KB"]:
            own, abortable = times[(name, "backend")], times[(name, "abortable")]
            ratios = [a / b for a, b in zip(abortable, own)]
            print(f"| {name} | {statistics.median(own):.3f} | {statistics.median(abortable):.3f} | "
                  f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}] |", flush=True)
    px.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "auto"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                                      os.environ.get("PYTHONPATH", "")]))}
    command = [sys.executable, "-m", "phalanx", "run", "-n", str(args.workers), "--min-workers", "1", __file__,
               "--worker", "--reps", str(args.reps), "--steps", str(args.steps), "--models", args.models,
               "--transport", args.transport]
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
