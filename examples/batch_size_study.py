"""Does the batch size change accuracy and runtime, and does scaling the learning rate fix it?

    python examples/batch_size_study.py               # about 3 minutes on 2 cores
    python examples/batch_size_study.py --epochs 10 --out study

Two grid searches with `phalanx tune` over examples/digits.py: global batch sizes 8, 32, 128 and
512, each with the learning rate of a batch of 64 kept constant and scaled linearly with the
batch; first on one worker per trial (two trials at a time), then on two data-parallel workers
per trial. Prints one table (validation accuracy and seconds per configuration) and draws
OUT/batch_size_study.png.
"""

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCH_SIZES = (8, 32, 128, 512)
RULES = ("constant", "linear")


def search(workers: int, jobs: int, epochs: int, out: Path) -> dict[tuple[int, str], dict[str, float]]:
    """One grid search of the 8 configurations; ``(batch, rule) -> {"accuracy", "seconds"}``."""
    directory = out / f"workers-{workers}"
    subprocess.run([sys.executable, "-m", "phalanx", "tune", "-j", str(jobs), "-n", str(workers),
                    "--space", str(HERE / "batch_size_space.json"), "--sampler", "grid", "--trials", "8",
                    "--metric", "val_accuracy", "--direction", "maximize", "--pruner", "none",
                    "--study-dir", str(directory), str(HERE / "digits.py"), "--epochs", str(epochs)], check=True)
    with open(directory / "trials.csv") as table:
        return {(int(row["global_batch_size"]), row["lr_rule"]): {"accuracy": float(row["value"]),
                                                                  "seconds": float(row["duration_s"])}
                for row in csv.DictReader(table) if row["state"] == "COMPLETE"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="batch_size_study")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    results = {1: search(1, 2, args.epochs, out), 2: search(2, 1, args.epochs, out)}
    print(f"\n| workers | global batch | learning rate | val accuracy | seconds |\n|---|---|---|---|---|")
    for workers, found in results.items():
        for batch in BATCH_SIZES:
            for rule in RULES:
                if (batch, rule) in found:
                    result = found[(batch, rule)]
                    print(f"| {workers} | {batch} | {rule} | {result['accuracy']:.2%} | {result['seconds']:.1f} |")
    draw(results, out / "batch_size_study.png")
    print(f"\nplot: {out / 'batch_size_study.png'}")


def draw(results: dict[int, dict[tuple[int, str], dict[str, float]]], path: Path) -> None:
    figure, (accuracy, runtime) = plt.subplots(1, 2, figsize=(10, 4))
    for workers, found in results.items():
        for rule, style in zip(RULES, ("--", "-")):
            points = [(batch, found[(batch, rule)]) for batch in BATCH_SIZES if (batch, rule) in found]
            label = f"{rule} lr, {workers} worker{'s' if workers > 1 else ''}"
            accuracy.plot([b for b, _ in points], [r["accuracy"] for _, r in points], style, marker="o", label=label)
            runtime.plot([b for b, _ in points], [r["seconds"] for _, r in points], style, marker="o", label=label)
    for axes, title in ((accuracy, "validation accuracy"), (runtime, "seconds per trial")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("global batch size")
        axes.set_title(title)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
