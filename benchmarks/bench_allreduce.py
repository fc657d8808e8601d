"""Allreduce on one host: shared memory against Gloo and phalanx's algorithms over Gloo messages.

    python benchmarks/bench_allreduce.py [--worlds 2 3 4] [--reps 7]
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
ms of the process per allreduce (all threads: spinning shows here), and the ratio Gloo / shm. With --netns the job runs on two
network namespaces joined by a 1 Gbit/s veth (bench_ddp.py's), two workers in each: "shm" is then
the hierarchical allreduce (shared memory within a namespace, Gloo's ring between), "gloo" the
flat ring, "ring"/"tree"/"halving_doubling" the hierarchical allreduce with that algorithm
between namespaces, and "auto" the hierarchical one with the cost model's choice per slice.
"""

from __future__ import annotations

import argparse
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


def job(reps: int, variants: tuple[str, ...]) -> None:
    import phalanx as px

    torch.set_num_threads(1)
    px.init()
    assert px.comm.runtime.shm_executor() is not None, "shared memory is not in use"
    rows = []
    for size in SIZES:
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
            cells = " | ".join(f"{1e3 * found[v][0]:.2f} ({1e3 * found[v][1]:.2f})" for v in variants)
            print(f"| {px.size()} | {_human(size)} | {cells} | {found['gloo'][0] / found['shm'][0]:.1f}x |", flush=True)


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
        print("| W | size | " + " | ".join(f"{v} ms (CPU ms)" for v in ACROSS) + " | flat / hierarchical |")
        print("|---" * (len(ACROSS) + 3) + "|")
        print(outputs[0][0], end="")
    finally:
        netns_down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--netns", action="store_true", help="two namespaces of two workers, 1 Gbit/s (root)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--across", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.reps, ACROSS if args.across else VARIANTS)
        return
    if args.netns:
        netns_job(args.reps)
        return
    print("| W | size | " + " | ".join(f"{v} ms (CPU ms)" for v in VARIANTS) + " | Gloo / shm |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    for world in args.worlds:
        done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(world), "--no-prefix", __file__,
                               "--job", "--reps", str(args.reps)], capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(done.stdout, end="", flush=True)


if __name__ == "__main__":
    main()
