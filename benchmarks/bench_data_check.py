"""Cost of the same-data check of DistributedLoader: first batch with and without it, alternating.

    phalanx run -n 2 benchmarks/bench_data_check.py [--reps 15]

Three datasets, all identical on every rank: the digits-sized tensors of examples/digits.py
(1797 x 64), a large tensor dataset (100,000 x 3 x 32 x 32 floats, 1.2 GB, of which the check
reads 8 samples), and a map-style dataset of 50,000 Python-side samples. Each
repetition builds a fresh loader twice, with check_same_data=True and False (order alternating),
and times the first ``next()``: the check's collective runs there. Reported are the medians and
their difference, on rank 0.
"""

import argparse
import statistics
import time

import torch

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("--reps", type=int, default=15)
args = parser.parse_args()

torch.set_num_threads(1)
px.init()
generator = torch.Generator().manual_seed(0)
datasets = {
    "digits tensors (1797 x 64)": (torch.randn(1797, 64, generator=generator), torch.randint(0, 10, (1797,), generator=generator)),
    "large tensors (100k x 3x32x32)": torch.randn(100_000, 3, 32, 32, generator=generator),
    "map-style list (50k samples)": [torch.randn(16, generator=generator) for _ in range(50_000)],
}


def first_batch_seconds(dataset: object, check: bool) -> float:
    loader = px.data.DistributedLoader(dataset, global_batch_size=256, prefetch=0, check_same_data=check)
    px.barrier()
    started = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - started


for name, dataset in datasets.items():
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for check in ((True, False) if rep % 2 == 0 else (False, True)):
            times[check].append(first_batch_seconds(dataset, check))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    if px.rank() == 0:
        print(f"{name:32s} first batch: checked {on * 1e3:6.2f} ms, unchecked {off * 1e3:6.2f} ms, "
              f"check costs {(on - off) * 1e3:5.2f} ms once per loader")
