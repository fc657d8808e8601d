"""Time to a validation loss over a slow link: px.DataParallel against local SGD and DiLoCo.

    python benchmarks/bench_slow_link.py                  # one host, 1 Gbit/s and 100 Mbit/s (root)
    python benchmarks/bench_slow_link.py --quick          # a 1-2 minute smoke run (50 steps)
    python benchmarks/bench_slow_link.py --settings 100mbit --reps 2
    python benchmarks/bench_slow_link.py --json slow.json         # keep the curves ...
    python benchmarks/bench_slow_link.py --doctor-check slow.json # ... and hold the doctor to them (no root)

Two workers train a small causal transformer language model (byte level, 256 symbols) on a real
text corpus: the English text of Python's own documentation shipped with the interpreter
(``pydoc_data.topics.topics``, the topics joined in sorted order, about 465 KB), the first 95 %
for training and the last 5 % for validation, cut into windows of ``--context`` bytes. The
default model (width 128, 2 layers, context 64: 470,784 parameters, 1.88 MB per fp32 allreduce)
and global batch (4 windows, 2 per worker) make the allreduce most of a px.DataParallel step at
100 Mbit/s. dp trains ``--steps`` steps (S), every other variant up to ``--budget`` x S (B), at the
same global batch with Adam, from the same seed (the same initial weights and the same order of
batches), through ``px.fit``:

  dp          px.DataParallel: every gradient allreduced every step (fp32)
  dp-bf16     px.DataParallel(model, reduction="bf16"): half the bytes
  topk        px.DataParallel(model, reduction=px.TopK(--topk-ratio)), with error feedback
  localsgd10  px.LocalSGD(period=10)
  localsgd50  px.LocalSGD(period=50): DiLoCo(50) with an outer SGD of lr 1 and no momentum
  diloco10    px.DiLoCo(period=10): the outer optimizer Nesterov SGD of --outer-lr and
              --outer-momentum (the paper's lr 0.7, momentum 0.9 by default)
  diloco50    px.DiLoCo(period=50)
  diloco100   px.DiLoCo(period=100): the period ``phalanx doctor --bandwidth 0.1`` recommends for this
              model and batch (RESULTS.md), checked here
  streaming10 px.DiLoCo(period=10, fragments=2): Streaming DiLoCo, delay 1 (the default)
  streaming100 px.DiLoCo(period=100, fragments=4, delay=2): the doctor's period, each quarter of the
              model exchanged over two inner steps (named only)

Network settings: ``host`` (both workers on this host: phalanx's shared-memory transport),
``1gbit`` and ``100mbit`` (each worker in its own network namespace, joined by a veth shaped with
tbf: bench_ddp.py's netns_up, needs root; the namespaces are removed afterwards whatever happens).
Each setting is one job of two workers (one intra-op thread each) in which the variants take
turns, in a shuffled order per repetition (the same on every rank), after ``--warmup`` untimed dp
steps (a job's first steps over a new link are seconds slower).

Every ``--eval-every`` steps (E, a multiple of every period but streaming's, so that the workers
hold the same weights there) the validation loss of the *average of the workers' weights* is
computed (for streaming DiLoCo, whose fragments are merged at staggered steps, that average is
what is scored); the time this takes, the averaging included, is left out of the training wall
time. Reported per setting: each variant's training wall time for S steps (and its ratio to
dp's: on one host, what the variant costs or saves per step), its validation loss
after S steps (an equal number of samples) and its ratio to dp's, and the training wall time at
which it first reached, at an evaluation point, the loss dp reaches after S steps ("not reached"
when it does not within B x S steps) with the speed-up against dp's time for S steps; medians over
``--reps`` (ratios taken within a repetition). PASS/FAIL lines check issue 45's targets at 100
Mbit/s: DiLoCo reaches dp's loss at least 5x sooner, and its loss after S steps is within 3 % of dp's.

``--doctor-check FILE`` holds ``phalanx doctor``'s predictions to a previous run's ``--json FILE``:
it runs the doctor (``px.diagnose``, 2 workers on this host and the 1-worker reference, a few
dozen steps; no namespaces, no root) on the benchmark's own model and batch trained by
px.DataParallel (the model's settings are read from the file, else taken from the options), then,
for every setting in the file, predicts the step of dp, diloco10, diloco50 and streaming10 where
the benchmark ran them (``host``: 2 workers on this host; ``1gbit``/``100mbit``: 2 hosts of one
worker at 1 and 0.1 Gbit/s) and prints it beside the measured training time per step (median over
the repetitions) and their ratio; then the communication alone, the doctor's predicted exposed
time per step against what the variant took per step beyond its own ``host`` time (which holds
even where this host computes at another speed than when the benchmark ran); and the DiLoCo
period the doctor predicts will hide each link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from bench_ddp import netns_down, netns_up, start_workers

VARIANTS = ["dp", "dp-bf16", "topk", "localsgd10", "localsgd50", "diloco10", "diloco50", "diloco100", "streaming10",
            "streaming100"]
PERIODS = {"localsgd10": 10, "localsgd50": 50, "diloco10": 10, "diloco50": 50, "diloco100": 100}  # the workers agree after multiples of these
STREAMING = {"streaming10": (10, 2, 1), "streaming100": (100, 4, 2)}  # period, fragments, delay
NAMED_ONLY = ("diloco100", "streaming100")  # run only when --variants names them
SETTINGS = {"host": None, "1gbit": "1gbit", "100mbit": "100mbit"}  # name: tbf rate (None: one host)
VOCAB = 256
TARGET_SPEEDUP, TARGET_LOSS_RATIO = 5.0, 1.03


# ---------------------------------------------------------------------------------------------
# Data and model (built identically in every worker and for every variant)
# ---------------------------------------------------------------------------------------------


def corpus_windows(context: int) -> tuple[Any, Any, Any, Any]:
    """Python's documentation topics as bytes, cut into windows of ``context`` inputs and the next
    byte of each as targets: (train inputs, train targets, validation inputs, validation targets)."""
    import torch
    from pydoc_data.topics import topics

    text = "".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)

    def windows(part: Any) -> tuple[Any, Any]:
        count = (len(part) - 1) // context
        inputs = part[:count * context].view(count, context)
        targets = part[1:count * context + 1].view(count, context)
        return inputs, targets

    return (*windows(data[:split]), *windows(data[split:]))


def build_model(width: int, layers: int, context: int) -> Any:
    """A pre-norm causal transformer over bytes: embeddings, ``layers`` encoder layers of ``width``
    (4 heads, feed-forward 4x) under a causal mask, a linear head to the 256 next-byte logits."""
    import torch
    from torch import nn

    class ByteLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, width)
            self.position = nn.Parameter(torch.randn(context, width) * 0.02)
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, tokens) -> (batch, tokens, 256)
            tokens = x.shape[1]
            hidden = self.embed(x) + self.position[:tokens]
            hidden = self.encoder(hidden, mask=self.mask[:tokens, :tokens], is_causal=True)
            return self.head(self.norm(hidden))

    return ByteLM()


def lm_loss(outputs: Any, targets: Any) -> Any:
    """Mean next-byte cross-entropy over every position of the batch (nats)."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1))


def wrap_variant(name: str, model: Any, topk_ratio: float, outer: tuple[float, float]) -> tuple[Any, Any]:
    """The model and strategy ``px.fit`` trains variant ``name`` with; DiLoCo's outer optimizer is
    Nesterov SGD of ``outer`` (learning rate, momentum)."""
    import torch

    import phalanx as px

    def outer_sgd(params: Any) -> Any:
        lr, momentum = outer
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    if name == "dp":
        return model, None
    if name == "dp-bf16":
        return px.DataParallel(model, reduction="bf16"), None
    if name == "topk":
        return px.DataParallel(model, reduction=px.TopK(topk_ratio)), None
    if name == "localsgd10":
        return model, px.LocalSGD(period=10)
    if name == "localsgd50":
        return model, px.LocalSGD(period=50)
    if name == "diloco10":
        return model, px.DiLoCo(period=10, outer_optimizer=outer_sgd)
    if name in ("diloco50", "diloco100"):
        return model, px.DiLoCo(period=PERIODS[name], outer_optimizer=outer_sgd)
    if name in STREAMING:
        period, fragments, delay = STREAMING[name]
        return model, px.DiLoCo(period=period, fragments=fragments, delay=delay, outer_optimizer=outer_sgd)
    raise ValueError(f"unknown variant {name!r}")


def bytes_per_step(name: str, params: int, topk_ratio: float) -> float:
    """What one worker contributes to the exchanges, per step, on average (payload bytes)."""
    if name == "dp":
        return 4.0 * params
    if name == "dp-bf16":
        return 2.0 * params
    if name == "topk":  # fp32 values and int64 indices of the entries kept (per bucket, about the ratio)
        return 12.0 * params * topk_ratio
    return 4.0 * params / (PERIODS[name] if name in PERIODS else STREAMING[name][0])


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


class Scorer:
    """Validation loss of the average of the workers' weights (collective): each rank scores its
    share of the validation windows with a model of its own that training never touches."""

    def __init__(self, config: dict[str, Any], val_x: Any, val_y: Any):
        import phalanx as px

        self.model = build_model(config["width"], config["layers"], config["context"]).eval()
        rank, world = px.rank(), px.size()
        self.x, self.y = val_x[rank::world], val_y[rank::world]

    def __call__(self, trained: Any) -> float:
        import torch
        from torch.nn.utils import parameters_to_vector, vector_to_parameters

        import phalanx as px

        with torch.no_grad():
            average = px.allreduce(parameters_to_vector(trained.parameters()).detach(), "sum") / px.size()
            vector_to_parameters(average, self.model.parameters())
            total = torch.zeros(2, dtype=torch.float64)
            for start in range(0, len(self.x), 64):
                outputs = self.model(self.x[start:start + 64])
                total[0] += float(torch.nn.functional.cross_entropy(
                    outputs.reshape(-1, VOCAB), self.y[start:start + 64].reshape(-1), reduction="sum"))
                total[1] += self.y[start:start + 64].numel()
            total = px.allreduce(total, "sum")
        return float(total[0] / total[1])


class Curve:
    """A px.fit callback: every ``every`` steps, the training wall time so far (without the time
    scoring takes) and the validation loss; stops training after ``steps`` steps."""

    def __init__(self, model: Any, scorer: Scorer, steps: int, every: int):
        self.model, self.scorer, self.steps, self.every = model, scorer, steps, every
        self.started: float | None = None
        self.scoring = 0.0
        self.points: list[tuple[int, float, float]] = []  # (step, training seconds, validation loss)

    def on_step_begin(self, step: int, state: Any) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_step_end(self, step: int, logs: dict[str, float], state: Any) -> None:
        done = state.global_step
        if done % self.every == 0:
            assert self.started is not None
            now = time.perf_counter()
            loss = self.scorer(self.model)
            self.points.append((done, now - self.started - self.scoring, loss))
            self.scoring += time.perf_counter() - now
        if done >= self.steps:
            state.stop_training = True


def worker_main(config_path: str) -> None:
    import torch

    import phalanx as px

    torch.set_num_threads(1)
    with open(config_path) as handle:
        config = json.load(handle)
    px.init(backend="gloo")
    train_x, train_y, val_x, val_y = corpus_windows(config["context"])
    train_data = torch.utils.data.TensorDataset(train_x, train_y)
    scorer = Scorer(config, val_x, val_y)
    batch = config["global_batch"]
    curves: dict[str, list[list[tuple[int, float, float]]]] = {name: [] for name in config["variants"]}

    def train(name: str, steps: int, every: int) -> list[tuple[int, float, float]]:
        torch.manual_seed(config["seed"])
        model = build_model(config["width"], config["layers"], config["context"])
        trained, strategy = wrap_variant(name, model, config["topk_ratio"], (config["outer_lr"], config["outer_momentum"]))
        curve = Curve(model, scorer, steps, every)
        px.fit(trained, torch.optim.Adam(model.parameters(), lr=config["lr"]), lm_loss, train_data,
               epochs=math.ceil(steps / (len(train_data) // batch)), global_batch_size=batch, seed=config["seed"],
               callbacks=[curve], strategy=strategy, verbose=0)
        return curve.points

    # The job's first steps over a new link are slower (by seconds at 100 Mbit/s): untimed, before any variant.
    train("dp", config["warmup"], config["warmup"])
    for rep in range(config["reps"]):
        order = list(config["variants"])
        random.Random(rep).shuffle(order)  # same order on every rank; no variant always follows another
        for name in order:
            steps = config["steps"] if name == "dp" else round(config["budget"] * config["steps"])
            curves[name].append(train(name, steps, config["eval_every"]))
            points = curves[name][-1]
            if px.rank() == 0:
                print(f"  [{config['setting']}] rep {rep + 1}/{config['reps']} {name}: "
                      f"{points[-1][1]:.1f} s, val loss {points[-1][2]:.4f}", file=sys.stderr, flush=True)
    if px.rank() == 0:
        with open(config["result_path"], "w") as handle:
            json.dump({"curves": curves, "train_windows": len(train_data), "val_windows": len(val_x)}, handle)
    px.shutdown()


# ---------------------------------------------------------------------------------------------
# Launcher side
# ---------------------------------------------------------------------------------------------


def doctor_train(config_json: str) -> None:
    """What ``--doctor-check`` has the doctor measure: the benchmark's model and batch trained by
    px.DataParallel through px.fit, as a worker of the benchmark trains dp (the doctor stops it)."""
    import torch

    import phalanx as px

    config = json.loads(config_json)
    torch.set_num_threads(1)
    px.init(backend="gloo")
    train_x, train_y, _, _ = corpus_windows(config["context"])
    torch.manual_seed(config["seed"])
    model = build_model(config["width"], config["layers"], config["context"])
    px.fit(model, torch.optim.Adam(model.parameters(), lr=config["lr"]), lm_loss,
           torch.utils.data.TensorDataset(train_x, train_y), epochs=1, global_batch_size=config["global_batch"],
           seed=config["seed"], verbose=0)


#: The benchmark's settings as the doctor's layouts: (workers, workers per host, Gbit/s between hosts).
DOCTOR_LAYOUTS = {"host": (2, 2, None), "1gbit": (2, 1, 1.0), "100mbit": (2, 1, 0.1)}
#: The variants the doctor predicts, as the schedule of their exchanges (None: gradients every step).
DOCTOR_VARIANTS = {"dp": None, "diloco10": (10, 1, 0), "diloco50": (50, 1, 0),
                   "streaming10": STREAMING["streaming10"]}


def doctor_check(path: str, args: argparse.Namespace) -> int:
    """Predicted step times of the doctor against a previous run's measured ones (see the module's docstring)."""
    from dataclasses import replace

    from phalanx.cli.doctor import diagnose
    from phalanx.doctor import advice, predict
    from phalanx.strategies.base import Exchanges

    with open(path) as handle:
        reports = json.load(handle)
    config = next((r["config"] for r in reports.values() if "config" in r), None) or vars(args)
    model_config = {key: config[key] for key in ("width", "layers", "context", "global_batch", "lr", "seed")}
    print(f"# doctor check of {path}: {model_config}")
    diagnosis = diagnose(os.path.abspath(__file__), ["--doctor-train", json.dumps(model_config)], workers=2,
                         steps=args.doctor_steps, warmup=5, bandwidths_gbit=[0.1, 1.0])
    model, run = diagnosis.model, diagnosis.measured
    print(f"# doctor: {run.step_s * 1e3:.1f} ms a dp step on 2 workers here ({run.exposed_comm_s * 1e3:.1f} ms "
          f"exposed), {run.model_bytes or 0:,} bytes of parameters")
    if model is None or model.busy:
        print("# the doctor predicted nothing (a busy host, or no transport figures): rerun on a quiet host")
        return 1
    print("\n| setting | variant | doctor ms/step | benchmark ms/step | doctor / benchmark | doctor's exposed comm "
          "ms/step | benchmark beyond host ms/step |\n|---|---|---:|---:|---:|---:|---:|")
    measured = {(setting, name): statistics.median(points[-1][1] / points[-1][0] for points in reps)
                for setting, report in reports.items() for name, reps in report.get("curves", {}).items()}
    for setting, (workers, per_host, bandwidth) in DOCTOR_LAYOUTS.items():
        layout = predict.Layout(workers, per_host, bandwidth)
        for name, schedule in DOCTOR_VARIANTS.items():
            if (setting, name) not in measured:
                continue
            variant = model if schedule is None else replace(model, schedule=Exchanges(*schedule))
            predicted = predict.predict(variant, layout)
            step = measured[(setting, name)]
            beyond = step - measured[("host", name)] if ("host", name) in measured else None
            print(f"| {setting} | {name} | {predicted.step_s * 1e3:.1f} | {step * 1e3:.1f} | "
                  f"{predicted.step_s / step:.2f} | {predicted.exposed_s * 1e3:.1f} | "
                  f"{'-' if beyond is None else f'{beyond * 1e3:.1f}'} |")
    for setting, (workers, per_host, bandwidth) in DOCTOR_LAYOUTS.items():
        if bandwidth is None:
            continue
        layout = predict.Layout(workers, per_host, bandwidth)
        step = predict.predict(model, layout)
        whole = predict.exchange_time(model, layout, model.model_bytes)
        period = advice.hiding_period(whole, step.work_s)
        print(f"# {setting}: one exchange of the model {whole * 1e3:.1f} ms against {step.work_s * 1e3:.1f} ms of "
              f"compute a step: the doctor's period is {period or 'none up to ' + str(advice.ROUND_PERIODS[-1])}")
    return 0


def run_setting(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of two workers on ``setting`` (namespaces made and removed here); rank 0's report."""
    workdir = tempfile.mkdtemp(prefix="px-slow-link-")
    config = {"setting": setting, "variants": args.variants, "reps": args.reps, "steps": args.steps,
              "eval_every": args.eval_every, "warmup": args.warmup, "global_batch": args.global_batch, "lr": args.lr,
              "seed": args.seed, "width": args.width, "layers": args.layers, "context": args.context,
              "topk_ratio": args.topk_ratio, "budget": args.budget, "outer_lr": args.outer_lr,
              "outer_momentum": args.outer_momentum,
              "result_path": os.path.join(workdir, "result.json")}
    config_path = os.path.join(workdir, "config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    rate = SETTINGS[setting]
    try:
        if rate is not None:
            netns_up(rate)
        start_workers(os.path.abspath(__file__), config_path, 2, args.timeout, netns=rate is not None)
    finally:
        if rate is not None:
            netns_down()
    with open(config["result_path"]) as handle:
        return {**json.load(handle), "config": config}  # the model's settings, for --doctor-check


def reached(points: list[list[float]], target: float) -> float | None:
    """The training time at the first evaluation point whose loss is at most ``target``."""
    return next((seconds for _, seconds, loss in points if loss <= target), None)


def summarize(report: dict[str, Any], steps: int) -> dict[str, dict[str, Any]]:
    """Per variant, medians over repetitions: training time for S = ``steps`` steps, the loss there
    and its ratio to dp's, time to dp's loss at S (over every step the variant trained, up to the
    budget) and the speed-up (over the repetitions where it was reached)."""
    curves = report["curves"]
    reference = [at_step(points, steps) for points in curves["dp"]]
    summary = {}
    for name, reps in curves.items():
        times = [at_step(points, steps)[1] for points in reps]
        losses = [at_step(points, steps)[2] for points in reps]
        ratios = [loss / ref[2] for loss, ref in zip(losses, reference)]
        hits = [(reached(points, ref[2]), ref[1]) for points, ref in zip(reps, reference)]
        found = [(hit, dp_time) for hit, dp_time in hits if hit is not None]
        summary[name] = {
            "time": statistics.median(times), "loss": statistics.median(losses),
            "time_ratio": statistics.median(t / ref[1] for t, ref in zip(times, reference)),
            "ratio": statistics.median(ratios), "reached": len(found), "reps": len(reps),
            "to_target": statistics.median(hit for hit, _ in found) if found else None,
            "speedup": statistics.median(dp_time / hit for hit, dp_time in found) if found else None}
    return summary


def at_step(points: list[list[float]], step: int) -> list[float]:
    """The evaluation point (step, training seconds, loss) at ``step``."""
    return next(point for point in points if point[0] >= step)


def print_table(setting: str, summary: dict[str, dict[str, Any]], args: argparse.Namespace, params: int) -> None:
    """One markdown table for a network setting (see the module docstring for the columns)."""
    print(f"\n### {setting}: 2 workers, {args.steps} steps of global batch {args.global_batch}, "
          f"{args.reps} rep(s)\n")
    print("| variant | sent/step/worker | train s (S steps) | ms/step | time vs dp | val loss @S | vs dp | "
          "time to dp's loss @S | speed-up vs dp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in summary.items():
        if row["to_target"] is None:
            to_target, speedup = "not reached", "-"
        else:
            partial = f" ({row['reached']}/{row['reps']} reps)" if row["reached"] < row["reps"] else ""
            to_target, speedup = f"{row['to_target']:.1f} s{partial}", f"{row['speedup']:.2f}x"
        print(f"| {name} | {bytes_per_step(name, params, args.topk_ratio) / 1e6:.3f} MB | {row['time']:.1f} | "
              f"{row['time'] / args.steps * 1e3:.0f} | {row['time_ratio']:.2f} | {row['loss']:.4f} | "
              f"{row['ratio']:.3f} | {to_target} | {speedup} |")
    sys.stdout.flush()


def check_targets(summary: dict[str, dict[str, Any]]) -> None:
    """Issue 45's targets for each DiLoCo variant at 100 Mbit/s, as PASS/FAIL lines."""
    print()
    for name in (n for n in summary if n.startswith(("diloco", "streaming"))):
        row = summary[name]
        speedup = row["speedup"]
        said = f"{speedup:.2f}x sooner" if speedup is not None else "not reached within the budget"
        print(f"{'PASS' if speedup is not None and speedup >= TARGET_SPEEDUP else 'FAIL'} 100mbit {name}: "
              f"reaches dp's loss after S steps {said} (target >= {TARGET_SPEEDUP:g}x)")
        print(f"{'PASS' if row['ratio'] <= TARGET_LOSS_RATIO else 'FAIL'} 100mbit {name}: val loss after S steps "
              f"{row['ratio']:.3f} x dp's (target <= {TARGET_LOSS_RATIO:g})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1])
        return 0
    if argv[:1] == ["--doctor-train"]:
        doctor_train(argv[1])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v not in NAMED_ONLY],
                        choices=VARIANTS, help="dp is always measured; diloco100 and streaming100 only when named "
                        "(with --eval-every 100)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per variant (S)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between validations (E), a multiple of every chosen period (50; 100 with diloco100)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed dp steps at the start of each job")
    parser.add_argument("--reps", type=int, default=1, help="repetitions (alternations)")
    parser.add_argument("--global-batch", type=int, default=4,
                        help="windows per step over both workers (2 each: the allreduce dominates at 100 Mbit/s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the inner one)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="bytes per window")
    parser.add_argument("--topk-ratio", type=float, default=0.01, help="share of each bucket px.TopK sends")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=2.0,
                        help="the other variants train up to BUDGET x S steps, to see when they reach dp's loss at S")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (the paper's 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo's outer Nesterov momentum (the paper's 0.9; 0: plain SGD)")
    parser.add_argument("--quick", action="store_true", help="50 steps, validated once: a smoke run")
    parser.add_argument("--json", help="also write the raw curves to this file")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per setting before giving up")
    parser.add_argument("--doctor-check", metavar="FILE",
                        help="hold phalanx doctor's predicted steps to a previous run's --json FILE (runs no setting)")
    parser.add_argument("--doctor-steps", type=int, default=30, help="the doctor's measured steps (--doctor-check)")
    args = parser.parse_args(argv)
    if args.doctor_check:
        return doctor_check(args.doctor_check, args)
    if args.quick:
        args.steps, args.eval_every, args.reps, args.warmup = 50, 50, 1, 10
    args.variants = ["dp", *(v for v in args.variants if v != "dp")]
    agree_every = math.lcm(*(PERIODS.get(v, 1) for v in args.variants))
    if args.eval_every % agree_every or args.steps % args.eval_every:
        parser.error(f"--eval-every must be a multiple of {agree_every} (the chosen variants' workers agree "
                     "there) and divide --steps")
    if any(SETTINGS[s] for s in args.settings) and os.geteuid() != 0:
        parser.error("the 1gbit and 100mbit settings make network namespaces: run as root, or --settings host")

    import torch

    params = sum(p.numel() for p in build_model(args.width, args.layers, args.context).parameters())
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, Gloo, 1 intra-op thread per worker, 2 workers")
    print(f"# command: python {' '.join([os.path.relpath(__file__)] + argv)}")
    print(f"# model: byte-level causal transformer, width {args.width}, {args.layers} layers, context "
          f"{args.context}: {params:,} parameters, {4 * params / 1e6:.2f} MB per fp32 allreduce; Adam lr {args.lr:g}, "
          f"global batch {args.global_batch} windows ({args.global_batch * args.context} bytes), S = {args.steps}, "
          f"E = {args.eval_every}, TopK ratio {args.topk_ratio:g}, DiLoCo's outer SGD lr {args.outer_lr:g} momentum "
          f"{args.outer_momentum:g}{'' if args.outer_momentum == 0 else ' (Nesterov)'}, other variants up to "
          f"{args.budget:g} x S steps")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(130))
    reports = {}
    began = time.monotonic()
    for setting in args.settings:
        print(f"\n# {setting}: {', '.join(args.variants)}", flush=True)
        reports[setting] = run_setting(setting, args)
        summary = summarize(reports[setting], args.steps)
        print(f"# corpus: {reports[setting]['train_windows']} training windows, "
              f"{reports[setting]['val_windows']} validation windows")
        print_table(setting, summary, args, params)
        if setting == "100mbit":
            check_targets(summary)
    print(f"\n# total {time.monotonic() - began:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(reports, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
