"""What level 3's check against a rank evaluating alone costs an evaluation.

    python benchmarks/bench_eval_arrival.py [--workers 2] [--reps 12] [--models mlp,transformer]

At px.Sharded(level=3) without shared memory (as between hosts) every forward gathers each block from
every rank, so a forward without gradients first waits for every rank through the store (a rank
evaluating alone is refused instead of meeting the others' training gathers). This measures that
arrival against none in one job (``python -m phalanx run -n W`` of this file), the two alternating
in blocks of 10 evaluation forwards of benchmarks/bench_ddp.py's models (batch 64 per worker, one
intra-op thread per worker); the "none" blocks replace the arrival with a no-op on every rank. Rank 0
prints the median forward time of each and the ratio (with / without: above 1 is the cost).
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

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import bench_ddp
    import phalanx as px
    from phalanx.comm.communicator import Communicator

    px.init()
    arrive = Communicator.arrive
    ways = {"with": arrive, "none": lambda self, name, advice: None}
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = bench_ddp.build_model(name)
        strategy = px.Sharded(level=3, shared_memory=False)
        wrapped, _ = strategy.setup(model, torch.optim.Adam(model.parameters()))
        shape = {"mlp": (64, 1024), "cnn": (64, 3, 32, 32), "transformer": (64, 32, 128)}[name]
        x = torch.randn(*shape)
        times: dict[str, list[float]] = {way: [] for way in ways}
        with torch.no_grad():
            wrapped(x)  # the forward's order, and warm caches
            for rep in range(args.reps):
                for way in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
                    Communicator.arrive = ways[way]  # type: ignore[method-assign]
                    px.barrier()
                    started = time.perf_counter()
                    for _ in range(10):
                        wrapped(x)
                    times[way].append((time.perf_counter() - started) / 10 * 1e3)
        Communicator.arrive = arrive  # type: ignore[method-assign]
        strategy.finish()
        ratios = [w / n for w, n in zip(times["with"], times["none"])]
        rows.append((name, statistics.median(times["none"]), statistics.median(times["with"]), ratios))
    if px.rank() == 0:
        print(f"| {px.size()} workers, level 3 without shared memory | no arrival (ms) | with (ms) | ratio |")
        print("|---|---|---|---|")
        for name, none, with_, ratios in rows:
            print(f"| {name} | {none:.2f} | {with_:.2f} | {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}..{max(ratios):.3f}] |", flush=True)
    px.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                                      os.environ.get("PYTHONPATH", "")]))}
    return subprocess.call([sys.executable, "-m", "phalanx", "run", "-n", str(args.workers), __file__, "--worker",
                            "--reps", str(args.reps), "--models", args.models], env=env)


if __name__ == "__main__":
    sys.exit(main())
