"""Step time of px.DataParallel against torch DistributedDataParallel and plain PyTorch, on Gloo/CPU.

Every variant of a model lives in the same worker processes and the variants take turns: each
repetition measures every variant once, in a shuffled order (the same on every rank), so slow
drifts of the machine (other jobs, thermal state) hit all variants alike. One measurement is the
median time of ``--steps`` training steps (zero_grad, forward, cross-entropy, backward, SGD step)
after ``--warmup`` steps; the step time of a world is the slowest rank's median.

Reported per (model, world size, variant): the median over repetitions with its quartiles, the
throughput it gives, and the median [quartiles] of the per-repetition throughput ratios against
DDP and against plain PyTorch (world size 1) or compute-only (larger worlds). During every
measurement rank 0 also records how much CPU time processes *other* than the workers used
(/proc/stat minus the workers' own time); the "quiet" columns repeat the figures over the
repetitions where that stayed below ``--quiet-max`` (10 %), since the machine may be shared. A
second table splits rank 0's steps into forward, backward (which includes waiting for the
reduction) and optimizer, with the process's CPU time per step (all threads): step minus CPU
time is time spent waiting.

Variants:
  plain     the bare model, one process (world size 1 only)
  compute   the bare model in every worker at once, no communication (world size > 1): the floor
  phalanx   px.DataParallel(model) with the library default fusion threshold
  ddp       torch.nn.parallel.DistributedDataParallel(model), default settings
  px@T      px.DataParallel(model, fusion_threshold_mb=T) (--sweep); px@auto reports its choice

Workers are started by this script (one subprocess per rank, rank 0 hosts the rendezvous store)
and join with px.init(); DDP uses the default process group px.init() created (at world size 1
the script creates a one-process Gloo group first, which px.init() adopts). With --netns each of
the two workers runs in its own network namespace, linked by a veth pair shaped with tbf (1
Gbit/s unless --rate says otherwise); with --per-host 2 two workers run in each namespace, so
phalanx's allreduce is hierarchical (shared memory within a namespace, each local rank's slice
between them) while DDP's is Gloo's flat ring over all four. The namespaces are removed afterwards
whatever happens.

    python benchmarks/bench_ddp.py                       # world sizes 1 and 2, both models
    python benchmarks/bench_ddp.py --quick               # fewer steps and repetitions
    python benchmarks/bench_ddp.py --sweep --world-sizes 2
    python benchmarks/bench_ddp.py --netns --models mlp  # needs root
    python benchmarks/bench_ddp.py --netns --per-host 2  # hierarchical against flat, 4 workers
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

SWEEP_THRESHOLDS = ["0", "1", "4", "16", "25", "64", "inf", "auto"]

# name: per-worker batch, input shape, classes. Batches give compute-only steps of tens of ms here.
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "mlp": {"batch": 96, "input": [1024], "classes": 10},
    "cnn": {"batch": 32, "input": [3, 32, 32], "classes": 10},
    "transformer": {"batch": 32, "input": [32, 128], "classes": 10},
}

NETNS = ("pxbench0", "pxbench1")
VETH = ("pxb-veth0", "pxb-veth1")
NETNS_ADDR = ("198.18.0.1", "198.18.0.2")


# ---------------------------------------------------------------------------------------------
# Models (built identically in every worker and for every variant)
# ---------------------------------------------------------------------------------------------


def build_model(name: str) -> Any:
    from torch import nn

    if name == "mlp":  # 5.25 M parameters in 8 tensors
        return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn":  # 0.34 M parameters in 28 tensors, 12 of them BatchNorm (3x32x32 input)
        def block(cin: int, cout: int) -> list:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

        return nn.Sequential(*block(3, 16), *block(16, 16), nn.MaxPool2d(2),
                             *block(16, 32), *block(32, 32), nn.MaxPool2d(2),
                             *block(32, 64), *block(64, 64), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "transformer":  # 0.40 M parameters in 26 tensors: 2 encoder layers over 32 tokens of 128
        class MeanOverTokens(nn.Module):
            def forward(self, x: Any) -> Any:  # (batch, tokens, features) -> (batch, features)
                return x.mean(dim=1)

        return nn.Sequential(
            nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, dropout=0.0,
                                                             batch_first=True), num_layers=2),
            MeanOverTokens(), nn.Linear(128, 10))
    raise ValueError(f"unknown model {name!r}")


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


def timed_step(wrapped: Any, optimizer: Any, x: Any, y: Any, dtype: torch.dtype | None = None) -> tuple[float, float]:
    """One training step (zero_grad, forward, cross-entropy, backward, step), the forward and the loss
    under autocast to ``dtype`` where one is given; when forward and backward ended (perf_counter)."""
    import torch
    import torch.nn.functional as F

    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = F.cross_entropy(wrapped(x), y)
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    return forward_end, backward_end


def _threshold(text: str) -> float | str:
    return "auto" if text == "auto" else float(text)


def worker_main(config_path: str) -> None:
    import torch
    import torch.distributed as dist

    import phalanx as px

    torch.set_num_threads(1)
    with open(config_path) as handle:
        config = json.load(handle)
    world = int(os.environ["PHALANX_WORLD_SIZE"])
    if world == 1 and "ddp" in config["variants"]:
        # DDP needs a process group even for one process; px.init() adopts it (and stays a world of one).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    px.init(backend="gloo")
    rank = px.rank()
    if config.get("first_bucket_mb") is not None:
        from phalanx.parallel import buckets

        buckets.FIRST_BUCKET_MB = config["first_bucket_mb"]
    report: dict[str, Any] = {"world": world, "models": {}}

    def sync() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    probe = ForeignLoad(px.allgather_object(os.getpid()) if world > 1 else [os.getpid()])

    for model_name in config["models"]:
        spec = MODEL_SPECS[model_name]
        generator = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn([spec["batch"], *spec["input"]], generator=generator)
        y = torch.randint(0, spec["classes"], (spec["batch"],), generator=generator)
        variants: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        extra: dict[str, Any] = {}
        for variant in config["variants"]:
            torch.manual_seed(0)
            model = build_model(model_name)
            if variant in ("plain", "compute"):
                wrapped = model
            elif variant == "ddp":
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
            elif variant == "phalanx":
                wrapped = px.DataParallel(model)
            elif variant.startswith("px@"):
                wrapped = px.DataParallel(model, fusion_threshold_mb=_threshold(variant[3:]))
            else:
                raise ValueError(f"unknown variant {variant!r}")
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            variants[variant] = (wrapped, optimizer)

        def step(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
            return timed_step(wrapped, optimizer, x, y)

        # "auto" tunes during its first steps: run them before measuring (same count on every rank).
        for variant, (wrapped, optimizer) in variants.items():
            tuner = getattr(wrapped, "tuner", None)
            if tuner is not None:
                steps = 0
                while tuner.chosen is None and steps < 200:
                    step(wrapped, optimizer)
                    steps += 1
                extra[variant] = {"chosen": tuner.chosen, "tuning_steps": steps,
                                  "candidates": tuner.candidates, "candidate_medians_ms":
                                  [m * 1e3 for m in tuner.medians]}
            if isinstance(wrapped, px.DataParallel) and wrapped.reducer is not None:
                extra.setdefault(variant, {})["buckets"] = [
                    n * wrapped.reducer.params[0].element_size() / 2**20 for n in wrapped.reducer.bucket_sizes]

        names = list(variants)
        times: dict[str, list[float]] = {name: [] for name in names}
        foreign: dict[str, list[float | None]] = {name: [] for name in names}
        # per timed step on this rank: forward, backward (with the wait for communication), optimizer, CPU
        phases: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
        for rep in range(config["reps"]):
            order = list(names)
            random.Random(rep).shuffle(order)  # same order on every rank; no variant always follows another
            for variant in order:
                wrapped, optimizer = variants[variant]
                sync()
                for _ in range(config["warmup"]):
                    step(wrapped, optimizer)
                samples = []
                probe.start()
                for _ in range(config["steps"]):
                    cpu, start = time.process_time(), time.perf_counter()
                    forward_end, backward_end = step(wrapped, optimizer)
                    end = time.perf_counter()
                    samples.append(end - start)
                    phases[variant].append((forward_end - start, backward_end - forward_end, end - backward_end,
                                            time.process_time() - cpu))
                foreign[variant].append(probe.stop())
                times[variant].append(statistics.median(samples))
            if rank == 0:
                print(f"  [{model_name} world {world}] rep {rep + 1}/{config['reps']} done", file=sys.stderr,
                      flush=True)
        everyone = px.allgather_object(times) if world > 1 else [times]
        report["models"][model_name] = {
            "batch": spec["batch"],
            "params": sum(p.numel() for p in build_model(model_name).parameters()),
            # the world is as slow as its slowest rank
            "step_s": {v: [max(r[v][i] for r in everyone) for i in range(config["reps"])] for v in names},
            "per_rank_step_s": {v: [r[v] for r in everyone] for v in names},
            "foreign_cpu": foreign,  # share of the CPUs other processes used during each measurement (rank 0)
            # rank 0's medians over all timed steps: forward, backward, optimizer, CPU time (all threads)
            "phases_s": {v: [statistics.median(column) for column in zip(*phases[v])] for v in names},
            "extra": extra,
        }
        del variants
    if rank == 0:
        with open(config["result_path"], "w") as handle:
            json.dump(report, handle)
    px.shutdown()


class ForeignLoad:
    """The share of the machine's CPU time that processes other than the workers used meanwhile.

    Busy time comes from /proc/stat (user, nice, system, steal; interrupt time is left out since
    the workers' own loopback traffic is processed there), the workers' time from /proc/PID/stat.
    """

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.available = os.path.exists("/proc/stat")
        self._start: tuple[float, float, float] | None = None

    def _sample(self) -> tuple[float, float, float]:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
        busy = fields[0] + fields[1] + fields[2] + fields[7]
        ours = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    values = handle.read().rsplit(")", 1)[1].split()
                ours += int(values[11]) + int(values[12])
            except OSError:
                pass
        return time.monotonic(), float(busy), float(ours)

    def start(self) -> None:
        self._start = self._sample() if self.available else None

    def stop(self) -> float | None:
        if self._start is None:
            return None
        end = self._sample()
        wall = end[0] - self._start[0]
        jiffies = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, jiffies / os.sysconf("SC_CLK_TCK")) / (wall * (os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# Launcher side
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world: int, models: list[str], variants: list[str], args: argparse.Namespace,
              netns: bool = False) -> dict[str, Any]:
    """Start ``world`` workers, wait for them, return rank 0's report."""
    workdir = tempfile.mkdtemp(prefix="px-bench-")
    config = {"models": models, "variants": variants, "reps": args.reps, "steps": args.steps,
              "warmup": args.warmup, "result_path": os.path.join(workdir, "result.json"),
              "first_bucket_mb": args.first_bucket_mb}
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    usage = _CpuUsage()
    start_workers(os.path.abspath(__file__), config_path, world, args.timeout, netns=netns)
    with open(config["result_path"]) as handle:
        report = json.load(handle)
    report["foreign_cpu"] = usage.foreign_share()
    return report


def start_workers(script: str, config_path: str, world: int, timeout: float, netns: bool = False) -> None:
    """Run ``python script --worker config_path`` as ranks 0..world-1 of one job and wait for all of
    them (other benchmarks start their workers with this too).

    Rank 0 hosts the rendezvous store; each worker gets the PHALANX_* variables a launcher would
    set. With ``netns`` half of the workers run in each of the namespaces :func:`netns_up` made,
    each namespace a host of its own; else all run on this host (shared-memory transport). A
    worker that fails or a run longer than ``timeout`` seconds raises; no worker outlives the call.
    """
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            env = {key: value for key, value in os.environ.items()
                   if not key.startswith("PHALANX_") and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            per_host = world // 2 if netns else world
            node, local = divmod(rank, per_host)
            env.update(PHALANX_RANK=str(rank), PHALANX_WORLD_SIZE=str(world), PHALANX_LOCAL_RANK=str(local),
                       PHALANX_LOCAL_WORLD_SIZE=str(per_host), PHALANX_NODE_RANK=str(node), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PHALANX_TIMEOUT="600")
            command = [sys.executable, script, "--worker", config_path]
            if netns:  # a job id per namespace: phalanx counts each as a host of its own (as its launcher would)
                env.update(MASTER_ADDR=NETNS_ADDR[0], GLOO_SOCKET_IFNAME=VETH[node], PHALANX_JOB_ID=f"bench{node}")
                command = ["ip", "netns", "exec", NETNS[node], *command]
            procs.append(subprocess.Popen(command, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"world {world}: a worker failed (exit {failed[0].returncode})" if failed
                                   else f"world {world}: timed out after {timeout:.0f}s")
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"world {world}: worker exit codes {[p.returncode for p in procs]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _CpuUsage:
    """How much of the machine's CPU time processes other than this benchmark used meanwhile."""

    def __init__(self) -> None:
        self.start = (time.monotonic(), self._busy(), self._ours())

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        import resource

        children, own = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return children.ru_utime + children.ru_stime + own.ru_utime + own.ru_stime

    def foreign_share(self) -> float | None:
        """Fraction of all CPUs' time used by others (call after the workers were waited for)."""
        if not os.path.exists("/proc/stat"):
            return None
        wall, busy, ours = time.monotonic() - self.start[0], self._busy() - self.start[1], self._ours() - self.start[2]
        return max(0.0, busy - ours) / (wall * (os.cpu_count() or 1))


# --- network namespaces ----------------------------------------------------------------------


def _ip(*command: str, check: bool = True) -> None:
    subprocess.run(command, check=check, stdout=subprocess.DEVNULL,
                   stderr=None if check else subprocess.DEVNULL)


def netns_up(rate: str) -> None:
    netns_down()
    for ns in NETNS:
        _ip("ip", "netns", "add", ns)
    _ip("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NETNS, VETH, NETNS_ADDR):
        _ip("ip", "link", "set", veth, "netns", ns)
        _ip("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
        _ip("ip", "-n", ns, "link", "set", veth, "up")
        _ip("tc", "-n", ns, "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate, "burst", "256kb",
            "latency", "20ms")


def netns_down() -> None:
    for ns in NETNS:  # deleting a namespace destroys the veth end inside it, and with it the pair
        _ip("ip", "netns", "del", ns, check=False)


# --- report ----------------------------------------------------------------------------------


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, lower and upper quartile (by linear interpolation)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3


def _ratios(reference: list[float], values: list[float], keep: list[bool]) -> list[float]:
    """Per-repetition throughput ratio (reference step / this step) over the repetitions kept."""
    return [r / v for r, v, k in zip(reference, values, keep) if k]


def _fmt_ratio(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    median, low, high = _quartiles(ratios)
    return f"{median:.3f} [{low:.3f}..{high:.3f}]"


def alternating(reps: int, ways: list[str], measure: Callable[[str], float]) -> dict[str, list[float]]:
    """``measure(way)`` of every way in each repetition, in the opposite order every other one: a paired
    comparison inside one job, for a benchmark that switches something within the same processes."""
    measured: dict[str, list[float]] = {way: [] for way in ways}
    for rep in range(reps):
        for way in (ways if rep % 2 == 0 else ways[::-1]):
            measured[way].append(measure(way))
    return measured


def paired_table(caption: str, reference: str, other: str, rows: list[tuple[str, dict[str, list[float]]]]) -> str:
    """The markdown table of paired comparisons (``rows``: a name and what :func:`alternating` measured):
    per row both medians in ms, then ``other / reference`` per repetition as its median [min..max]."""
    lines = [f"| {caption} | {reference} (ms) | {other} (ms) | ratio |", "|---|---|---|---|"]
    for name, measured in rows:
        ratios = [o / r for r, o in zip(measured[reference], measured[other])]
        lines.append(f"| {name} | {statistics.median(measured[reference]):.3f} | "
                     f"{statistics.median(measured[other]):.3f} | {statistics.median(ratios):.3f} "
                     f"[{min(ratios):.3f}..{max(ratios):.3f}] |")
    return "\n".join(lines)


def run_as_job(script: str, workers: int, arguments: list[str], elastic: bool = False) -> int:
    """Run ``script --worker ARGUMENTS`` as one ``phalanx run`` job of ``workers`` (elastic: with
    ``--min-workers 1``), this checkout's phalanx first on the path; the job's exit code."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH", "")]))}
    command = [sys.executable, "-m", "phalanx", "run", "-n", str(workers), *(["--min-workers", "1"] if elastic else []),
               script, "--worker", *arguments]
    return subprocess.call(command, env=env)


def print_table(title: str, report: dict[str, Any], quiet_max: float) -> None:
    """One markdown table per model; see the module docstring for what the columns mean."""
    world = report["world"]
    if report.get("foreign_cpu") is not None:
        print(f"\n(other processes used {report['foreign_cpu']:.0%} of the machine's CPU time during this run)")
    for model, data in report["models"].items():
        steps, batch = data["step_s"], data["batch"]
        foreign = data.get("foreign_cpu", {})
        reps = len(next(iter(steps.values())))
        quiet = {v: [f is not None and f <= quiet_max for f in foreign.get(v, [None] * reps)] for v in steps}
        everything = [True] * reps
        base = "plain" if "plain" in steps else "compute" if "compute" in steps else None
        print(f"\n### {title}: {model} ({data['params'] / 1e6:.2f} M params, batch {batch}/worker, world {world}, "
              f"{reps} reps)\n")
        print(f"| variant | step ms, median [quartiles] | samples/s | throughput vs DDP | vs {base or '-'} | "
              f"quiet reps (others < {quiet_max:.0%} CPU) | quiet step ms | quiet vs DDP |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for variant, values in steps.items():
            median, low, high = _quartiles(values)
            quiet_values = [v for v, q in zip(values, quiet[variant]) if q]
            cells = [variant, f"{median * 1e3:.1f} [{low * 1e3:.1f}..{high * 1e3:.1f}]",
                     f"{batch * world / median:.0f}"]
            if "ddp" in steps and variant != "ddp":
                both_quiet = [a and b for a, b in zip(quiet[variant], quiet["ddp"])]
                cells.append(_fmt_ratio(_ratios(steps["ddp"], values, everything)))
            else:
                both_quiet, cells = [], cells + [""]
            cells.append(_fmt_ratio(_ratios(steps[base], values, everything)) if base and variant != base else "")
            cells.append(str(len(quiet_values)))
            cells.append(f"{statistics.median(quiet_values) * 1e3:.1f}" if quiet_values else "-")
            cells.append(_fmt_ratio(_ratios(steps["ddp"], values, both_quiet)) if both_quiet else "")
            print("| " + " | ".join(cells) + " |")
        if data.get("phases_s"):
            print("\nwhere the time goes (rank 0, median over all timed steps; CPU = this process, all threads):\n")
            print("| variant | forward ms | backward ms (incl. waiting) | optimizer ms | CPU ms/step | "
                  "step - CPU ms |")
            print("|---|---:|---:|---:|---:|---:|")
            for variant, (fwd, bwd, opt, cpu) in data["phases_s"].items():
                print(f"| {variant} | {fwd * 1e3:.1f} | {bwd * 1e3:.1f} | {opt * 1e3:.1f} | {cpu * 1e3:.1f} | "
                      f"{(fwd + bwd + opt - cpu) * 1e3:.1f} |")
        for variant, info in data["extra"].items():
            if "chosen" in info:
                medians = ", ".join(f"{c:g} MB: {m:.1f} ms" for c, m in zip(info["candidates"],
                                                                           info["candidate_medians_ms"]))
                print(f"\n{variant} chose {info['chosen']:g} MB after {info['tuning_steps']} tuning steps "
                      f"(slowest-rank median per candidate: {medians})")
        buckets = {v: i["buckets"] for v, i in data["extra"].items() if "buckets" in i}
        if buckets:
            print("\nbuckets (MB, in launch order): " + "; ".join(
                f"{v}: {len(sizes)}" + (f" [{', '.join(f'{mb:.2f}' for mb in sizes)}]" if len(sizes) <= 6 else "")
                for v, sizes in buckets.items()))
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1])
        # DDP's reducer keeps a reference to the Gloo group past px.shutdown(); tearing that down
        # with the interpreter aborts now and then (1 worker of 4 in one run): leave as phalanx's
        # own worker_main does, without interpreter teardown, the report being written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODEL_SPECS), choices=list(MODEL_SPECS))
    parser.add_argument("--reps", type=int, default=7, help="repetitions (alternations), at least 5 advised")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each measurement")
    parser.add_argument("--quick", action="store_true", help="5 reps of 10 steps")
    parser.add_argument("--sweep", action="store_true",
                        help=f"phalanx at fusion thresholds {', '.join(SWEEP_THRESHOLDS)} MB, with DDP")
    parser.add_argument("--thresholds", nargs="+", default=SWEEP_THRESHOLDS, help="thresholds for --sweep")
    parser.add_argument("--variants", nargs="+", help="measure only these variants (names as above)")
    parser.add_argument("--netns", action="store_true",
                        help="two workers in separate network namespaces over a rate-limited veth (root)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the veth for --netns")
    parser.add_argument("--per-host", type=int, default=1,
                        help="workers per namespace with --netns (2: phalanx reduces hierarchically, DDP over flat Gloo)")
    parser.add_argument("--quiet-max", type=float, default=0.10,
                        help="a measurement is 'quiet' when other processes used at most this share of the CPUs")
    parser.add_argument("--first-bucket-mb", type=float,
                        help="override phalanx's first-bucket size (inf: no separate first bucket)")
    parser.add_argument("--json", help="also write the raw reports to this file")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per world before giving up")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps = 5, 10

    import torch

    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, Gloo, 1 intra-op thread per worker; "
          f"{args.reps} reps x ({args.warmup} warm-up + {args.steps} timed steps)")
    print(f"# command: python {' '.join([os.path.relpath(__file__)] + argv)}")
    from phalanx.parallel import buckets, data_parallel

    first = buckets.FIRST_BUCKET_MB if args.first_bucket_mb is None else args.first_bucket_mb
    print(f"# phalanx: default fusion threshold {data_parallel.DEFAULT_FUSION_THRESHOLD_MB:g} MB, "
          f"first bucket {first:g} MB")
    reports = []
    worlds = [2 * args.per_host] if args.netns else args.world_sizes
    if args.netns:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: sys.exit(130))
        netns_up(args.rate)
    try:
        for world in worlds:
            if args.sweep:
                variants = (["ddp"] if world > 1 else ["plain", "ddp"]) + [f"px@{t}" for t in args.thresholds]
            else:
                variants = ["compute", "phalanx", "ddp"] if world > 1 else ["plain", "phalanx", "ddp"]
            if args.variants:
                variants = args.variants
            print(f"\n# world size {world}: {', '.join(variants)}", flush=True)
            report = run_world(world, args.models, variants, args, netns=args.netns)
            title = f"{'netns ' + args.rate + ' ' if args.netns else ''}{'sweep' if args.sweep else 'comparison'}"
            print_table(title, report, args.quiet_max)
            reports.append(report)
    finally:
        if args.netns:
            netns_down()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(reports, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
