"""Parameter servers and central storage against px.DataParallel, alternating, on this host.

    python benchmarks/bench_strategies.py [--reps 3] [--parts step,memory,async,netns]

Every measurement is one ``phalanx run`` job of this same file; variants take turns within each
repetition and the medians over repetitions are printed, with ratios to the data-parallel run
of the same repetition.

  step    an MLP (784-1024-1024-10, 1.9 M parameters) with Adam, global batch 128: median step
          time on rank 0 over 30 steps after 5, for DataParallel and sync parameter servers at
          (W, S) = (2, 1), (2, 2), (3, 1), (3, 2), and central storage at W = 2, 3
  memory  a 20 M-parameter MLP at W = 2: resident memory (VmRSS after training) and proportional
          memory (Pss: shared pages counted once over the processes that map them) of rank 0 and
          rank 1, and the optimizer state each holds: DataParallel, central storage with a copy
          of the parameters per worker (cs-copy), and with the parameters once in shared memory (cs)
  async   digits (examples/digits.py's data, an MLP, Adam 1e-3) for 8 epochs with 3 workers and one server,
          one worker sleeping 50 ms per step: samples per second of the job, and validation accuracy
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench_ddp import NETNS, NETNS_ADDR, netns_down, netns_up

EPOCHS = 8
STEP_VARIANTS = [("dp", 2, 0), ("sync", 2, 1), ("sync", 2, 2), ("cs", 2, 0),
                 ("dp", 3, 0), ("sync", 3, 1), ("sync", 3, 2), ("cs", 3, 0)]


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def strategy_for(mode: str):
    import phalanx as px
    return {"dp": None, "sync": px.ParameterServer("sync"), "async": px.ParameterServer("async"),
            "cs": px.CentralStorage(), "cs-copy": px.CentralStorage(shared_memory=False)}[mode]


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


def proportional_mb() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        return int(re.search(r"Pss:\s+(\d+)", rollup.read()).group(1)) / 1024


def job_step(mode: str, width: str) -> None:
    """One timing job (runs inside phalanx run)."""
    import phalanx as px
    px.init()
    model, strategy = mlp(int(width)), strategy_for(mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if px.role() == "server":
        strategy.serve(model, optimizer)
        return
    model, optimizer = (px.DataParallel(model), optimizer) if strategy is None else strategy.setup(model, optimizer)
    generator = torch.Generator().manual_seed(px.rank())
    x, y = torch.randn(128 // px.size(), 784, generator=generator), torch.randint(0, 10, (128 // px.size(),))
    times = []
    for step in range(35):
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    state_mb = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t)) / 2**20
    print(f"RESULT rank={px.rank()} step_ms={1000 * statistics.median(times[5:]):.2f} "
          f"rss_mb={resident_mb():.1f} pss_mb={proportional_mb():.1f} state_mb={state_mb:.1f}", flush=True)
    if strategy is not None:
        strategy.finish()


def job_async(mode: str, slow: str) -> None:
    """Digits with one slow worker (runs inside phalanx run)."""
    import phalanx as px
    from sklearn.datasets import load_digits
    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    images = (torch.tensor(digits.data, dtype=torch.float32) / 16.0)[order]
    labels = torch.tensor(digits.target)[order]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    class SlowWorker(px.callbacks.Callback):
        """Rank 1 sleeps 50 ms, or twice its own step time (three times slower), after each step."""

        def on_step_begin(self, step, state):
            self.began = time.perf_counter()

        def on_step_end(self, step, logs, state):
            if px.rank() == 1:
                time.sleep(0.05 if slow == "50ms" else 2 * (time.perf_counter() - self.began))

    started = time.perf_counter()
    history = px.fit(model, optimizer, F.cross_entropy, (images[:1437], labels[:1437]),
                     val_data=(images[1437:], labels[1437:]), epochs=EPOCHS, global_batch_size=48,
                     metrics=["accuracy"], strategy=strategy_for(mode), callbacks=[SlowWorker()], verbose=0)
    wall = time.perf_counter() - started
    if px.rank() == 0:
        print(f"RESULT rank=0 samples_per_s={EPOCHS * 1437 / wall:.1f} wall_s={wall:.2f} "
              f"val_accuracy={history['val_accuracy'][-1]:.4f}", flush=True)


def launch(part: str, mode: str, workers: int, servers: int, extra: str) -> dict[int, dict[str, float]]:
    """Run one job; ``part`` netns runs one launcher per namespace (W and S over both hosts)."""
    job = [__file__, "--job", "step" if part == "netns" else part, mode, extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    if part != "netns":
        command = [sys.executable, "-m", "phalanx", "run", "-n", str(workers), "--servers", str(servers),
                   "--timeout", "120", *job]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        return parse(done.stdout)
    port = str(29000 + random.Random().randrange(1000))
    launchers = [subprocess.Popen(
        ["ip", "netns", "exec", NETNS[node], sys.executable, "-m", "phalanx", "run", "-n", str(workers // 2),
         "--servers", str(servers // 2), "--nnodes", "2", "--node-rank", str(node), "--master-addr", NETNS_ADDR[0],
         "--master-port", port, "--timeout", "120", *job],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    outputs = [launcher.communicate(timeout=600) for launcher in launchers]
    if any(launcher.returncode for launcher in launchers):
        raise SystemExit(f"netns job {mode} failed:\n" + "\n".join(err[-2000:] for _, err in outputs))
    return parse(outputs[0][0] + outputs[1][0])


def parse(stdout: str) -> dict[int, dict[str, float]]:
    results = {}
    for rank, fields in re.findall(r"RESULT rank=(\d+) (.*)", stdout):
        results[int(rank)] = {key: float(value) for key, value in re.findall(r"(\w+)=([\d.]+)", fields)}
    return results


def drive(parts: list[str], reps: int) -> None:
    variants = [("step", *v, "1024") for v in STEP_VARIANTS] if "step" in parts else []
    variants += [("step", mode, 2, 0, "4096") for mode in ("dp", "cs-copy", "cs")] if "memory" in parts else []
    variants += [("async", mode, 3, 1, slow) for slow in ("3x", "50ms") for mode in ("sync", "async")] \
        if "async" in parts else []
    variants += [("netns", mode, w, s, "1024") for w in (2, 4) for mode, s in (("dp", 0), ("sync", 2))] \
        if "netns" in parts else []
    if "netns" in parts:
        netns_up("1gbit")
    try:
        measure(variants, reps, parts)
    finally:
        if "netns" in parts:
            netns_down()


def measure(variants: list[tuple], reps: int, parts: list[str]) -> None:
    measured: dict[tuple, list[dict[int, dict[str, float]]]] = {v: [] for v in variants}
    for rep in range(reps):
        order = variants[:]
        random.Random(rep).shuffle(order)
        for variant in order:
            measured[variant].append(launch(*variant))
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    report(measured, parts)


def median_of(runs: list[dict[int, dict[str, float]]], rank: int, key: str) -> float:
    return statistics.median(run[rank][key] for run in runs)


def report(measured: dict, parts: list[str]) -> None:
    for part, width in (("step", "1024"), ("netns", "1024")):
        if part in parts:
            print(f"\n{part}: | W | variant | S | step ms (median) | / DataParallel (median of per-rep ratios) |"
                  "\n|---|---|---|---|---|")
            for (kind, mode, workers, servers, extra), runs in measured.items():
                if kind == part and extra == width:
                    base = measured[(part, "dp", workers, 0, width)]
                    ratios = [run[0]["step_ms"] / ref[0]["step_ms"] for run, ref in zip(runs, base)]
                    print(f"| {workers} | {mode} | {servers} | {median_of(runs, 0, 'step_ms'):.1f} | "
                          f"{statistics.median(ratios):.2f}x |")
    if "memory" in parts:
        print("\n| W=2, 20 M parameters, Adam | step ms | RSS MB rank 0 / 1 | Pss MB rank 0 / 1 | Pss MB of the job "
              "| optimizer state MB rank 0 / 1 |\n|---|---|---|---|---|---|")
        for mode in ("dp", "cs-copy", "cs"):
            runs = measured[("step", mode, 2, 0, "4096")]
            job_pss = statistics.median(run[0]["pss_mb"] + run[1]["pss_mb"] for run in runs)
            print(f"| {mode} | {median_of(runs, 0, 'step_ms'):.0f} | {median_of(runs, 0, 'rss_mb'):.0f} / "
                  f"{median_of(runs, 1, 'rss_mb'):.0f} | {median_of(runs, 0, 'pss_mb'):.0f} / "
                  f"{median_of(runs, 1, 'pss_mb'):.0f} | {job_pss:.0f} | {median_of(runs, 0, 'state_mb'):.1f} / "
                  f"{median_of(runs, 1, 'state_mb'):.1f} |")
    if "async" in parts:
        print("\n| digits, W=3, S=1, slow worker 1 | mode | samples/s | wall s | val accuracy |\n|---|---|---|---|---|")
        for slow in ("3x", "50ms"):
            for mode in ("sync", "async"):
                runs = measured[("async", mode, 3, 1, slow)]
                print(f"| {slow} | {mode} | {median_of(runs, 0, 'samples_per_s'):.0f} | "
                      f"{median_of(runs, 0, 'wall_s'):.1f} | {median_of(runs, 0, 'val_accuracy'):.2%} |")
            ratios = [a[0]["samples_per_s"] / s[0]["samples_per_s"] for a, s in
                      zip(measured[("async", "async", 3, 1, slow)], measured[("async", "sync", 3, 1, slow)])]
            print(f"\n{slow}: async / sync samples per second, median {statistics.median(ratios):.2f}x "
                  f"over {len(ratios)} reps\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default="step,memory,async")
    parser.add_argument("--job", nargs=3, metavar=("PART", "MODE", "EXTRA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.job:
        (job_step if args.job[0] == "step" else job_async)(args.job[1], args.job[2])
    else:
        drive(args.parts.split(","), args.reps)


if __name__ == "__main__":
    main()
