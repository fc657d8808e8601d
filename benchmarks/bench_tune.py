"""Wall time of `phalanx tune` on examples/digits.py: one or two trials at a time, or locally against Ray.

    python benchmarks/bench_tune.py [--reps 3] [--epochs 3]            # -j 1 against -j 2, 8 trials
    python benchmarks/bench_tune.py --ray [--reps 3] [--trials 4]      # local -j 2 against --on ray -j 2

Each repetition runs the same grid search (examples/batch_size_space.json: 4 batch sizes x 2
learning-rate rules, grid sampler with a fixed seed, so every variant runs the same trials, one
worker each) in every variant, in alternating order, each into a fresh study directory. With
``--ray`` a local Ray cluster with as many CPUs as this machine is started once (``ray start``),
outside the timings, and the Ray searches connect to it. Reported: the median wall time of each
variant and the median of the per-repetition ratios.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def search(options: list[str], trials: int, epochs: int, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "phalanx", "tune", *options, "--space",
                        str(ROOT / "examples" / "batch_size_space.json"), "--sampler", "grid", "--seed", "0",
                        "--trials", str(trials), "--metric", "val_accuracy", "--direction", "maximize", "--pruner",
                        "none", "--study-dir", directory, str(ROOT / "examples" / "digits.py"), "--epochs", str(epochs)],
                       check=True, capture_output=True, env=env)
        return time.perf_counter() - started


def ray_cluster(folder: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """A local Ray cluster (its head process) and the environment that connects to it."""
    token = Path(folder) / "token"
    token.write_text(os.urandom(32).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_ADDRESS": "127.0.0.1:6390"}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port=6390",
                             f"--num-cpus={os.cpu_count()}", "--include-dashboard=false", f"--temp-dir={folder}/r"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    subprocess.run([sys.executable, "-c", "import ray; ray.init()"], env=env, check=True, capture_output=True)
    return head, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=None, help="default 8, with --ray 4")
    parser.add_argument("--ray", action="store_true", help="compare a local search with the same one on Ray")
    args = parser.parse_args()
    trials = args.trials or (4 if args.ray else 8)
    with tempfile.TemporaryDirectory(prefix="bt-", dir="/tmp") as folder:
        head, env = ray_cluster(folder) if args.ray else (None, dict(os.environ))
        variants = ({"local -j 2": ["-j", "2"], "ray -j 2": ["--on", "ray", "-j", "2"]} if args.ray
                    else {"-j 1": ["-j", "1"], "-j 2": ["-j", "2"]})
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        try:
            for rep in range(args.reps):
                for name in names[rep % 2:] + names[:rep % 2]:
                    times[name].append(search(variants[name], trials, args.epochs, env))
                print(f"repetition {rep + 1}: " + ", ".join(f"{name} {times[name][-1]:.1f}s" for name in names),
                      flush=True)
        finally:
            if head is not None:
                os.killpg(head.pid, 2)  # SIGINT: `ray start --block` stops its cluster
                head.wait()
    first, second = names
    ratios = [a / b for a, b in zip(times[first], times[second])]
    print(f"\n{trials} trials, {args.epochs} epochs each\n\n| variant | wall s (median of {args.reps}) |\n|---|---|")
    for name in names:
        print(f"| {name} | {statistics.median(times[name]):.1f} |")
    print(f"\n{first} / {second}: {statistics.median(ratios):.2f}x (per repetition: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
