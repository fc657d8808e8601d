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
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import MODEL_SPECS, alternating, build_model, paired_table, run_as_job  # noqa: E402

BATCH = 64  # per worker


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import phalanx as px
    from phalanx.comm.waiting import Waits

    px.init(transport=args.transport)
    communicator = px.communicator()
    assert communicator.waits.abortable, "an elastic job over Gloo waits abortably"
    ways = {"backend": Waits(), "abortable": communicator.waits}

    def timed(way: str, run: Callable[[], object], count: int) -> float:
        """Milliseconds per call of ``run``, the generation waiting ``way`` meanwhile."""
        communicator.waits = ways[way]
        px.barrier()
        started = time.perf_counter()
        for _ in range(count):
            run()
        return (time.perf_counter() - started) / count * 1e3

    rows = []
    torch.manual_seed(0)
    for name in args.models.split(","):
        model = px.DataParallel(build_model(name))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(BATCH, *MODEL_SPECS[name]["input"]), torch.randint(0, 10, (BATCH,))

        def steps() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(3):  # warm-up: buckets laid out, caches filled
            steps()
        rows.append((name, alternating(args.reps, list(ways), lambda way: timed(way, steps, args.steps))))
    small = torch.ones(256)
    rows.append(("allreduce 1 KB", alternating(args.reps, list(ways), lambda way: timed(way, lambda: px.allreduce(small),
                                                                                        200))))
    communicator.waits = ways["abortable"]
    if px.rank() == 0:
        print(paired_table(f"{px.size()} workers, transport {args.transport}", "backend", "abortable", rows), flush=True)
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
    return run_as_job(__file__, args.workers, ["--reps", str(args.reps), "--steps", str(args.steps), "--models",
                                               args.models, "--transport", args.transport], elastic=True)


if __name__ == "__main__":
    sys.exit(main())
