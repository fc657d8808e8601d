"""The training script bench_doctor.py diagnoses and times: one of bench_ddp.py's models under px.fit.

    phalanx run -n 2 benchmarks/doctor_train.py --model cnn [--global-batch 64] [--steps 40] [--accumulate-steps 1] [--time]

With ``--time`` rank 0 prints ``STEP_S <mean seconds>`` over the steps after the first five
(timed by a callback at each step's end, nothing else instrumented).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import MODEL_SPECS, build_model  # noqa: E402

import phalanx as px  # noqa: E402

WARMUP_STEPS = 5


class StepTimer:
    """Records when each step ended; the mean step after the warm-up is the run's step time."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, step: int, logs: dict, state: object) -> None:
        self.ends.append(time.perf_counter())

    def mean_step_s(self) -> float:
        kept = self.ends[WARMUP_STEPS:]
        return (kept[-1] - kept[0]) / (len(kept) - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODEL_SPECS), required=True)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accumulate-steps", type=int, default=1)
    parser.add_argument("--time", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    px.init()
    spec = MODEL_SPECS[args.model]
    batch = args.global_batch or 2 * spec["batch"]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn([batch * args.steps, *spec["input"]], generator=generator)
    y = torch.randint(0, spec["classes"], (batch * args.steps,), generator=generator)
    torch.manual_seed(0)
    model = build_model(args.model)
    timer = StepTimer()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, (x, y), epochs=1,
           global_batch_size=batch, callbacks=[timer], verbose=0, accumulate_steps=args.accumulate_steps)
    if args.time and px.rank() == 0:
        print(f"STEP_S {timer.mean_step_s():.6f}", flush=True)
    px.shutdown()


if __name__ == "__main__":
    main()
