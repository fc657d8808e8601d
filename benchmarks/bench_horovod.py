"""Training-step time of examples/horovod_mnist.py's setup (hvd.DistributedOptimizer) against
px.DataParallel on the same model, in the same two worker processes, alternating.

    python benchmarks/bench_horovod.py                 # both models, 2 workers (started through phalanx run)
    python benchmarks/bench_horovod.py --models cnn --reps 5

Models: ``cnn`` is the example's network on scikit-learn's digits (batch 32 per worker, as the
example); ``mlp`` is benchmarks/RESULTS.md's MLP (1024-2048-1024-1024-10, batch 96 per worker), the
shape of the issue's Horovod figures. Variants: ``horovod`` (hvd.DistributedOptimizer around SGD,
as the example builds it), ``phalanx`` (px.DataParallel and plain SGD), ``ddp`` (torch's
DistributedDataParallel, as a yardstick for the issue's Horovod-vs-DDP figure), ``compute`` (no
communication: the floor). Each repetition measures every variant once, in a shuffled order (the
same on every rank): ``--warmup`` steps, then the median of ``--steps`` steps; a world's step time
is its slowest rank's. Reported: medians [quartiles] over repetitions and the median of the
per-repetition ratios horovod/phalanx (above 1: the Horovod API is slower).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("horovod", "phalanx", "ddp", "compute")


def build(model: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (same weights on every rank) and this rank's batches."""
    import phalanx.horovod.torch as hvd

    torch.manual_seed(0)
    if model == "cnn":
        sys.path.insert(0, str(REPO / "examples"))
        sys.argv = sys.argv[:1]
        from horovod_mnist import Net, datasets

        train, _ = datasets()
        sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
        loader = torch.utils.data.DataLoader(train, batch_size=32, sampler=sampler)
        return Net(), [(x, y) for x, y in loader][:20]
    net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                        nn.ReLU(), nn.Linear(1024, 10))
    generator = torch.Generator().manual_seed(hvd.rank())
    return net, [(torch.randn(96, 1024, generator=generator), torch.randint(0, 10, (96,), generator=generator))
                 for _ in range(4)]


def variant(name: str, model: str) -> tuple[Callable[[int], None], list]:
    """One training step of ``name`` (index into the batches), and the batches."""
    import phalanx as px
    import phalanx.horovod.torch as hvd

    net, batches = build(model)
    loss_fn = F.nll_loss if model == "cnn" else F.cross_entropy
    optimizer: Any = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.5)
    if name == "horovod":
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    elif name == "phalanx":
        net = px.DataParallel(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.5)
    elif name == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.5)

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        optimizer.zero_grad()
        loss_fn(net(x), y).backward()
        optimizer.step()

    return step, batches


def worker(args: argparse.Namespace) -> None:
    import phalanx.horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    for model in args.models:
        steps = {name: variant(name, model)[0] for name in VARIANTS}
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        order = random.Random(0)
        for _ in range(args.reps):
            names = list(VARIANTS)
            order.shuffle(names)
            for name in names:
                for k in range(args.warmup):
                    steps[name](k)
                hvd.barrier()
                samples = []
                for k in range(args.steps):
                    start = time.perf_counter()
                    steps[name](k)
                    samples.append(time.perf_counter() - start)
                slowest = max(hvd.allgather_object(statistics.median(samples)))
                times[name].append(slowest * 1e3)
        if hvd.rank() == 0:
            report(model, times)
    hvd.shutdown()


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.2f} [{q[0]:.2f}..{q[2]:.2f}]"


def report(model: str, times: dict[str, list[float]]) -> None:
    ratios = [h / p for h, p in zip(times["horovod"], times["phalanx"])]
    print(f"\n{model}, 2 workers, {len(ratios)} repetitions: step time in ms, median [quartiles]")
    print("| variant | step ms | samples/s per worker |")
    print("|---|---|---|")
    batch = 32 if model == "cnn" else 96
    for name in VARIANTS:
        print(f"| {name} | {_quartiles(times[name])} | {batch / statistics.median(times[name]) * 1e3:.0f} |")
    print(f"horovod/phalanx step-time ratio: {_quartiles(ratios)} (paired per repetition)")
    to_ddp = [h / d for h, d in zip(times["horovod"], times["ddp"])]
    print(f"horovod/ddp step-time ratio: {_quartiles(to_ddp)} (paired per repetition)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=["cnn", "mlp"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if "PHALANX_RANK" in os.environ:
        worker(args)
        return 0
    command = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--no-prefix", __file__, *sys.argv[1:]]
    return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
