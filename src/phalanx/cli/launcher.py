"""The process supervisor behind ``phalanx run``: start local workers, relay their output, stop them together.

The launcher hosts the rendezvous store itself (a ``torch.distributed.TCPStore``), so the store
outlives every worker, rank 0 included. Each worker runs in its own session (process group), is
killed by the kernel if the launcher dies (``PR_SET_PDEATHSIG`` on Linux), and is stopped as a
whole group: SIGTERM first, SIGKILL after a grace period. No worker outlives the launcher.

Multi-host jobs run one launcher per host (``--nnodes M --node-rank I``): node 0's hosts the
store, the others connect to it, and the launchers tell each other through the store when one
of them saw a worker fail (see :class:`phalanx.cli.network.JobBoard`), so every host stops its
workers. Elastic jobs
(``--min-workers``, ``--nnodes MIN:MAX``) use :class:`phalanx.cli.elastic.ElasticSupervisor`,
which overrides the exit policy. This module imports nothing from phalanx's training layers.

When workers fail, often together, the launcher reports the first to fail: the first to print a
traceback (or, printing none, to exit with an error), not the first to exit. Tracebacks are held
back from the terminal until then (:class:`phalanx.cli.workers.HeldTraceback`): the first
failure's is shown once, and every other worker's reason to stop takes one line of the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
from typing import IO, Any, Iterator, Sequence

from phalanx.cli import secret as job_secret
from phalanx.cli.config import LaunchConfig, WorkerSpec, job_id
from phalanx.cli.forkserver import ForkServer
from phalanx.cli.network import (DEFAULT_STORE_TIMEOUT_S, POLL_INTERVAL_S, JobBoard, bind_store, connect_store,
                                 host_store)
from phalanx.cli.workers import (
    HOLD_S,
    LaunchResult,
    OutputRelay,
    Worker,
    WorkerFailure,
    compact_labels,
    describe_exit,
    error_line,
)
from phalanx.comm import auth
from phalanx.comm.auth import SECRET_ENV

BOARD_POLL_S = 0.25
OUTPUT_DRAIN_S = 3.0
TAIL_WAIT_S = 0.5  # for the last lines of an exited worker's traceback to come through the pipe


# --------------------------------------------------------------------------------------------
# The supervisor
# --------------------------------------------------------------------------------------------


class Supervisor:
    """Runs one launch: hosts the store, starts the workers, watches them, stops them together.

    The decision taken when a worker exits lives in :meth:`on_worker_exit`; the elastic
    supervisor overrides it to carry on without the lost worker (no worker is ever restarted).
    """

    def __init__(self, config: LaunchConfig, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        config.validate()
        self.config = config
        self.relay = OutputRelay(stdout or sys.stdout, stderr or sys.stderr, config.prefix_output)
        self.workers: list[Worker] = []
        self.store: Any = None
        self.secret = auth.JobSecret.generate()  # replaced by the job's when the launch meets the others
        self.board: JobBoard | None = None
        self._exits: queue.Queue[Worker] = queue.Queue()
        self._exits_handled = 0
        self._stop_signals: list[int] = []
        self._terminated = False
        self._aborting = False
        self._next_board_poll = 0.0
        # Started first, while the launcher runs one thread: it forks the server from itself.
        self.forks = ForkServer(WorkerSpec.shared_environment(os.environ)) if config.fork_server else None

    def run(self) -> LaunchResult:
        """Launch, supervise to the end, and say how it ended. Never leaves a worker running."""
        if self.forks is not None:
            self.forks.start()
        try:
            with self._stop_signals_handled(), self._rendezvous() as master_port:
                try:
                    self.start_workers(master_port)
                    result = self.watch()
                finally:
                    from phalanx.comm.shm import remove_job_segments  # with torch, loaded once the workers run

                    self.terminate_all()
                    remove_job_segments(job_id())  # a worker killed before its segment was unlinked
                    self.leave_job()
                    for worker in self.workers:  # nothing held back is lost: what was not summed up shows now
                        worker.show_held()
        finally:  # also when the launch failed before any worker (a rendezvous refused, say)
            if self.forks is not None:
                self.forks.close()
        return result

    def start_workers(self, master_port: int) -> None:
        """Start one worker per local spec, then this host's parameter servers (``--servers``).
        Every spec is :meth:`prepared` before any worker starts."""
        for spec in [self.prepared(spec) for spec in self.config.worker_specs(master_port)]:
            self.start_worker(spec)
        for spec in self.config.server_specs(master_port):
            Supervisor.start_worker(self, spec)  # a server is never an elastic member

    def prepared(self, spec: WorkerSpec) -> WorkerSpec:
        """A worker's spec as it will start (the elastic supervisor gives each a member id)."""
        return spec

    def start_worker(self, spec: WorkerSpec) -> Worker:
        """Start one worker and watch it; it joins :attr:`workers` only once its process exists.
        The job's secret reaches it through its environment."""
        worker = Worker(dataclasses.replace(spec, variables={**spec.variables, SECRET_ENV: self.secret.hex()}))
        worker.start(self.relay, self._exits.put, self.forks)
        self.workers.append(worker)
        return worker

    def watch(self) -> LaunchResult:
        """Block until the launch is decided: all workers done, one failed, or a stop signal arrived."""
        while True:
            if self._stop_signals:
                return self._stopped_by_signal(self._stop_signals[0])
            self._show_stale_tracebacks()
            try:
                worker = self._exits.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                result = self.on_tick()
                if result is not None:
                    return result
                continue
            self._exits_handled += 1
            if worker.exit_code == 0:  # a traceback it printed was an error it handled
                worker.show_held()
            result = self.on_worker_exit(worker)
            if result is not None:
                return result

    def all_exits_handled(self) -> bool:
        """Whether :meth:`on_worker_exit` has been called for every worker. Not the same as none
        running: a worker is reaped moments before its exit reaches the queue."""
        return self._exits_handled == len(self.workers)

    def on_tick(self) -> LaunchResult | None:
        """Called between exits: in a multi-host job, stop when another host's worker failed."""
        if self.board is None or time.monotonic() < self._next_board_poll:
            return None
        self._next_board_poll = time.monotonic() + BOARD_POLL_S
        failure = self.board.failure()
        if failure is None:
            return None
        running = {w for w in self.workers if w.running}
        self._aborting = True
        self.terminate_all()
        lines = [f"phalanx run: worker rank {failure.get('rank')} on node {failure.get('node')} failed with "
                 f"{describe_exit(int(failure.get('exit_code', 1)))}; stopped the {len(running)} running worker(s) "
                 "here. Its launcher's output names the cause. Why the workers here stopped:",
                 *(f"  {line}" for line in why_stopped(self.workers, running))]
        return LaunchResult(exit_code=int(failure.get("exit_code", 1)), message="\n".join(lines))

    def leave_job(self) -> None:
        """Multi-host: tell the other launchers this one is done; node 0 keeps the store up until all are."""
        if self.board is None:
            return
        with contextlib.suppress(RuntimeError, OSError):
            self.board.leave()
        if self.config.hosts_store:
            limit = self.config.grace_s + 10.0 if self._aborting else (self.config.timeout_s or DEFAULT_STORE_TIMEOUT_S)
            self.board.wait_for_others(time.monotonic() + limit, lambda: bool(self._stop_signals))

    def on_worker_exit(self, worker: Worker) -> LaunchResult | None:
        """The policy: the first failure ends the launch; success once every worker exited with 0."""
        if worker.exit_code != 0:
            return self._failed(worker)
        if all(w.exit_code == 0 for w in self.workers):
            return LaunchResult(exit_code=0)
        return None

    def terminate_all(self) -> None:
        """Stop every worker's process group: SIGTERM, then SIGKILL after the grace period; drain output.

        Does nothing to the processes when every worker already exited with 0. Safe to call twice.
        """
        if self._terminated:
            return
        self._terminated = True
        if any(w.exit_code != 0 for w in self.workers):
            self._signal_all(signal.SIGTERM)
            self._wait_all_exited(time.monotonic() + self.config.grace_s)
            self._signal_all(signal.SIGKILL)
            self._wait_all_exited(time.monotonic() + self.config.grace_s + 5.0)
        deadline = time.monotonic() + OUTPUT_DRAIN_S
        for worker in self.workers:
            worker.join_output(deadline)

    def _signal_all(self, signum: int) -> None:
        for worker in self.workers:
            worker.signal_group(signum)

    def _wait_all_exited(self, deadline: float) -> None:
        """Wait for every worker until ``deadline``; a further stop signal (a second Ctrl-C) cuts it short."""
        signals_seen = len(self._stop_signals)
        for worker in self.workers:
            while not worker.exited.wait(POLL_INTERVAL_S):
                if time.monotonic() >= deadline or len(self._stop_signals) > signals_seen:
                    return

    def _failed(self, worker: Worker) -> LaunchResult:
        """The launch failed: show the first failure's traceback, stop everyone, sum up why each stopped."""
        if worker.spec.server is not None:  # its workers' channels broke: let them say so before stopping them
            self._wait_all_exited(time.monotonic() + self.config.grace_s)
        first = self._first_failure()
        if first.held.since is not None and not first.running:  # the last lines of its traceback
            first.join_output(time.monotonic() + TAIL_WAIT_S)
        first.show_held()
        running = {w for w in self.workers if w.running}
        self._tell_other_hosts(first)
        self.terminate_all()  # the tail is complete only once the worker's stderr reached EOF
        assert first.exit_code is not None
        others = why_stopped([w for w in self.workers if w is not first], running, first.stderr_tail)
        failure = WorkerFailure(first.rank, first.pid, first.exit_code, tuple(first.stderr_tail), others,
                                first.name, first.label if self.config.prefix_output else "")
        return LaunchResult(exit_code=first.exit_code, failure=failure)

    def _first_failure(self) -> Worker:
        """The worker that began to fail first: the earliest traceback or exit with an error.

        Workers often fail together (the same error on every rank, or a peer's death seen from the
        other side), and the cause may exit last. One still running behind its traceback gets until
        the traceback is :data:`HOLD_S` old to exit; by then it handled the error and is not failing.
        A process killed with SIGKILL is a cause, never a consequence: its peers' errors about the
        broken connection can reach the launcher before it reaps the dead one (on a busy host), so
        it comes first when it was reaped within :data:`HOLD_S` of the earliest failure. (Other
        signals may be consequences: a process aborting on a peer's broken connection.)
        """
        while True:
            failing = [w for w in self.failure_candidates() if w.failing_since is not None]
            first = min(failing, key=lambda w: w.failing_since or 0.0)
            killed = [w for w in failing if w.killed and
                      (w.failing_since or 0.0) <= (first.failing_since or 0.0) + HOLD_S]
            if killed:
                return min(killed, key=lambda w: w.failing_since or 0.0)
            if not first.running:
                return first
            if time.monotonic() > (first.failing_since or 0.0) + HOLD_S:
                first.show_held()  # no longer a candidate
            else:
                first.exited.wait(POLL_INTERVAL_S)

    def _tell_other_hosts(self, failed: Worker) -> None:
        """Multi-host: post the failure, so that the other hosts' launchers stop their workers too."""
        if self.board is None:
            return
        self._aborting = True
        with contextlib.suppress(RuntimeError, OSError):
            self.board.post_failure(self.config.node_rank, failed.rank, failed.exit_code or 1)

    def failure_candidates(self) -> list[Worker]:
        """The workers whose failure may be the one that ends the launch."""
        return self.workers

    def _show_stale_tracebacks(self) -> None:
        """Tracebacks held :data:`HOLD_S` while their workers run on: handled errors, shown now.

        A worker that has exited is judged by when it exited, not by when this loop looks (it may
        look late: the launcher loads PyTorch while the first workers already run)."""
        for worker in self.workers:
            since = worker.held.since
            if since is None:
                continue
            ran_on_until = time.monotonic() if worker.running else (worker.exited_at or 0.0)
            if ran_on_until > since + HOLD_S:
                worker.show_held()

    def _stopped_by_signal(self, signum: int) -> LaunchResult:
        running = sum(w.running for w in self.workers)
        self.terminate_all()
        return LaunchResult(exit_code=128 + signum, stop_signal=signum, workers_stopped=running)

    @contextlib.contextmanager
    def _rendezvous(self) -> Iterator[int]:
        """Host the store for the job's lifetime (node 0), and yield the port the workers meet on.

        Other hosts' launchers connect to node 0's store when they need to talk to the others
        (multi-host or elastic jobs).
        """
        config = self.config
        self.secret, saved = job_secret.resolve(config.hosts_store, config.max_nodes > 1, self._say)
        port = config.master_port
        if config.hosts_store:  # served before any worker starts, the job's name sealed into it
            listener = bind_store(config.master_addr, config.master_port)
            port = listener.getsockname()[1]
            self.store = host_store(config.master_addr, listener, config.timeout_s)
            job_secret.publish(self.store, self.secret, job_id())
        elif config.max_nodes > 1 or config.elastic:
            self.store = connect_store(config.master_addr, config.master_port, config.timeout_s)
            job_secret.prove(self.store, self.secret, config.node_rank, config.elastic)
        if self.store is not None and (config.max_nodes > 1 or config.elastic):
            self.board = JobBoard(self.store)
            self.board.join()
        try:
            yield port
        finally:
            self.board = None
            self.store = None
            if saved is not None:
                saved.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _stop_signals_handled(self) -> Iterator[None]:
        """Turn SIGINT/SIGTERM (and SIGHUP unless ignored) into a clean stop of every worker."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.getsignal(signum) for signum in _stop_signals()}
        for signum in previous:
            signal.signal(signum, self._on_stop_signal)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _say(self, message: str) -> None:
        """One line of the launcher's own on its stderr."""
        self.relay.write("stderr", (message + "\n").encode())

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self._stop_signals.append(signum)  # only a list append: safe whatever the main thread holds


def why_stopped(workers: list[Worker], stopped: set[Worker], first_tail: Sequence[str] = ()) -> tuple[str, ...]:
    """One line per reason workers stopped, naming them by their output prefix (``[0,2-5] ...``).

    Their tracebacks held back are dropped for the error they end with; ``first_tail`` is the
    first failure's stderr, whose error the others' may repeat.
    """
    first_error = error_line(first_tail)
    reasons: dict[str, list[str]] = {}
    for worker in workers:
        reasons.setdefault(_why(worker, worker in stopped, first_error), []).append(worker.label)
    return tuple(f"[{compact_labels(labels)}] {why}" for why, labels in reasons.items())


def _why(worker: Worker, stopped: bool, first_error: str) -> str:
    """Why one worker stopped: the error its traceback ended with, if any, and how it ended."""
    how = describe_exit(worker.exit_code) if worker.exit_code is not None else "still running"
    error = worker.withhold()
    error = "the same error" if error and error == first_error else error
    if stopped:
        return f"stopped by the launcher: {how}" + (f", after {error}" if error else "")
    return f"{how}: {error}" if error else f"had already ended: {how}"


def _stop_signals() -> list[int]:
    """The signals that stop a launch. SIGHUP is left alone when ignored (under ``nohup``)."""
    signals = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    return signals
