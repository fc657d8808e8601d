"""How long a job takes to start and end: ``phalanx run`` against ``torchrun``, same script.

    python benchmarks/bench_launch.py
    python benchmarks/bench_launch.py --workers 1 2 4 --reps 9 --script barrier first-step

Two scripts. ``barrier`` imports phalanx, joins the job (``px.init()``), passes one barrier and
exits: the launcher's own cost (starting workers, the rendezvous, shutting down), which every short
job, test and ``phalanx tune`` trial pays. ``first-step`` also builds a small model and its optimizer
and takes one step, as every training script does: a torch optimizer loads TorchDynamo when the
first one is made (about as costly as importing torch), which the fork server has loaded already. Three launches: ``phalanx run`` (workers forked
from its fork server, which imported torch once), ``phalanx run --no-fork-server`` (each worker a
fresh python importing torch, as before the fork server) and ``torchrun`` (one import in its
launcher, one in every worker). Each repetition runs all three, in an order rotated per repetition;
reported are the median wall time of each and the medians of the paired ratios against torchrun.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = {
    "barrier": """\
import torch
import phalanx as px

torch.set_num_threads(1)
px.init()
px.barrier()
""",
    "first-step": """\
import torch
import phalanx as px

torch.set_num_threads(1)
px.init()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 8)).sum().backward()
for parameter in model.parameters():
    px.allreduce_(parameter.grad)
optimizer.step()
px.barrier()
""",
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--script", nargs="+", choices=sorted(SCRIPTS), default=["barrier"])
args = parser.parse_args()


def commands(script: Path, workers: int) -> dict[str, list[str]]:
    phalanx = [sys.executable, "-m", "phalanx", "run", "-n", str(workers)]
    return {"phalanx run": [*phalanx, str(script)],
            "phalanx run --no-fork-server": [*phalanx, "--no-fork-server", str(script)],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
                         "--standalone", str(script)]}


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        print("| script | workers | phalanx run (s) | --no-fork-server (s) | torchrun (s) | phalanx run / torchrun "
              "[min..max] | --no-fork-server / torchrun [min..max] |")
        print("|---|---|---|---|---|---|---|")
        for kind in args.script:
            script = Path(folder) / f"{kind}.py"
            script.write_text(SCRIPTS[kind])
            for workers in args.workers:
                variants = commands(script, workers)
                times: dict[str, list[float]] = {name: [] for name in variants}
                names = list(variants)
                for rep in range(args.reps):
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        times[name].append(seconds(variants[name]))
                cells = [f"{statistics.median(times[name]):.2f}" for name in names]
                for name in names[:2]:
                    ratios = [a / b for a, b in zip(times[name], times["torchrun"])]
                    cells.append(f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]")
                print(f"| {kind} | {workers} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
