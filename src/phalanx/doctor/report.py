"""The doctor's report as text: the step, the communication, the host, causes, noise scale, predictions, advice,
memory."""

from __future__ import annotations

from phalanx.doctor.diagnosis import Diagnosis
from phalanx.doctor.measured import Measured
from phalanx.doctor.memory import HOST_SHARE, MemoryReport
from phalanx.doctor.predict import Layout

#: Kernel time above this share of a step is named with the run's figure: another run may not pay it.
KERNEL_SHARE = 0.05


def render(diagnosis: Diagnosis, script: str) -> str:
    """The whole report."""
    run = diagnosis.measured
    sections = [_header(run, diagnosis.reference, script), _strategy(run), _phases(run), _communication(run),
                _host(run),
                _causes(diagnosis.causes), _noise(diagnosis), _predictions(diagnosis), _slow_links(diagnosis),
                _recommendations(diagnosis), _memory(diagnosis.memory)]
    return "\n\n".join(section for section in sections if section) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _header(run: Measured, reference: Measured | None, script: str) -> str:
    line = (f"phalanx doctor: {script} on {run.world_size} worker(s), transport {run.transport}; {run.steps} timed "
            f"steps of a global batch of {run.global_batch}: {_ms(run.step_s)} per step{_kernel(run)}, "
            f"{run.global_batch / run.step_s:.0f} samples/s")
    left_out = [f"{n} slower step(s)" for n in (run.outliers,) if n]
    if run.short_batches:
        left_out.insert(0, f"short last batch(es) of {', '.join(map(str, run.short_batches))}")
    if left_out:
        line += f" ({' and '.join(left_out)} left out)"
    if reference is not None:
        line += f"\n1 worker, same script and batch: {_ms(reference.step_s)} per step{_kernel(reference)}"
        if _kernel(reference) or _kernel(run):
            line += ("\n  (page faults: memory given back to the kernel and touched afresh every step; a run whose "
                     "allocator keeps it is up to that much faster, so runs of this script can differ by as much)")
    return line


def _strategy(run: Measured) -> str:
    return f"Strategy: {run.strategy}: {run.schedule.describe()}"


def _kernel(run: Measured) -> str:
    """The kernel's time in the step where it is worth naming, with the page faults that make it."""
    if run.system_s <= KERNEL_SHARE * run.step_s:
        return ""
    return f" ({_ms(run.system_s)} of it in the kernel: {run.page_faults:.0f} page faults)"


def _phases(run: Measured) -> str:
    rows = [("data wait", run.data_wait_s), ("forward", run.forward_s), ("backward", run.backward_s),
            ("(forward+backward)", None if run.forward_s is not None else run.compute_s),
            ("exposed comm", run.exposed_comm_s), ("optimizer", run.optimizer_s), ("other", run.other_s)]
    weighted = "; steps with an exchange as often as the schedule has them" if run.local_steps else ""
    lines = [f"Per step (mean over ranks{weighted}):"]
    lines += [f"  {name:<20}{_ms(value):>10}  {100 * value / run.step_s:5.1f}%" for name, value in rows if value is not None]
    return "\n".join(lines)


def _communication(run: Measured) -> str:
    figures = run.transport_figures
    if not figures:
        return "Communication: none (one worker)."
    link = (f"  link (point-to-point over Gloo): latency {figures['p2p_alpha_s'] * 1e3:.3f} ms, bandwidth "
            f"{_gbit(figures['p2p_beta_s_per_byte'])}; Gloo ring: alpha {figures['ring_alpha_s'] * 1e3:.3f} ms, "
            f"{_gbit(figures['ring_beta_s_per_byte'])}")
    if run.local_steps:
        return f"{_exchanges(run)}\n{link}"
    if not run.buckets:  # px.Sharded plugs its own reduction into the engine, which the probe does not wrap
        return "Communication: the strategy's own reduction, whose buckets the doctor does not time."
    alone = run.comm_alone_s or 0.0
    lines = [f"Communication: {run.bytes_per_step / 1e6:.2f} MB reduced per step in {len(run.buckets)} bucket(s); "
             f"alone they take {_ms(alone)} ({run.bytes_per_step / alone / 1e9:.2f} GB/s achieved), beside "
             f"backward {_ms(run.exposed_comm_s)} is exposed: {100 * (run.overlapped or 0):.0f}% overlapped", link,
             "  bucket timeline (launch after backward began / size / alone / waited at backward's end):"]
    lines += [f"    #{i}: {_ms(b.ready_s):>9} {b.bytes / 1e6:8.2f} MB {_ms(b.alone_s):>9} {_ms(b.exposed_s):>9}"
              for i, b in enumerate(run.buckets)]
    return "\n".join(lines)


def _exchanges(run: Measured) -> str:
    """px.LocalSGD's and px.DiLoCo's exchanges: what one costs, and what that is per step over the schedule."""
    schedule = run.schedule
    if run.exchange_wait_s is None:
        return (f"Communication: no exchange of {run.strategy} fell in the {run.steps} timed steps "
                f"({schedule.fragments} every {schedule.period}), so its cost is not measured and the figures per step "
                f"leave it out: run the doctor with --steps {schedule.period} or more.")
    beyond = ("" if run.exchange_step_s is None else
              f" and its step(s) took {_ms(run.exchange_step_s)} longer than a step without one")
    return (f"Communication: {run.strategy} exchanged {run.exchange_bytes / 1e6:.2f} MB {run.exchanges} time(s) in "
            f"the {run.steps} timed steps; an exchange waited {_ms(run.exchange_wait_s)} (exposed){beyond}; over "
            f"its schedule ({schedule.fragments} every {schedule.period} steps) that is {_ms(run.exposed_comm_s)} "
            f"exposed and {run.bytes_per_step / 1e6:.3f} MB sent per step")


def _gbit(beta: float) -> str:
    return f"{8e-9 / beta:.1f} Gbit/s" if beta > 0 else "beyond measuring"


def _host(run: Measured) -> str:
    verdict = "oversubscribed: workers take turns on the cores" if run.oversubscription > 1 else "not oversubscribed"
    return (f"Host: {run.workers_per_host} worker(s) x {run.threads} thread(s) on {run.cores} core(s) "
            f"({run.oversubscription:.1f} per core, {verdict}); CPU time {_ms(run.cpu_s)} per step of {_ms(run.step_s)}, "
            f"{_ms(run.system_s)} of it in the kernel ({run.page_faults:.0f} page faults); "
            f"data wait {100 * run.data_wait_s / run.step_s:.0f}% of the step")


def _causes(causes: list[str]) -> str:
    return "Why the step takes what it takes:\n" + "\n".join(f"  - {c}" for c in causes) if causes else ""


def _noise(diagnosis: Diagnosis) -> str:
    scale = diagnosis.noise
    if scale is None:
        return "Gradient noise scale: not measured (needs 2 or more workers and the default reduction)."
    value = f"{scale.b_simple:.0f}" if scale.b_simple is not None else "beyond measuring (|G|² <= 0)"
    return (f"Gradient noise scale B_simple = {value} from {scale.samples} rank-steps (critical batch ~ B_simple)\n"
            f"  larger global batch / more workers shorten training? {scale.verdict()}\n"
            f"  learning rate: {scale.learning_rate_rule()}")


def _predictions(diagnosis: Diagnosis) -> str:
    model = diagnosis.model
    if model is None or not diagnosis.predictions:
        reasons = sorted({reason for _, reason in diagnosis.not_predicted})
        return "\n".join(f"Predicted: nothing; {reason}" for reason in reasons)
    lines = ["Predicted (on this host: the measured global batch; across hosts: the measured batch per worker):",
             "  workers  per host  link          global batch     step  samples/s  efficiency  from"]
    rows = [(p.layout, p) for p in diagnosis.predictions] + [(layout, None) for layout, _ in diagnosis.not_predicted]
    for layout, p in sorted(rows, key=lambda row: _row_order(row[0])):
        link = ("this host" if layout.hosts == 1 else
                "measured" if layout.bandwidth_gbit is None else f"{layout.bandwidth_gbit:g} Gbit/s")
        head = f"  {layout.world_size:>7}  {layout.workers_per_host:>8}  {link:<12}"
        if p is None:
            lines.append(f"{head}{'':>14}{'-':>10}  {'-':>9}  {'-':>10}  not predicted (see below)")
            continue
        lines.append(f"{head}{p.global_batch:>14g}{_ms(p.step_s):>10}  {p.throughput:>9.0f}  {100 * p.efficiency:>9.0f}%"
                     f"  {model.measured_as(layout) or 'model'}")
    reasons: dict[str, list[int]] = {}
    for layout, reason in diagnosis.not_predicted:
        reasons.setdefault(reason, []).append(layout.world_size)
    lines += [f"  not predicted at {', '.join(map(str, sizes))} worker(s): {reason}" for reason, sizes in reasons.items()]
    lines += ["  assumed:"] + [f"    - {assumption}" for assumption in diagnosis.assumptions]
    return "\n".join(lines)


def _slow_links(diagnosis: Diagnosis) -> str:
    if not diagnosis.slow_links:
        return ""
    return "Over slow links (predicted):\n" + "\n".join(f"  - {check.verdict()}" for check in diagnosis.slow_links)


def _row_order(layout: Layout) -> tuple[bool, float, int]:
    """This host first, then each link (the measured one first), by workers."""
    link = -1.0 if layout.bandwidth_gbit is None else layout.bandwidth_gbit
    return layout.hosts > 1, link, layout.world_size


def _recommendations(diagnosis: Diagnosis) -> str:
    if diagnosis.model is not None and diagnosis.model.busy:
        return "Recommendations: none; the host was too busy to predict what a change would gain (see above)."
    if not diagnosis.recommendations:
        return "Recommendations: none predicted to gain 3% or more."
    lines = ["Recommendations, best first (predicted step per global batch of the run, gain in time to train):"]
    for index, r in enumerate(diagnosis.recommendations, 1):
        note = f" ({r.note})" if r.note else ""
        lines.append(f"  {index}. {r.action}: {_ms(r.step_s)}, {r.gain:.2f}x{note}")
    return "\n".join(lines)


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _level(level: int) -> str:
    return "px.DataParallel" if level == 0 else f"px.Sharded(level={level})"


def _short(level: int) -> str:
    return "px.DataParallel" if level == 0 else f"level {level}"


def _memory(memory: MemoryReport | None) -> str:
    if memory is None:
        return "Memory: not counted (the script stepped no optimizer after a px.DataParallel forward)."
    m = memory.measured
    where = ", units in host shared memory (a worker's share counted)" if m.shared else ""
    copies = ("copies (elastic)" if m.elastic else "copies if elastic",
              "a whole copy of the weights and the optimizer state" if m.level == 0 else
              "two slots of this worker's chunks in host shared memory" if m.one_host else
              "two slots of its chunks and two of its ward's: it is that worker's buddy on another host")
    lines = [f"Memory per worker, {_level(m.level)}{where}; tensor bytes, not resident memory, the largest rank's:"]
    rows = [("parameters", m.parameters, ""), ("gradients", m.gradients, f" ({_size(m.step_gradients)} at the step)"),
            ("optimizer state", m.optimizer_state, ""),
            *([("strategy's own", m.strategy, " (exchange buffers; DiLoCo's outer parameters, and once it has "
                                              "stepped its outer optimizer's state)")] if m.strategy else []),
            ("activations", m.activations, f" (saved for backward by a forward of {m.activation_samples} samples)"),
            (copies[0], m.copies, f" ({copies[1]})")]
    lines += [f"  {name:<20}{_size(value):>11}  {m.per_parameter(value):6.2f} B/param{note}"
              for name, value, note in rows]
    lines.append(_memory_table(memory))
    return "\n".join(lines)


def _memory_table(memory: MemoryReport) -> str:
    m = memory.measured
    share = f"{100 * HOST_SHARE:.0f}% of the host's {_size(memory.host_memory)}" if memory.host_memory else \
        "the host's memory (unknown here)"
    lines = [f"Predicted per worker at the step (parameters, the step's gradients, optimizer state, activations"
             f"{', copies' if m.elastic else ''}); a level fits within {share} over the workers of a host:",
             f"  workers  per host  batch/worker{'px.DataParallel':>17}{'level 1':>11}{'level 2':>11}{'level 3':>11}"
             f"{'budget':>11}  lowest fitting"]
    for row in memory.rows:
        needs = "".join(f"{_size(need.at_step):>{17 if need.level == 0 else 11}}" for need in row.levels)
        fitting = "-" if row.budget is None else "none" if row.lowest_fitting is None else _short(row.lowest_fitting)
        lines.append(f"  {row.layout.world_size:>7}  {row.layout.workers_per_host:>8}  {row.local_batch:>12.4g}"
                     f"{needs}{_size(row.budget):>11}  {fitting}")
    measured = next((row for row in memory.rows if row.layout == memory.measured_layout), None)
    if measured is not None:
        lines.append(f"  between steps at {measured.layout.world_size} worker(s), B/param (benchmarks/bench_shard.py's "
                     "'held after a step'): " + ", ".join(f"{_short(need.level)} {m.per_parameter(need.held):.2f}"
                                                          for need in measured.levels))
    lines.append(_memory_advice(memory))
    return "\n".join(lines)


def _memory_advice(memory: MemoryReport) -> str:
    if memory.host_memory is None:
        return "  recommended: nothing (the host's memory could not be read)"
    workers = memory.measured_layout.world_size
    level = memory.recommended_level
    if level is not None:
        run = "as this run" if level == memory.measured.level else f"this run: {_level(memory.measured.level)}"
        return f"  recommended at {workers} worker(s): {_level(level)}, the lowest level that fits ({run})"
    fitting = [(row.layout, fits) for row in memory.rows
               if (fits := row.lowest_fitting) is not None and row.layout.world_size > workers]
    more = (f"; {_level(fitting[0][1])} fits from {fitting[0][0].world_size} workers "
            f"({fitting[0][0].workers_per_host} a host)") if fitting else ""
    return (f"  recommended at {workers} worker(s): no level fits{more}; a smaller batch per worker needs fewer "
            "activations")
