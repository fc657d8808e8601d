"""The elastic policy of ``phalanx run`` (``--min-workers K``, ``--nnodes MIN:MAX``).

A worker that dies is *lost*, not fatal: the launcher reports it to the coordinator (through the
store) and lets the survivors re-form the group without it. The launcher of node 0 runs the
coordinator (:mod:`phalanx.cli.coordinator`) beside the store. Every launcher kills its
workers that the coordinator declared dead (a frozen process must not come back as a zombie
member), and stops when the job fell below ``--min-workers``. Nothing is restarted: a lost
worker stays lost; the job grows only by the workers of a launcher started later with the next
node rank (``--nnodes MIN:MAX``), which join at a step boundary.

Exit status: 0 when the job completed (lost workers are listed); 1 when it fell below
``--min-workers``; otherwise, when every worker of this host was lost, the first one's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
from typing import IO

from phalanx.cli.config import LaunchConfig, WorkerSpec
from phalanx.cli.coordinator import Coordinator, CoordinatorConfig
from phalanx.cli.launcher import TAIL_WAIT_S, Supervisor
from phalanx.cli.network import DEFAULT_STORE_TIMEOUT_S, POLL_INTERVAL_S
from phalanx.cli.workers import LaunchResult, Worker, WorkerFailure, describe_exit, error_line
from phalanx.comm.connections import own_connection
from phalanx.comm.environment import MEMBER_ENV
from phalanx.comm.membership import START_TIMEOUT_S, Keys, Statements

MEMBER_COUNTER = Keys.PREFIX + "next_member"
STOP_WAIT_S = 60.0  # after the job failed: how long survivors get to save a checkpoint and exit
LAUNCHERS_WAIT_S = 2.0  # node 0, once no member runs: how long other launchers get to finish


class ElasticSupervisor(Supervisor):
    """A :class:`Supervisor` whose workers may be lost without ending the job."""

    def __init__(self, config: LaunchConfig, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        super().__init__(config, stdout, stderr)
        self.coordinator = None
        self.members: dict[Worker, int] = {}
        self.lost: list[Worker] = []
        self.job_failure: str | None = None
        self._killed: dict[int, str] = {}
        self._statements: Statements | None = None  # what the coordinator stated, read with the job's secret
        self._stop_deadline: float | None = None
        self._final: LaunchResult | None = None

    def run(self) -> LaunchResult:
        """As :meth:`Supervisor.run`; node 0 decides its result only once the job ended on every host."""
        result = super().run()
        return self._final if self._final is not None and result.stop_signal is None else result

    # --- starting ---------------------------------------------------------------------------

    def start_workers(self, master_port: int) -> None:
        if self.config.hosts_store:
            config = self.config
            self.coordinator = Coordinator(own_connection(self.store), self.secret, CoordinatorConfig(
                min_workers=config.min_world_size, max_workers=config.world_size,
                heartbeat_timeout_s=config.effective_heartbeat_timeout_s,
                rendezvous_timeout_s=config.timeout_s or DEFAULT_STORE_TIMEOUT_S,
                start_timeout_s=max(config.timeout_s or DEFAULT_STORE_TIMEOUT_S, START_TIMEOUT_S)), log=self._say)
            self.coordinator.start()
        super().start_workers(master_port)

    def prepared(self, spec: WorkerSpec) -> WorkerSpec:
        """``spec`` with a member id of its own, announced to the coordinator. Every worker of this host
        is announced before any starts, so generation 0 waits for all of them (a forked worker's
        request reached the coordinator before its sibling was announced, and the job formed without it)."""
        member = int(self.store.add(MEMBER_COUNTER, 1))
        self._post({"type": "spawn", "member": member, "node": spec.node_rank, "local_rank": spec.local_rank,
                    "label": str(spec.rank)})
        return dataclasses.replace(spec, variables={**spec.variables, MEMBER_ENV: str(member)})

    def start_worker(self, spec: WorkerSpec) -> Worker:
        """Start a :meth:`prepared` worker and remember its member id."""
        worker = super().start_worker(spec)
        self.members[worker] = int(spec.variables[MEMBER_ENV])
        return worker

    # --- the policy -------------------------------------------------------------------------

    def on_worker_exit(self, worker: Worker) -> LaunchResult | None:
        """A lost worker is reported, not fatal; the launch ends when no local worker runs.

        A parameter server holds part of the model: its failure ends the job as without --min-workers.
        """
        code = worker.exit_code
        assert code is not None
        if worker.spec.server is not None:
            if code != 0:
                return self._failed(worker)
            return self._result() if self.all_exits_handled() else None
        self._post({"type": "exit", "member": self.members[worker], "code": code, "time": time.time()})
        if code == 0:
            with contextlib.suppress(RuntimeError, OSError):
                self.store.set(Keys.COMPLETED, self.secret.seal(Keys.COMPLETED, "1"))
        else:
            worker.signal_group(signal.SIGKILL)  # its children too, while its group id cannot be reused
            self._refresh_job_failure()
            if self.job_failure is None:  # once the job failed, the survivors' exits are not losses
                self.lost.append(worker)
                self._report_lost(worker)
        # Every exit reported to the coordinator first: one left unread would keep its member
        # "starting", and node 0's launcher waiting for it, until the start timeout.
        return self._result() if self.all_exits_handled() else None

    def on_tick(self) -> LaunchResult | None:
        """Kill workers the coordinator declared dead; notice when the job fell below its minimum."""
        now = time.monotonic()
        if now < self._next_board_poll:
            return None
        self._next_board_poll = now + POLL_INTERVAL_S
        with contextlib.suppress(RuntimeError, OSError):
            self._kill_declared_dead()
        self._refresh_job_failure()
        if self._stop_deadline is not None and now > self._stop_deadline:
            self.terminate_all()
            return self._result()
        return None

    def leave_job(self) -> None:
        """Node 0 keeps the store and the coordinator up while members elsewhere still run.

        Once none does, other launchers get a moment to read the job's outcome; a launcher cut
        off from node 0 (its members declared dead) is not waited for.
        """
        if self.coordinator is None or self.board is None:
            super().leave_job()
            return
        while self.coordinator.busy() and not self._stop_signals:
            time.sleep(POLL_INTERVAL_S)
        if not self._stop_signals:
            self._refresh_job_failure()
            self._final = self._result()
        with contextlib.suppress(RuntimeError, OSError):
            self.board.leave()
        self.board.wait_for_others(time.monotonic() + LAUNCHERS_WAIT_S, lambda: bool(self._stop_signals))
        self.coordinator.stop()

    def failure_candidates(self) -> list[Worker]:
        """Lost workers were reported when lost: only a parameter server's failure ends the launch."""
        return [worker for worker in self.workers if worker not in self.lost]

    def _signal_all(self, signum: int) -> None:
        """Only workers still running: a lost worker's group was killed when it exited."""
        for worker in self.workers:
            if worker.running:
                worker.signal_group(signum)

    def _refresh_job_failure(self) -> None:
        """Read whether the coordinator stopped the job (below --min-workers), or itself failed."""
        if self.job_failure is not None:
            return
        if self.coordinator is not None and self.coordinator.failure is not None:
            self.job_failure = self.coordinator.failure  # nobody forms generations any more: stop now
            self._stop_deadline = time.monotonic()
            return
        with contextlib.suppress(RuntimeError, OSError):
            status = self._sealed(Keys.STATUS)
            if status is not None:
                self.job_failure = status.removeprefix("failed: ")
                self._stop_deadline = time.monotonic() + STOP_WAIT_S

    def _kill_declared_dead(self) -> None:
        for worker in self.workers:
            member = self.members.get(worker)
            if member is None or not worker.running or member in self._killed:
                continue
            why = self._sealed(Keys.kill(member))
            if why is not None:
                self._killed[member] = why
                worker.signal_group(signal.SIGKILL)
                self._say(f"phalanx run: killed worker rank {worker.rank} (pid {worker.pid}): {why}.")

    def _sealed(self, key: str) -> str | None:
        """The coordinator's value at ``key``: None while absent, or when it does not carry the job's
        secret (someone else wrote it: warned once, ignored)."""
        if self._statements is None or self._statements.store is not self.store:
            self._statements = Statements(self.store, self.secret, share=True, on_forged=lambda forged: self._say(
                f"phalanx run: warning: ignored {forged} in the store: it does not carry the job's secret."))
        return self._statements.read(key)

    def _report_lost(self, worker: Worker) -> None:
        """Show its traceback (held back until now), then one line: how it ended, with what error."""
        worker.join_output(time.monotonic() + TAIL_WAIT_S)
        worker.show_held()
        why = self._killed.get(self.members[worker])
        error = error_line(worker.stderr_tail, worker.exit_code or 0)
        how = describe_exit(worker.exit_code or 0) + (f" ({why})" if why else "") + (f": {error}" if error else "")
        self._say(f"phalanx run: worker rank {worker.rank} (pid {worker.pid}) was lost: {how}; the elastic job goes "
                  f"on without it while at least {self.config.min_world_size} worker(s) remain.")

    def _result(self) -> LaunchResult:
        lost = "; ".join(f"rank {w.rank} (pid {w.pid}) {describe_exit(w.exit_code or 0)}" for w in self.lost)
        if self.job_failure is not None:
            return LaunchResult(exit_code=1, message=(
                f"phalanx run: error: the elastic job stopped: {self.job_failure}."
                + (f" Lost here: {lost}." if lost else "")))
        if any(w.exit_code == 0 for w in self.workers) or self._completed_elsewhere():
            return LaunchResult(exit_code=0, message=(
                f"phalanx run: the elastic job completed; worker(s) lost on the way: {lost}." if lost else None))
        if not self.lost:  # stopped before any exit was handled
            return LaunchResult(exit_code=next((w.exit_code for w in self.workers if w.exit_code), 1))
        first = self.lost[0]
        return LaunchResult(exit_code=first.exit_code or 1, failure=WorkerFailure(
            first.rank, first.pid, first.exit_code or 1, tuple(first.stderr_tail),
            label=first.label if self.config.prefix_output else ""))

    def _completed_elsewhere(self) -> bool:
        try:
            return self._sealed(Keys.COMPLETED) is not None  # an outsider's value does not complete the job
        except (RuntimeError, OSError):
            return False

    def _post(self, message: dict) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.store.queue_push(Keys.INBOX, self.secret.seal(Keys.INBOX, json.dumps(message)))

