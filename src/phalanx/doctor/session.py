"""What each worker of ``phalanx doctor`` runs: the user's script under instrumentation.

``python -m phalanx.doctor.session --out DIR --steps K --warmup W --deadline S script.py [args]``
switches the recorder on, counts optimizer steps (torch's global optimizer hooks), and after
``W + K`` steps measures the transport (every rank is at the same step boundary), writes
``DIR/rank-R.json`` and ends the process: the doctor needs a few steps, not the whole training.
Every other measured step also records gradient norms for the noise scale (see
:mod:`phalanx.doctor.probe`). One step, the last of the warm-up (the second where the warm-up is a
single step; it is then left out of the timing), counts the tensors the worker holds
(:mod:`phalanx.doctor.footprint`): parameters, gradients and optimizer state as its forward begins
(after the step before), the activations its forwards save for backward, and the gradients again
as the optimizer starts. The record also holds the recorder's notes: the strategy the script trains
with and how often it communicates (:func:`phalanx.strategies.base.announce`). A script that has
not made its steps after ``S`` seconds is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from phalanx import profile
from phalanx.atomic import write_text_atomically
from phalanx.comm import runtime
from phalanx.doctor import footprint, load
from phalanx.doctor.calibrate import measure_transport
from phalanx.doctor.probe import Probe
from phalanx.parallel.reductions import Reduction


class Session:
    """The instrumentation of one worker: recorder, probes, step counting, the records file."""

    def __init__(self, out: Path, steps: int, warmup: int, deadline_s: float):
        self.out, self.steps, self.warmup, self.deadline_s = out, steps, warmup, deadline_s
        self.recorder = _Recorder(self._probe, self._forward)
        self.probes: list[Probe] = []
        self.optimizer: int | None = None  # the first optimizer stepped: its steps are the training steps
        self.stepped: torch.optim.Optimizer | None = None  # that optimizer
        self.count = 0
        self.load: list[dict[str, float]] = []  # snapshots when the measured steps start and end
        self.memory_step = max(warmup, 2)  # the step whose tensors are counted (after a step of optimizer state)
        self.memory: dict[str, Any] | None = None
        self.activations = footprint.Activations()

    def start(self) -> None:
        """Switch the recorder on and watch the optimizer's steps."""
        profile.recorder = self.recorder
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        watchdog = threading.Timer(self.deadline_s, self._give_up)
        watchdog.daemon = True
        watchdog.start()

    def _give_up(self) -> None:
        """The deadline passed before the measured steps: say so, keep what was seen, end the process."""
        print(f"phalanx doctor: {self.count} of {self.warmup + self.steps} optimizer steps after {self.deadline_s:g} s; "
              "stopping the script. Pass a larger --timeout or a smaller --steps.", file=sys.stderr, flush=True)
        self.finish(complete=False)
        os._exit(124)

    def _probe(self, reduction: Reduction) -> Probe:
        probe = Probe(reduction, self.recorder)
        self.probes.append(probe)
        return probe

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizer in (None, id(optimizer)):
            self.recorder.mark("optimizer")
        if self.activations.on and id(optimizer) == self.optimizer and self.memory is not None:
            activations, samples = self.activations.stop()
            at_step, _ = footprint.held(optimizer, footprint.models_of(self.probes))
            self.memory.update(activations=activations, activation_samples=samples, step_gradients=at_step["gradients"])

    def _forward(self, samples: int) -> None:
        """A training forward begins: in the counted step, count what the step before left, then
        the activations of this forward (and of the step's other forwards)."""
        if self.count == self.memory_step - 1 and self.memory is None and self.stepped is not None:
            self.recorder.mark("memory")  # the step's time is not a typical step's
            self.memory, parameters = footprint.held(self.stepped, footprint.models_of(self.probes))
            self.memory.update(elastic=runtime.is_initialized() and runtime.is_elastic(),
                               device=str(runtime.device().type) if runtime.is_initialized() else "cpu")
            self.activations.start(parameters)
        if self.activations.on:
            self.activations.forward(samples)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            self.optimizer, self.stepped = id(optimizer), optimizer
        if id(optimizer) != self.optimizer:
            return
        self.count += 1
        usage = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's share: page faults, system calls
        self.recorder.mark("step", cpu=time.process_time(), system=usage.ru_stime, faults=usage.ru_minflt)
        if self.count == self.warmup:
            self.load.append(load.snapshot())
        for probe in self.probes:  # norms on every other measured step, the rest are timed
            probe.measure_norms = self.count >= self.warmup and (self.count - self.warmup) % 2 == 0
        if self.count == self.warmup + self.steps:
            self.finish(complete=True)

    def finish(self, complete: bool) -> None:
        """Write this rank's records; once every step was seen, measure the transport and end the process."""
        if complete:
            self.load.append(load.snapshot())
        record = {"rank": runtime.rank() if runtime.is_initialized() else 0, "warmup": self.warmup,
                  "host": _host_facts(), "events": list(self.recorder.events), "complete": complete,
                  "load": self.load, "started_ray": _started_ray(), "notes": self.recorder.notes}
        if self.memory is not None and "activations" in self.memory:
            record["memory"] = self.memory
        if runtime.is_initialized():
            record.update(world_size=runtime.size(), local_size=runtime.local_size(), node=runtime.node_rank(),
                          transport="shm" if runtime.shm_executor() is not None else "gloo")
            if complete and runtime.size() > 1:
                record["transport_figures"] = measure_transport(self._bucket_bytes())
        write_text_atomically(self.out / f"rank-{record['rank']}.json", json.dumps(record))  # whole or absent
        if complete:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def _bucket_bytes(self) -> list[int]:
        """The bytes of each bucket of the last step, in launch order; where backward reduced nothing
        (px.LocalSGD, px.DiLoCo), of each fragment's exchange."""
        sizes: dict[int, int] = {}
        exchanges: dict[int, int] = {}
        for name, _, fields in self.recorder.events:
            if name == "launch":
                sizes[int(fields["bucket"])] = int(fields["bytes"])
            elif name == "outer_start":
                exchanges[int(fields["fragment"])] = int(fields["bytes"])
        found = sizes or exchanges
        return [found[index] for index in sorted(found)]


class _Recorder(profile.Recorder):
    """The session's recorder, which also tells the session when a training forward begins."""

    def __init__(self, wrap_reduction: Callable[[Any], Any], on_forward: Callable[[int], None]):
        super().__init__(wrap_reduction)
        self.on_forward = on_forward

    def mark(self, name: str, **fields: float) -> None:
        super().mark(name, **fields)
        if name == "forward":
            self.on_forward(int(fields.get("samples", 0)))


def _started_ray() -> bool:
    """Whether the script started or joined a Ray cluster: its training then runs in Ray's worker
    processes, which the doctor does not instrument."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def _host_facts() -> dict[str, Any]:
    """What oversubscription depends on (the cores this process may use and its threads) and what
    fits in memory (the host's)."""
    return {"cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "hostname": os.uname().nodename,
            "memory_bytes": _host_memory()}


def _host_memory() -> int | None:
    """The host's memory (``MemTotal`` of /proc/meminfo), ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def main(argv: list[str]) -> None:
    """Parse the session's options, switch it on, and run the script as ``python script.py`` would."""
    parser = argparse.ArgumentParser(prog="phalanx.doctor.session")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    session = Session(options.out, options.steps, options.warmup, options.deadline)
    session.start()
    sys.argv = [options.script, *options.args]
    sys.path[0] = os.path.dirname(os.path.abspath(options.script))
    try:
        runpy.run_path(options.script, run_name="__main__")
    finally:
        session.finish(complete=False)  # the script ended (or failed) before enough steps


if __name__ == "__main__":
    main(sys.argv[1:])
