"""A script for `phalanx doctor`'s prediction tests: an MLP trained by px.fit, steps of ~20 ms of
compute (steady enough that two runs of one configuration agree within a few percent here).

With ``--time`` rank 0 prints ``STEPS {"steps": [...], "other_load": ...}`` at the end: each
step's seconds from the previous step's end (a callback; nothing else is instrumented), and the
cores other processes kept busy meanwhile (:mod:`phalanx.doctor.load`): a plain run measured as
the doctor measures its own runs.
"""

import json
import sys
import time

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.doctor import load

SAMPLES, FEATURES, HIDDEN, CLASSES, BATCH = 4096, 256, 1024, 10, 128


class StepTimes:
    """When each step ended; the host's busy time from the first step's end."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.start: dict[str, float] = {}

    def on_step_end(self, step: int, logs: dict, state: object) -> None:
        self.ends.append(time.perf_counter())
        if not self.start:
            self.start = load.snapshot()

    def report(self) -> str:
        steps = [end - start for start, end in zip(self.ends, self.ends[1:])]
        return "STEPS " + json.dumps({"steps": steps, "other_load": load.other_load([(self.start, load.snapshot())])})


if __name__ == "__main__":
    torch.set_num_threads(1)
    px.init()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES] * 3).argmax(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    timer = StepTimes()
    timed = "--time" in sys.argv
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, (x, y), epochs=1,
           global_batch_size=BATCH, callbacks=[timer] if timed else (), verbose=0)
    if timed and px.rank() == 0:
        print(timer.report(), flush=True)
