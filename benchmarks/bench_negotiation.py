"""What Horovod's name negotiation costs a collective, against the same collective matched by call order.

    phalanx run -n 2 benchmarks/bench_negotiation.py
    phalanx run -n 2 benchmarks/bench_negotiation.py --sizes 4 262144 --reps 9 --ops 200

Variants, on tensors of ``--sizes`` float32 elements, in the same worker processes, alternating
(the order rotated per repetition): ``hvd.allreduce`` (negotiated, one at a time: every call
waits for a negotiation cycle), ``hvd.allreduce_async x16`` (16 negotiated at once, then
synchronized: one cycle agrees all of them), ``px.allreduce`` (phalanx's collective, matched by call
order: what ``hvd.allreduce`` ran before negotiation) and ``dist.all_reduce`` (torch.distributed on
Gloo, no checks). Reported per variant: the median over repetitions of the time per operation,
and the median of the per-repetition ratios against ``px.allreduce``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import phalanx as px
import phalanx.horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", type=int, nargs="+", default=[4, 262144])
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--ops", type=int, default=160)
args = parser.parse_args()


def one_at_a_time(tensor: torch.Tensor) -> None:
    for k in range(args.ops):
        hvd.allreduce(tensor, name=f"one.{k}")


def sixteen_at_once(tensor: torch.Tensor) -> None:
    for first in range(0, args.ops, 16):
        handles = [hvd.allreduce_async(tensor, name=f"many.{k}") for k in range(first, first + 16)]
        for handle in handles:
            hvd.synchronize(handle)


def by_call_order(tensor: torch.Tensor) -> None:
    for _ in range(args.ops):
        px.allreduce(tensor, "avg")


def torch_gloo(tensor: torch.Tensor) -> None:
    for _ in range(args.ops):
        dist.all_reduce(tensor.clone())


VARIANTS: dict[str, Callable[[torch.Tensor], None]] = {
    "px.allreduce": by_call_order, "hvd.allreduce": one_at_a_time,
    "hvd.allreduce_async x16": sixteen_at_once, "dist.all_reduce": torch_gloo}


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    names = list(VARIANTS)
    for size in args.sizes:
        tensor = torch.ones(size)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                hvd.barrier()
                started = time.perf_counter()
                VARIANTS[name](tensor)
                seconds[name].append((time.perf_counter() - started) / args.ops)
        if hvd.rank() == 0:
            print(f"# {size} float32 ({size * 4} bytes), {hvd.size()} workers, {args.reps} reps x {args.ops} ops")
            print("| variant | time per op, median | vs px.allreduce, median [min..max] |")
            print("|---|---:|---:|")
            for name in names:
                ratios = [mine / base for mine, base in zip(seconds[name], seconds["px.allreduce"])]
                print(f"| {name} | {statistics.median(seconds[name]) * 1e6:.0f} us | {statistics.median(ratios):.2f}x "
                      f"[{min(ratios):.2f}..{max(ratios):.2f}] |")
    hvd.shutdown()


if __name__ == "__main__":
    main()
