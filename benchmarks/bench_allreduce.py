"""Allreduce on one host: shared memory against Gloo and phalanx's algorithms over Gloo messages.

    python benchmarks/bench_allreduce.py [--worlds 2 3 4] [--reps 7] [--variants shm shm+check gloo]
    python benchmarks/bench_allreduce.py --worlds 2 --busy 2 --runs 5   # idle and contended, alternating
    python benchmarks/bench_allreduce.py --netns [--reps 5]     # root: 2 hosts x 2 workers, 1 Gbit/s

For each world size one `phalanx run` job; inside it, for each tensor size (4 KB to 100 MB of
float32) every variant runs once per repetition, in an order shuffled the same on every rank:

  shm        px.allreduce_(check=False) with the default transport (shared memory: all workers on this host)
  shm+check  px.allreduce_ as users call it, with the cross-rank check of shapes and dtypes
  gloo       torch.distributed.all_reduce on the Gloo group (its ring)
  ring, tree, halving_doubling   px.allreduce_(algorithm=...) over Gloo point-to-point messages

Each measurement is a burst of back-to-back allreduces after one barrier (10 up to 1 MB, 3 at
21 MB, 1 at 100 MB), divided by their number, so that the ranks' uneven exit from the barrier
is not counted as allreduce time. Reported on rank 0: median wall ms per allreduce, median CPU
ms of the process per allreduce (all threads: spinning shows here), and the ratios Gloo / shm (and
Gloo / shm+check where both run).

With --busy N every job runs twice: idle, and with N busy processes (a loop in Python each,
unpinned, at normal priority: data-loader workers, a second job, a noisy neighbour) beside the
workers for the job's whole life; with --runs K that pair runs K times, which of the two goes
first alternating. Each cell is then the median over the runs of each run's median, and each ratio
the median of the runs' ratios (Gloo measured in the same processes, in the same run); --json
keeps every run's rows.

With --netns the job runs on two
network namespaces joined by a 1 Gbit/s veth (bench_ddp.py's), two workers in each: "shm" is then
the hierarchical allreduce (shared memory within a namespace, Gloo's ring between), "gloo" the
flat ring, "ring"/"tree"/"halving_doubling" the hierarchical allreduce with that algorithm
between namespaces, and "auto" the hierarchical one with the cost model's choice per slice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

SIZES = (4 << 10, 64 << 10, 1 << 20, 21 << 20, 100 << 20)
VARIANTS = ("shm", "shm+check", "gloo", "ring", "tree", "halving_doubling")
ACROSS = (*VARIANTS, "auto")  # two hosts: the algorithm between them, and the cost model's pick


def job(reps: int, variants: tuple[str, ...], sizes: tuple[int, ...] = SIZES) -> None:
    import phalanx as px

    torch.set_num_threads(1)
    px.init()
    assert px.comm.runtime.shm_executor() is not None, "shared memory is not in use"
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4)
        wall: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        runs = reps if size < (50 << 20) else max(3, reps // 2)
        burst = 10 if size <= (1 << 20) else 3 if size < (50 << 20) else 1
        for rep in range(runs):
            order = list(variants)
            random.Random(rep * 7919 + size).shuffle(order)
            for variant in order:
                px.barrier()
                started, cpu_started = time.perf_counter(), time.process_time()
                for _ in range(burst):
                    if variant == "gloo":
                        dist.all_reduce(tensor)
                    elif variant in ("shm", "shm+check"):
                        px.allreduce_(tensor, check=variant == "shm+check")
                    else:
                        px.allreduce_(tensor, check=False, algorithm=variant)
                wall[variant].append((time.perf_counter() - started) / burst)
                cpu[variant].append((time.process_time() - cpu_started) / burst)
                tensor.fill_(1.0)
        rows.append((size, {v: (statistics.median(wall[v]), statistics.median(cpu[v])) for v in variants}))
    if px.rank() == 0:
        for size, found in rows:
            print(json.dumps({"world": px.size(), "size": size, "wall": {v: found[v][0] for v in variants},
                              "cpu": {v: found[v][1] for v in variants}}), flush=True)


def _ratios(variants: tuple[str, ...]) -> list[str]:
    return [shm for shm in ("shm", "shm+check") if shm in variants and "gloo" in variants]


def table(rows: list[dict], variants: tuple[str, ...]) -> str:
    """Markdown rows of the median over runs of every cell, and of the ratios Gloo / shm."""
    lines = []
    for world, size in dict.fromkeys((row["world"], row["size"]) for row in rows):
        runs = [row for row in rows if row["world"] == world and row["size"] == size]
        cells = [f"{1e3 * statistics.median(r['wall'][v] for r in runs):.2f} "
                 f"({1e3 * statistics.median(r['cpu'][v] for r in runs):.2f})" for v in variants]
        ratios = [f"{statistics.median(r['wall']['gloo'] / r['wall'][shm] for r in runs):.1f}x"
                  for shm in _ratios(variants)]
        lines.append(f"| {world} | {_human(size)} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def header(variants: tuple[str, ...]) -> str:
    names = [f"{v} ms (CPU ms)" for v in variants] + [f"Gloo / {shm}" for shm in _ratios(variants)]
    return "| W | size | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 2) + "|"


def _human(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def netns_job(reps: int) -> None:
    from bench_ddp import NETNS, NETNS_ADDR, netns_down, netns_up

    netns_up("1gbit")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        launchers = [subprocess.Popen(
            ["ip", "netns", "exec", NETNS[node], sys.executable, "-m", "phalanx", "run", "-n", "2", "--nnodes", "2",
             "--node-rank", str(node), "--master-addr", NETNS_ADDR[0], "--master-port", "29561", "--no-prefix",
             __file__, "--job", "--across", "--reps", str(reps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env) for node in (0, 1)]
        outputs = [launcher.communicate(timeout=1200) for launcher in launchers]
        if any(launcher.returncode for launcher in launchers):
            raise SystemExit("\n".join(err[-2000:] for _, err in outputs))
        rows = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
        print("Gloo: the flat ring; shm: hierarchical.\n" + header(ACROSS) + "\n" + table(rows, ACROSS))
    finally:
        netns_down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes (default 4 KB to 100 MB)")
    parser.add_argument("--busy", type=int, default=0, help="also run each job beside N busy processes")
    parser.add_argument("--runs", type=int, default=1, help="runs (of each condition), medians over them")
    parser.add_argument("--json", help="also write every run's rows here")
    parser.add_argument("--netns", action="store_true", help="two namespaces of two workers, 1 Gbit/s (root)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--across", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = tuple(args.variants)
    if args.job:
        job(args.reps, ACROSS if args.across else variants, tuple(args.sizes))
        return
    if args.netns:
        netns_job(args.reps)
        return
    conditions = (0, args.busy) if args.busy else (0,)
    found: dict[int, list[dict]] = {busy: [] for busy in conditions}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, 1-minute load {os.getloadavg()[0]:.2f}; worlds {args.worlds}, "
          f"reps {args.reps}, runs {args.runs}, busy {args.busy}", flush=True)
    for run in range(args.runs):
        for busy in conditions if run % 2 == 0 else conditions[::-1]:
            for world in args.worlds:
                rows = run_job(world, args.reps, variants, args.sizes, busy)
                found[busy] += rows
                print(f"# run {run + 1}, {busy} busy, W={world}:\n{table(rows, variants)}", flush=True)
    print(f"# done {time.strftime('%H:%M')}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({str(busy): rows for busy, rows in found.items()}, out)
    for busy in conditions:
        what = f"beside {busy} busy processes" if busy else "idle"
        print(f"\n{what}, median of {args.runs} run(s):\n{header(variants)}\n{table(found[busy], variants)}")


def run_job(world: int, reps: int, variants: tuple[str, ...], sizes: list[int], busy: int) -> list[dict]:
    """One `phalanx run` job of ``world`` workers (beside ``busy`` busy processes): its rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(world), "--no-prefix", __file__,
                               "--job", "--reps", str(reps), "--variants", *variants,
                               "--sizes", *map(str, sizes)], capture_output=True, text=True, env=env)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


if __name__ == "__main__":
    main()
