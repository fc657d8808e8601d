"""How well ``phalanx doctor`` predicts: its predictions against the step times of the configurations.

For each of bench_ddp.py's models (MLP, CNN, small transformer) trained by px.fit at a fixed
global batch (benchmarks/doctor_train.py): the doctor runs it on 2 workers over loopback (and its
1-worker reference) and predicts the step at 1, 2 and 3 workers on this host (3 on 2 cores: the
doctor says it cannot) and at 2 workers, one per host, over a 1 Gbit/s link. Each configuration is then run without instrumentation,
``--reps`` times, alternating with the others; the table gives the median step time and the
prediction's error. The overhead of instrumentation is the script's own step time with the
doctor's recorder on (never stopping) against without, in alternating order, median of the ratios.

Accumulation: each model at twice its global batch with px.fit(accumulate_steps=2) on 2 workers,
against the doctor's accumulation advice (time per measured global batch).

The seed's situation: the CNN at a global batch of 8 on 4 workers (2 samples each, 2 cores),
diagnosed by the doctor; 1 and 4 workers and the configuration of its first recommendation (when
that is a number of workers) are then run and its predicted gain compared with the measured one.

    python benchmarks/bench_doctor.py [--models mlp cnn transformer] [--reps 3] [--cases ...]   # root: netns rows
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import NETNS, NETNS_ADDR, netns_down, netns_up  # noqa: E402

from phalanx.cli.doctor import diagnose  # noqa: E402
from phalanx.doctor.advice import accumulated_step  # noqa: E402
from phalanx.doctor.diagnosis import Diagnosis  # noqa: E402
from phalanx.doctor.predict import Layout, predict, unpredictable  # noqa: E402

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doctor_train.py")
STEPS = "45"
SEED_BATCH = 8
CASES = ("configurations", "accumulation", "seed")
CONFIGS = {"1 worker": Layout(1, 1), "2 loopback": Layout(2, 2), "3 loopback": Layout(3, 3),
           "2 netns 1 Gbit/s": Layout(2, 1, 1.0)}


def _step_s(output: str) -> float:
    found = re.search(r"STEP_S ([0-9.]+)", output)
    if found is None:
        raise SystemExit(f"no step time in the run's output:\n{output[-3000:]}")
    return float(found.group(1))


def _run(command: Sequence[str], timeout: float = 600) -> str:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def loopback(model: str, workers: int, session: bool = False, extra: Sequence[str] = ()) -> float:
    """The mean step time of ``workers`` local workers (under a never-stopping doctor session if asked)."""
    with tempfile.TemporaryDirectory() as folder:
        wrap = ["-m", "phalanx.doctor.session", "--out", folder, "--steps", "1000", "--warmup", "1000",
                "--deadline", "600"] if session else []
        return _step_s(_run([sys.executable, "-m", "phalanx", "run", "-n", str(workers), *wrap, TRAIN,
                             "--model", model, "--steps", STEPS, "--time", *extra]))


def over_netns(model: str) -> float:
    """The mean step time of 2 workers in two network namespaces joined by a 1 Gbit/s veth."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    launchers = [subprocess.Popen(
        ["ip", "netns", "exec", NETNS[node], sys.executable, "-m", "phalanx", "run", "-n", "1", "--nnodes", "2",
         "--node-rank", str(node), "--master-addr", NETNS_ADDR[0], "--master-port", "29571", TRAIN,
         "--model", model, "--steps", STEPS, "--time"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env) for node in (0, 1)]
    outputs = [launcher.communicate(timeout=600) for launcher in launchers]
    if any(launcher.returncode for launcher in launchers):
        raise SystemExit("\n".join(err[-2000:] for _, err in outputs))
    return _step_s(outputs[0][0])


def measure(model: str, reps: int) -> tuple[dict[str, float], float]:
    """Median step time of each configuration, and the median overhead ratio of the recorder."""
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    overhead = []
    for rep in range(reps):
        first = rep % 2 == 1  # the recorder's run first every other time: drifts hit both alike
        on = loopback(model, 2, session=True) if first else None
        times["2 loopback"].append(loopback(model, 2))
        on = on if first else loopback(model, 2, session=True)
        overhead.append(on / times["2 loopback"][-1])
        times["1 worker"].append(loopback(model, 1))
        times["3 loopback"].append(loopback(model, 3))
        times["2 netns 1 Gbit/s"].append(over_netns(model))
    return {name: statistics.median(values) for name, values in times.items()}, statistics.median(overhead)


def seed_case(reps: int) -> None:
    """The CNN at 2 samples per worker on 4 workers: the doctor's causes, its first advice, checked."""
    extra = ["--global-batch", str(SEED_BATCH), "--steps", "60"]
    diagnosis = diagnose(TRAIN, ["--model", "cnn", *extra], workers=4, steps=20, warmup=5)
    first = diagnosis.recommendations[0]
    print("\nseed case causes:\n  " + "\n  ".join(diagnosis.causes), flush=True)
    print(f"first recommendation: {first.action}: predicted {first.step_s * 1e3:.1f} ms, gain {first.gain:.2f}x")
    if first.kind != "workers":
        print("(not a number of workers: check it by hand)")
        return
    workers = int(first.action.split()[1])
    runs: dict[int, list[float]] = {1: [], 4: [], workers: []}
    for _ in range(reps):
        for count in runs:
            runs[count].append(loopback("cnn", count, extra=extra))
    step = {count: statistics.median(values) for count, values in runs.items()}
    measured_gain = step[4] / step[workers]
    print(f"| seed: CNN, global batch {SEED_BATCH} | 1 worker {step[1] * 1e3:.1f} ms | 4 workers {step[4] * 1e3:.1f} ms | "
          f"{workers} workers: predicted {first.step_s * 1e3:.1f} ms, measured {step[workers] * 1e3:.1f} ms | "
          f"gain predicted {first.gain:.2f}x, measured {measured_gain:.2f}x ({100 * (first.gain / measured_gain - 1):+.0f}%) |")


def accumulation_case(model: str, diagnosis: Diagnosis, reps: int) -> None:
    """px.fit(accumulate_steps=2) at twice the global batch on 2 workers: the time per measured batch
    predicted by the doctor's accumulation advice against the run (alternating with no accumulation)."""
    batch = int(diagnosis.measured.global_batch)
    predicted = accumulated_step(diagnosis.model, Layout(2, 2), 2)
    plain, accumulated = [], []
    for _ in range(reps):
        plain.append(loopback(model, 2, extra=["--global-batch", str(batch)]))
        accumulated.append(loopback(model, 2, extra=["--global-batch", str(2 * batch), "--accumulate-steps", "2"]) / 2)
    now, then = statistics.median(plain), statistics.median(accumulated)
    print(f"| {model}: accumulate_steps=2, global batch {2 * batch} | per {batch} samples: predicted "
          f"{predicted * 1e3:.1f} ms, measured {then * 1e3:.1f} ms ({100 * (predicted / then - 1):+.1f}%) | without: "
          f"{now * 1e3:.1f} ms | speed-up predicted {predict(diagnosis.model, Layout(2, 2)).step_s / predicted:.3f}x, "
          f"measured {now / then:.3f}x |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        help="configurations: the 9-cell table; accumulation; seed: the seed's situation")
    args = parser.parse_args(argv)
    diagnoses = {model: diagnose(TRAIN, ["--model", model, "--steps", STEPS], workers=2, steps=20, warmup=5)
                 for model in args.models if {"configurations", "accumulation"} & set(args.cases)}
    if "configurations" in args.cases:
        configurations(diagnoses, args.reps)
    if "accumulation" in args.cases:
        for model, diagnosis in diagnoses.items():
            accumulation_case(model, diagnosis, args.reps)
    if "seed" in args.cases:
        seed_case(args.reps)
    return 0


def configurations(diagnoses: dict[str, Diagnosis], reps: int) -> None:
    """The table: each model's predictions from its diagnosis against the configurations run."""
    rows = []
    netns_up("1gbit")
    try:
        for model, diagnosis in diagnoses.items():
            measured, overhead = measure(model, reps)
            for name, layout in CONFIGS.items():
                reason = unpredictable(diagnosis.model, layout)
                predicted = None if reason else predict(diagnosis.model, layout).step_s
                rows.append((model, name, predicted, measured[name], overhead))
                print(f"{model} {name}: predicted {reason or f'{predicted * 1e3:.1f} ms'}, measured "
                      f"{measured[name] * 1e3:.1f} ms", flush=True)
    finally:
        netns_down()
    print("\n| model | configuration | predicted ms | measured ms | error | recorder on / off (2 loopback) |")
    print("|---|---|---|---|---|---|")
    for model, name, predicted, measured_s, overhead in rows:
        shown = ("not predicted", "-") if predicted is None else (f"{predicted * 1e3:.1f}",
                                                                  f"{100 * (predicted / measured_s - 1):+.1f}%")
        print(f"| {model} | {name} | {shown[0]} | {measured_s * 1e3:.1f} | {shown[1]} | {overhead:.3f} |")
    print()


if __name__ == "__main__":
    raise SystemExit(main())
