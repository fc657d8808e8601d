"""``phalanx bench comm``: the measured link, and every allreduce algorithm's time against its prediction.

Run by ``phalanx bench comm -n N`` in each of N workers (``phalanx run -n N -m phalanx.cli.bench_comm``).
Rank 0 prints alpha and beta (ping-pong between ranks 0 and 1), then for each size the median
time of Gloo's own allreduce, of phalanx's ring, tree and halving-doubling with the cost model's
prediction beside each, of shared memory where the transport uses it, and what ``"auto"`` picks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px
from phalanx.comm import collectives, cost, runtime

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(prog="phalanx bench comm")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--transport", default="auto", choices=("auto", "shm", "gloo"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    px.init(transport=args.transport)
    link = collectives.measure_link()
    world, uses_shm = px.size(), runtime.shm_executor() is not None
    backend = link.backend or link
    _say(f"{world} workers; alpha {link.alpha_s * 1e6:.1f} us, beta {link.beta_s_per_byte * 1e9:.3f} ns/B "
         f"({link.bandwidth_gbit:.1f} Gbit/s) between ranks 0 and 1 over Gloo messages; Gloo's own ring fits "
         f"alpha {backend.alpha_s * 1e6:.1f} us, beta {backend.beta_s_per_byte * 1e9:.3f} ns/B; shared memory: "
         f"{'in use' if uses_shm else 'not in use'}")
    names = ("ring", "tree", "halving_doubling")
    _say("| size | gloo ms (predicted) | " + " | ".join(f"{n} ms (predicted)" for n in names)
         + (" | shm ms" if uses_shm else "") + " | auto picks |")
    _say("|---" * (len(names) + 3 + uses_shm) + "|")
    for size in SIZES:
        tensor = torch.ones(size // 4)
        gloo = _time(lambda: torch.distributed.all_reduce(tensor, group=runtime.group_for(tensor)), args.reps)
        cells = [f"{_time(lambda n=name: px.allreduce_(tensor, check=False, algorithm=n), args.reps):.2f} "
                 f"({cost.predict(name, size, world, link) * 1e3:.2f})" for name in names]
        shm_cell = [f"{_time(lambda: px.allreduce_(tensor, check=False), args.reps):.2f}"] if uses_shm else []
        picked = "shared memory" if uses_shm else cost.choose_with_backend(size, world, link)
        _say(f"| {_human(size)} | {gloo:.2f} ({cost.predict('ring', size, world, backend) * 1e3:.2f}) | "
             + " | ".join(cells + shm_cell) + f" | {picked} |")


def _time(run: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        px.barrier()
        started = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _human(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def _say(line: str) -> None:
    if px.rank() == 0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
