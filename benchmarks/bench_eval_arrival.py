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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import MODEL_SPECS, alternating, build_model, paired_table, run_as_job  # noqa: E402

BATCH = 64  # per worker


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import phalanx as px
    from phalanx.comm.communicator import Communicator

    px.init()
    ways = {"none": lambda self, name, advice: None, "with": Communicator.arrive}

    def timed(way: str) -> float:
        """Milliseconds per evaluation forward, the arrival being ``way`` meanwhile (on every rank)."""
        Communicator.arrive = ways[way]  # type: ignore[method-assign]
        px.barrier()
        started = time.perf_counter()
        for _ in range(10):
            wrapped(x)
        return (time.perf_counter() - started) / 10 * 1e3

    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build_model(name)
        strategy = px.Sharded(level=3, shared_memory=False)
        wrapped, _ = strategy.setup(model, torch.optim.Adam(model.parameters()))
        x = torch.randn(BATCH, *MODEL_SPECS[name]["input"])
        with torch.no_grad():
            wrapped(x)  # the forward's order, and warm caches
            rows.append((name, alternating(args.reps, list(ways), timed)))
        Communicator.arrive = ways["with"]  # type: ignore[method-assign]
        strategy.finish()
    if px.rank() == 0:
        print(paired_table(f"{px.size()} workers, level 3 without shared memory", "none", "with", rows), flush=True)
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
    return run_as_job(__file__, args.workers, ["--reps", str(args.reps), "--models", args.models])


if __name__ == "__main__":
    sys.exit(main())
