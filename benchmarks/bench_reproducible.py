"""Step time of reproducible mode against the default engine, in the same worker processes.

    phalanx run -n 2 benchmarks/bench_reproducible.py [--model cnn|mlp] [--reps 7] [--steps 15] [--micro 16]

Both variants train a benchmark model of bench_ddp.py with SGD: by default the CNN (BatchNorm,
3x32x32 inputs, global batch 64 = 32 per worker at world size 2), or the 5.25 M-parameter MLP. "default" is px.DataParallel and one backward over
the local batch; "reproducible" is px.ExactGradients over virtual micro-batches of --micro samples
(16 by default: bitwise the same result on 1, 2 or 4 workers). The variants alternate, each
repetition measuring both (order rotated); reported are the medians of the per-repetition step
time (each the median of --steps steps after warm-up) and the median of the paired ratios.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import phalanx as px

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import MODEL_SPECS, build_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--steps", type=int, default=15)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--micro", type=int, default=16)
parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
parser.add_argument("--global-batch", type=int, default=64)
args = parser.parse_args()

torch.set_num_threads(1)
px.init()
start, stop = px.data.share_bounds(args.global_batch, px.size(), px.rank(), args.micro)
generator = torch.Generator().manual_seed(0)
x = torch.randn(args.global_batch, *MODEL_SPECS[args.model]["input"], generator=generator)[start:stop]
y = torch.randint(0, 10, (args.global_batch,), generator=generator)[start:stop]


def make(variant: str):
    torch.manual_seed(0)
    model = px.DataParallel(build_model(args.model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if variant == "default":
        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    else:
        exact = px.ExactGradients(model, micro_batch_size=args.micro)

        def step() -> None:
            optimizer.zero_grad()
            exact.backward(F.cross_entropy, (x,), y, args.global_batch)
            optimizer.step()
    return step


def measure(step) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        px.barrier()
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    slowest = px.allreduce(torch.tensor([statistics.median(times)]), op="max")
    return float(slowest)


variants = {"default": make("default"), "reproducible": make("reproducible")}
results = {name: [] for name in variants}
for rep in range(args.reps):
    order = list(variants) if rep % 2 == 0 else list(reversed(variants))
    for name in order:
        results[name].append(measure(variants[name]))

if px.is_master():
    ratios = [r / d for r, d in zip(results["reproducible"], results["default"])]
    print(f"world size {px.size()}, {args.model.upper()}, global batch {args.global_batch}, micro-batch {args.micro}, "
          f"{args.reps} reps x {args.steps} steps")
    for name, values in results.items():
        print(f"{name:13s} step {statistics.median(values) * 1e3:7.1f} ms  "
              f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")
    print(f"reproducible / default step time: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
