"""Wall time of `phalanx tune` running 8 trials of examples/digits.py one or two at a time.

    python benchmarks/bench_tune.py [--reps 3] [--epochs 3]

Each repetition runs the same grid search (examples/batch_size_space.json: 4 batch sizes x 2
learning-rate rules, one worker per trial) with -j 1 and with -j 2, in alternating order, each
into a fresh study directory. Reported: the median wall time of each and the median ratio.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def search(jobs: int, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "phalanx", "tune", "-j", str(jobs), "--space",
                        str(ROOT / "examples" / "batch_size_space.json"), "--sampler", "grid", "--trials", "8",
                        "--metric", "val_accuracy", "--direction", "maximize", "--pruner", "none", "--study-dir",
                        directory, str(ROOT / "examples" / "digits.py"), "--epochs", str(epochs)],
                       check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(args.reps):
        for jobs in ((1, 2) if rep % 2 == 0 else (2, 1)):
            times[jobs].append(search(jobs, args.epochs))
        print(f"repetition {rep + 1}: -j 1 {times[1][-1]:.1f}s, -j 2 {times[2][-1]:.1f}s", flush=True)
    ratios = [one / two for one, two in zip(times[1], times[2])]
    print(f"\n| -j | wall s (median of {args.reps}) |\n|---|---|\n| 1 | {statistics.median(times[1]):.1f} |\n"
          f"| 2 | {statistics.median(times[2]):.1f} |\n\n-j 2 is {statistics.median(ratios):.2f}x faster "
          f"(median of per-repetition ratios {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
