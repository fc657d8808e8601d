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
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
import time
from typing import IO, Any, Iterator

from phalanx.cli.config import LaunchConfig, WorkerSpec, job_id
from phalanx.cli.network import DEFAULT_STORE_TIMEOUT_S, POLL_INTERVAL_S, JobBoard, connect_store, host_store
from phalanx.cli.workers import LaunchResult, OutputRelay, Worker, WorkerFailure, describe_exit
from phalanx.comm import shm

BOARD_POLL_S = 0.25
OUTPUT_DRAIN_S = 3.0


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
        self.board: JobBoard | None = None
        self._exits: queue.Queue[Worker] = queue.Queue()
        self._exits_handled = 0
        self._stop_signals: list[int] = []
        self._terminated = False
        self._aborting = False
        self._next_board_poll = 0.0

    def run(self) -> LaunchResult:
        """Launch, supervise to the end, and say how it ended. Never leaves a worker running."""
        with self._stop_signals_handled(), self._rendezvous() as master_port:
            try:
                self.start_workers(master_port)
                result = self.watch()
            finally:
                self.terminate_all()
                shm.remove_job_segments(job_id())  # a worker killed before its segment was unlinked
                self.leave_job()
        return result

    def start_workers(self, master_port: int) -> None:
        """Start one worker per local spec, then this host's parameter servers (``--servers``)."""
        for spec in self.config.worker_specs(master_port):
            self.start_worker(spec)
        for spec in self.config.server_specs(master_port):
            Supervisor.start_worker(self, spec)  # a server is never an elastic member

    def start_worker(self, spec: WorkerSpec) -> Worker:
        """Start one worker and watch it; it joins :attr:`workers` only once its process exists."""
        worker = Worker(spec)
        worker.start(self.relay, self._exits.put)
        self.workers.append(worker)
        return worker

    def watch(self) -> LaunchResult:
        """Block until the launch is decided: all workers done, one failed, or a stop signal arrived."""
        while True:
            if self._stop_signals:
                return self._stopped_by_signal(self._stop_signals[0])
            try:
                worker = self._exits.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                result = self.on_tick()
                if result is not None:
                    return result
                continue
            self._exits_handled += 1
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
        running = sum(w.running for w in self.workers)
        self._aborting = True
        self.terminate_all()
        return LaunchResult(exit_code=int(failure.get("exit_code", 1)), message=(
            f"phalanx run: worker rank {failure.get('rank')} on node {failure.get('node')} failed with "
            f"{describe_exit(int(failure.get('exit_code', 1)))}; stopped the {running} running worker(s) here. "
            "Its launcher's output names the cause."))

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
        if worker.spec.server is not None:  # its workers' channels broke: let them say so before stopping them
            self._wait_all_exited(time.monotonic() + self.config.grace_s)
        others = sum(w.running for w in self.workers)
        if self.board is not None:  # the other hosts stop their workers too
            self._aborting = True
            with contextlib.suppress(RuntimeError, OSError):
                self.board.post_failure(self.config.node_rank, worker.rank, worker.exit_code or 1)
        self.terminate_all()  # the tail is complete only once the worker's stderr reached EOF
        assert worker.exit_code is not None
        failure = WorkerFailure(worker.rank, worker.pid, worker.exit_code, tuple(worker.stderr_tail), others,
                                worker.name)
        return LaunchResult(exit_code=worker.exit_code, failure=failure)

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
        if config.hosts_store:
            self.store = host_store(config.master_addr, config.master_port, config.timeout_s)
        elif config.max_nodes > 1 or config.elastic:
            self.store = connect_store(config.master_addr, config.master_port, config.timeout_s)
        if self.store is not None and (config.max_nodes > 1 or config.elastic):
            self.board = JobBoard(self.store)
            self.board.join()
        try:
            yield self.store.port if config.hosts_store else config.master_port
        finally:
            self.board = None
            self.store = None

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

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self._stop_signals.append(signum)  # only a list append: safe whatever the main thread holds


def _stop_signals() -> list[int]:
    """The signals that stop a launch. SIGHUP is left alone when ignored (under ``nohup``)."""
    signals = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    return signals
