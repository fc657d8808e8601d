"""Step time of px.fit in float32 against bf16-mixed and 16-mixed on the CPU, in the same processes.

    python benchmarks/bench_precision.py [--model mlp|cnn|transformer] [--reps 7] [--steps 15]
    phalanx run -n 2 benchmarks/bench_precision.py ...
    python benchmarks/bench_precision.py --variants 32,on_nonfinite=ignore 32   # what the NaN check costs

A variant is a precision, optionally followed by px.fit options (``,name=value``, values as strings).

Each variant is a whole px.fit (one epoch of --steps + --warmup global batches of bench_ddp.py's
model, SGD), timed per step by a callback; the variants alternate, each repetition running all
of them (order rotated). Reported: the median over repetitions of each variant's median step
time, and the median of the paired ratios against float32 (above 1: faster than float32).
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
parser.add_argument("--model", choices=["cnn", "mlp", "transformer"], default="mlp")
parser.add_argument("--global-batch", type=int, default=96)
parser.add_argument("--variants", nargs="+", default=["32", "bf16-mixed", "16-mixed"])
args = parser.parse_args()

torch.set_num_threads(1)
px.init()
samples = args.global_batch * (args.steps + args.warmup)
generator = torch.Generator().manual_seed(0)
x = torch.randn(samples, *MODEL_SPECS[args.model]["input"], generator=generator)
y = torch.randint(0, 10, (samples,), generator=generator)


class StepTimes(px.callbacks.Callback):
    """Wall time of every step after the warm-up."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._started = 0.0

    def on_step_begin(self, step, state) -> None:  # noqa: ANN001
        self._started = time.perf_counter()

    def on_step_end(self, step, logs, state) -> None:  # noqa: ANN001
        if step >= args.warmup:
            self.times.append(time.perf_counter() - self._started)


def run(variant: str) -> float:
    precision, *options = variant.split(",")
    torch.manual_seed(0)
    model = build_model(args.model)
    timer = StepTimes()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, (x, y), epochs=1,
           global_batch_size=args.global_batch, precision=precision, verbose=0, callbacks=[timer],
           **dict(option.split("=", 1) for option in options))
    return statistics.median(timer.times)


times: dict[str, list[float]] = {variant: [] for variant in args.variants}
for rep in range(args.reps):
    order = args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]
    for variant in order:
        times[variant].append(run(variant))
if px.is_master():
    print(f"# {args.model}, global batch {args.global_batch}, {px.size()} worker(s), torch {torch.__version__}, "
          f"{args.reps} reps x {args.steps} steps")
    print(f"| variant | step ms, median [quartiles] | throughput vs {args.variants[0]} [quartiles] |")
    print("|---|---:|---:|")
    for variant, values in times.items():
        ratios = [base / value for base, value in zip(times[args.variants[0]], values)]
        quart = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        rq = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"| {variant} | {1e3 * statistics.median(values):.1f} [{1e3 * quart[0]:.1f}..{1e3 * quart[2]:.1f}] | "
              f"{statistics.median(ratios):.3f}x [{rq[0]:.3f}..{rq[2]:.3f}] |")
