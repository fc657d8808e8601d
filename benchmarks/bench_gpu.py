"""The GPU path against its peers, in the same processes, alternating:

    phalanx run -n 1 --device cuda benchmarks/bench_gpu.py --part fit          # px.fit vs a hand-written loop
    phalanx run -n G --device cuda benchmarks/bench_gpu.py --part ddp          # px.DataParallel vs DDP, G GPUs
    phalanx run -n G --device cuda benchmarks/bench_gpu.py --part reproducible # reproducible vs default px.fit
    phalanx run -n 1 --device cuda benchmarks/bench_gpu.py --part profile      # where reproducible mode's time goes

``fit``: one epoch of ``--steps`` (+ ``--warmup``) global batches of bench_ddp.py's CNN and small
transformer, SGD with momentum; px.fit against the loop a PyTorch user writes (a DataLoader with
pinned memory, ``non_blocking`` copies, zero_grad/forward/backward/step) and against the fastest
loop by hand (the dataset moved to the device once, batches by shuffled index), and px.fit with
``data_on_device=False`` (batches copied on a side stream one step ahead) and with
``on_nonfinite="ignore"`` (no check of the gradient, no sync a step), throughput measured from
the first step after the warm-up to the last, with the GPU synchronised. ``ddp``: the same
steps through ``px.DataParallel`` and ``torch.nn.parallel.DistributedDataParallel`` (default
settings) over NCCL. ``reproducible``: px.fit with ``reproducible=True, micro_batch_size=32``
against the default. Each repetition runs every variant once, the order rotated; reported: the
median over repetitions of each variant's samples per second, and the median of the paired
ratios against the first variant. The device is printed with the table. ``profile``: reproducible
px.fit's steps after the warm-up under ``torch.profiler``, the operators by self CUDA and self CPU
time, and the GPU's busy share of the wall time. Runs on the CPU as well (``--device cpu``), for a
smoke test.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import MODEL_SPECS, build_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--part", choices=["fit", "ddp", "reproducible", "profile"], default="fit")
parser.add_argument("--models", nargs="+", default=["cnn", "transformer"])
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--global-batch", type=int, default=256)
parser.add_argument("--profile-mode", choices=["reproducible", "default"], default="reproducible",
                    help="--part profile: which px.fit to profile")
args = parser.parse_args()


def synchronize() -> None:
    if px.device().type == "cuda":
        torch.cuda.synchronize()


def dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    samples = args.global_batch * (args.steps + args.warmup)
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(samples, *MODEL_SPECS[name]["input"], generator=generator),
            torch.randint(0, 10, (samples,), generator=generator))


class Clock(px.callbacks.Callback):
    """Seconds from the end of the warm-up to the end of the last step, the GPU synchronised."""

    def __init__(self) -> None:
        self.started = self.seconds = 0.0

    def on_step_end(self, step, logs, state) -> None:  # noqa: ANN001
        if step + 1 == args.warmup:
            synchronize()
            self.started = time.perf_counter()
        elif step + 1 == args.warmup + args.steps:
            synchronize()
            self.seconds = time.perf_counter() - self.started


def px_fit(name: str, **options: object) -> float:
    torch.manual_seed(0)
    model, clock = build_model(name), Clock()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, dataset(name),
           epochs=1, global_batch_size=args.global_batch, verbose=0, callbacks=[clock], **options)
    return args.steps * args.global_batch / clock.seconds


def hand_written(name: str) -> float:
    """The loop a PyTorch user writes on one device."""
    torch.manual_seed(0)
    device = px.device()
    model = build_model(name).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(TensorDataset(*dataset(name)), batch_size=args.global_batch, shuffle=True,
                        pin_memory=device.type == "cuda")
    started = 0.0
    for step, (inputs, targets) in enumerate(loader):
        if step == args.warmup:
            synchronize()
            started = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    synchronize()
    return args.steps * args.global_batch / (time.perf_counter() - started)


def wrapped_loop(name: str, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> float:
    """``--steps`` steps of this worker's share of the global batch through ``wrap(model)``."""
    torch.manual_seed(0)
    device = px.device()
    model = wrap(build_model(name).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = dataset(name)
    share = args.global_batch // px.size()
    inputs, targets = x[:share].to(device), y[:share].to(device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    synchronize()
    return args.steps * share * px.size() / (time.perf_counter() - started)


def hand_written_on_device(name: str) -> float:
    """The fastest loop by hand: the whole dataset on the device once, batches by shuffled index."""
    torch.manual_seed(0)
    device = px.device()
    model = build_model(name).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = (t.to(device) for t in dataset(name))
    order = torch.randperm(len(x), device=device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            started = time.perf_counter()
        batch = order[step * args.global_batch:(step + 1) * args.global_batch]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    synchronize()
    return args.steps * args.global_batch / (time.perf_counter() - started)


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    ids = [px.device().index] if px.device().type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


VARIANTS: dict[str, dict[str, Callable[[str], float]]] = {
    "fit": {"hand-written": hand_written, "px.fit": px_fit, "hand-written, data on device": hand_written_on_device,
            "px.fit, data_on_device=False": lambda name: px_fit(name, data_on_device=False),
            "px.fit, on_nonfinite=ignore": lambda name: px_fit(name, on_nonfinite="ignore")},
    "ddp": {"DDP": lambda name: wrapped_loop(name, ddp),
            "px.DataParallel": lambda name: wrapped_loop(name, px.DataParallel)},
    "reproducible": {"default": px_fit,
                     "reproducible": lambda name: px_fit(name, reproducible=True, micro_batch_size=32)},
}


class Profiled(px.callbacks.Callback):
    """``torch.profiler`` over the steps after the warm-up."""

    def __init__(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if px.device().type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.clock = Clock()

    def on_step_end(self, step, logs, state) -> None:  # noqa: ANN001
        self.clock.on_step_end(step, logs, state)
        if step + 1 == args.warmup:
            self.profiler.start()
        elif step + 1 == args.warmup + args.steps:
            synchronize()
            self.profiler.stop()


def profile(name: str) -> None:
    """Where a px.fit step goes (``--profile-mode``): operators by self time, how busy the GPU was,
    and px.fit's Python functions by own time (cProfile, a second run)."""
    options = dict(reproducible=True, micro_batch_size=32) if args.profile_mode == "reproducible" else {}
    torch.manual_seed(0)
    model, profiled = build_model(name), Profiled()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, dataset(name),
           epochs=1, global_batch_size=args.global_batch, verbose=0, callbacks=[profiled], **options)
    events = profiled.profiler.key_averages()
    on_gpu = sum(event.self_device_time_total for event in events) / 1e6
    wall = profiled.clock.seconds
    print(f"# profile: {name}, px.fit {options or 'default'}, {args.steps} steps: {wall * 1e3 / args.steps:.2f} "
          f"ms a step, the GPU busy {on_gpu / wall:.0%} of it ({on_gpu * 1e3 / args.steps:.2f} ms a step)")
    sort = "self_cuda_time_total" if px.device().type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    python = cProfile.Profile()
    python.runcall(px_fit, name, **options)
    pstats.Stats(python).sort_stats("tottime").print_stats(30)


def main() -> None:
    torch.set_num_threads(1)
    px.init()
    if args.part == "profile":
        for name in args.models:
            profile(name)
        return
    if args.part == "ddp" and px.size() < 2:
        raise SystemExit("--part ddp compares gradient reduction across workers: run it with -n 2 or more")
    device = torch.cuda.get_device_name(px.device()) if px.device().type == "cuda" else "CPU"
    variants = VARIANTS[args.part]
    names = list(variants)
    for name in args.models:
        rates: dict[str, list[float]] = {variant: [] for variant in names}
        for rep in range(args.reps):
            for variant in names[rep % len(names):] + names[:rep % len(names)]:
                rates[variant].append(variants[variant](name))
        if px.is_master():
            print(f"# {args.part}: {name}, {device} x {px.size()}, global batch {args.global_batch}, "
                  f"torch {torch.__version__}, {args.reps} reps x {args.steps} steps")
            print(f"| variant | samples/s, median | vs {names[0]}, median [min..max] |")
            print("|---|---:|---:|")
            for variant in names:
                ratios = [mine / base for mine, base in zip(rates[variant], rates[names[0]])]
                print(f"| {variant} | {statistics.median(rates[variant]):.0f} | {statistics.median(ratios):.3f}x "
                      f"[{min(ratios):.3f}..{max(ratios):.3f}] |")


if __name__ == "__main__":
    main()
