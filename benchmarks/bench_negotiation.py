"""What Horovod's name negotiation costs a collective, against phalanx's own matched by call order.

    phalanx run -n 2 benchmarks/bench_negotiation.py
    phalanx run -n 2 benchmarks/bench_negotiation.py --pairs 2000 --idle 10

Three ratios, each the median over paired samples taken alternately, call by call, in one run (which
of the two goes first alternates from pair to pair; both ranks run the same sequence):

- a lone ``hvd.allreduce`` of 4 float32 (one at a time: each waits for its own agreement) against
  ``px.allreduce`` of the same tensor;
- the same with 1 MiB (262,144 float32);
- 16 named ``hvd.allreduce_async`` of 4 float32 in flight, then synchronized, against the same 16
  allreduces as ``px.allreduce`` calls, one after the other (faster than 16 of them with
  ``async_op=True``, which hand each over to the shared-memory thread and back).

Then the idle cost: the CPU time each worker spends while Horovod is initialized and nothing is
submitted, over ``--idle`` seconds, per second of wall time (the whole process, and the negotiation
thread alone). Warm-up calls come first and are not counted.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Callable

import torch

import phalanx as px
import phalanx.horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--pairs", type=int, default=600, help="paired samples per ratio (x16: a sixth as many)")
parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle time measured")
args = parser.parse_args()

IN_FLIGHT = 16


def lone(tensor: torch.Tensor) -> Callable[[], None]:
    return lambda: hvd.allreduce(tensor, name="lone")


def by_call_order(tensor: torch.Tensor) -> Callable[[], None]:
    return lambda: px.allreduce(tensor, "avg")


def negotiated_in_flight(tensor: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        handles = [hvd.allreduce_async(tensor, name=f"flight.{k}") for k in range(IN_FLIGHT)]
        for handle in handles:
            hvd.synchronize(handle)
    return run


def in_flight_by_call_order(tensor: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for _ in range(IN_FLIGHT):
            px.allreduce(tensor, "avg")
    return run


def paired_ratio(negotiated: Callable[[], None], plain: Callable[[], None], pairs: int) -> tuple[float, float, float]:
    """Median over ``pairs`` of (time of ``negotiated``) / (time of ``plain``), alternating call by call;
    also both medians in seconds."""
    for _ in range(max(pairs // 10, 5)):  # warm-up
        negotiated()
        plain()
    ratios, mine, theirs = [], [], []
    order = [("hvd", negotiated), ("px", plain)]
    for pair in range(pairs):
        seconds = {}
        for which, call in order if pair % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            call()
            seconds[which] = time.perf_counter() - started
        ratios.append(seconds["hvd"] / seconds["px"])
        mine.append(seconds["hvd"])
        theirs.append(seconds["px"])
    return statistics.median(ratios), statistics.median(mine), statistics.median(theirs)


def idle_cpu(seconds: float) -> tuple[float, float]:
    """Cores used while idle: the process's, and the negotiation thread's."""
    thread = next(t for t in threading.enumerate() if t.name == "phalanx-horovod-negotiation")
    clock = time.pthread_getcpuclockid(thread.ident)
    time.sleep(0.5)  # whatever ran last has settled
    wall, process, negotiation = time.monotonic(), time.process_time(), time.clock_gettime(clock)
    time.sleep(seconds)
    wall = time.monotonic() - wall
    return (time.process_time() - process) / wall, (time.clock_gettime(clock) - negotiation) / wall


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    small, large = torch.ones(4), torch.ones(262144)
    rows = [("lone hvd.allreduce, 4 float32", paired_ratio(lone(small), by_call_order(small), args.pairs)),
            ("lone hvd.allreduce, 1 MiB", paired_ratio(lone(large), by_call_order(large), args.pairs)),
            (f"{IN_FLIGHT} hvd.allreduce_async in flight, 4 float32",
             paired_ratio(negotiated_in_flight(small), in_flight_by_call_order(small), max(args.pairs // 6, 10)))]
    hvd.barrier()
    idle = px.allgather_object(idle_cpu(args.idle))
    if hvd.rank() == 0:
        print(f"# {hvd.size()} workers, {args.pairs} pairs (x{IN_FLIGHT}: {max(args.pairs // 6, 10)}), "
              "medians of paired samples alternating call by call")
        print("| what | hvd | px | hvd/px, median of pairs |")
        print("|---|---:|---:|---:|")
        for what, (ratio, mine, theirs) in rows:
            print(f"| {what} | {mine * 1e6:.0f} us | {theirs * 1e6:.0f} us | {ratio:.2f}x |")
        for rank, (process, negotiation) in enumerate(idle):
            print(f"idle, rank {rank}: {process:.2%} of a core (the negotiation thread: {negotiation:.2%}) "
                  f"over {args.idle:.0f}s")
    hvd.shutdown()


if __name__ == "__main__":
    main()
