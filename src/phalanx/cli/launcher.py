"""The process supervisor behind ``phalanx run``: start local workers, relay their output, stop them together.

The launcher hosts the rendezvous store itself (a ``torch.distributed.TCPStore``), so the store
outlives every worker, rank 0 included. Each worker runs in its own session (process group), is
killed by the kernel if the launcher dies (``PR_SET_PDEATHSIG`` on Linux), and is stopped as a
whole group: SIGTERM first, SIGKILL after a grace period. No worker outlives the launcher.

Multi-host jobs run one launcher per host (``--nnodes M --node-rank I``): node 0's hosts the
store, the others connect to it, and the launchers tell each other through the store when one
of them saw a worker fail (see :class:`JobBoard`), so every host stops its workers. Elastic jobs
(``--min-workers``, ``--nnodes MIN:MAX``) use :class:`phalanx.cli.elastic.ElasticSupervisor`,
which overrides the exit policy. This module imports nothing from phalanx's training layers.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import errno
import importlib.util
import ipaddress
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Deque, Iterator, Mapping, Sequence

from phalanx.comm.membership import ELASTIC_ENV
from phalanx.errors import ConfigurationError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_GRACE_S = 5.0
DEFAULT_STORE_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
STDERR_TAIL_LINES = 40
POLL_INTERVAL_S = 0.1
BOARD_POLL_S = 0.25
OUTPUT_DRAIN_S = 3.0
MAX_PENDING_LINE = 1 << 16
_PR_SET_PDEATHSIG = 1
_LINE_END = re.compile(rb"\r\n|\n|\r")


# --------------------------------------------------------------------------------------------
# What to launch
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker: its place in the job, its command, its variables.

    ``variables`` holds only what the launcher adds; :meth:`environment` layers it on top of the
    launcher's own environment, so a restarted worker gets exactly the same setup.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    command: tuple[str, ...]
    variables: Mapping[str, str] = field(default_factory=dict)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The worker's full environment: ``base`` plus the launcher's variables.

        ``OMP_NUM_THREADS`` defaults to 1 so N workers do not oversubscribe the host's cores.
        """
        env = dict(base)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.variables)
        return env


@dataclass(frozen=True)
class LaunchConfig:
    """What ``phalanx run`` was asked to do. Validated by :meth:`validate` before anything starts.

    ``nnodes`` and ``node_rank`` describe a multi-host job: one launcher per host, each starting
    ``nproc_per_node`` workers. The job is *elastic* when ``min_workers`` or ``max_nnodes`` is set
    (``--min-workers K``, ``--nnodes MIN:MAX``): it survives lost workers while at least
    ``min_workers`` remain, and admits workers started later, up to ``nproc_per_node * max_nnodes``.
    """

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    timeout_s: float | None = None
    grace_s: float = DEFAULT_GRACE_S
    prefix_output: bool = True
    max_nnodes: int | None = None
    min_workers: int | None = None
    heartbeat_timeout_s: float | None = None

    @property
    def elastic(self) -> bool:
        """Whether lost workers are survived and new ones admitted (``--min-workers``, ``--nnodes MIN:MAX``)."""
        return self.min_workers is not None or self.max_nnodes is not None

    @property
    def max_nodes(self) -> int:
        return self.max_nnodes if self.max_nnodes is not None else self.nnodes

    @property
    def world_size(self) -> int:
        """The number of workers in the whole job, over all hosts (elastic: at most)."""
        return self.nproc_per_node * self.max_nodes

    @property
    def min_world_size(self) -> int:
        """The fewest workers an elastic job goes on with."""
        return self.min_workers if self.min_workers is not None else self.nproc_per_node * self.nnodes

    @property
    def effective_heartbeat_timeout_s(self) -> float:
        """How long an elastic worker may stay silent before it is declared dead and killed."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return min(0.5 * (self.timeout_s or DEFAULT_STORE_TIMEOUT_S), DEFAULT_HEARTBEAT_TIMEOUT_S)

    @property
    def hosts_store(self) -> bool:
        """Whether this launcher hosts the rendezvous store (the launcher of node 0 does)."""
        return self.node_rank == 0

    def validate(self) -> None:
        """Raise :class:`ConfigurationError`, naming the fix, if this launch cannot work."""
        self._validate_counts()
        self._validate_network()
        self._validate_target()

    def command(self) -> tuple[str, ...]:
        """The command every worker runs: this Python interpreter on the script or module."""
        if self.is_module:
            return (sys.executable, "-m", self.target, *self.args)
        return (sys.executable, self.target, *self.args)

    def worker_specs(self, master_port: int) -> list[WorkerSpec]:
        """One spec per local worker; global ranks follow ``node_rank * nproc_per_node + local_rank``."""
        return [self._worker_spec(local_rank, master_port) for local_rank in range(self.nproc_per_node)]

    def _worker_spec(self, local_rank: int, master_port: int) -> WorkerSpec:
        rank = self.node_rank * self.nproc_per_node + local_rank
        return WorkerSpec(
            rank=rank,
            local_rank=local_rank,
            world_size=self.world_size,
            local_world_size=self.nproc_per_node,
            node_rank=self.node_rank,
            command=self.command(),
            variables=self._worker_variables(rank, local_rank, master_port),
        )

    def _worker_variables(self, rank: int, local_rank: int, master_port: int) -> dict[str, str]:
        """The phalanx variables, plus torch's ``env://`` ones so plain torch.distributed code works."""
        layout = {"RANK": rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": local_rank,
                  "LOCAL_WORLD_SIZE": self.nproc_per_node}
        variables = {key: str(value) for key, value in layout.items()}
        variables.update({f"PHALANX_{key}": value for key, value in variables.items()})
        variables.update(PHALANX_NODE_RANK=str(self.node_rank), PHALANX_STORE_HOSTED="1",
                         MASTER_ADDR=self.master_addr, MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1",
                         PHALANX_INTERACTIVE="1" if sys.stdout.isatty() else "0")
        if self.timeout_s is not None:
            variables["PHALANX_TIMEOUT"] = f"{self.timeout_s:g}"
        if self.elastic:
            variables[ELASTIC_ENV] = "1"
        if not is_loopback(self.master_addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = interface_towards(self.master_addr)
            if interface:  # Gloo would otherwise pick the address the host name resolves to
                variables["GLOO_SOCKET_IFNAME"] = interface
        return variables

    def _validate_counts(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigurationError(
                f"-n must be at least 1, got {self.nproc_per_node}: pass how many worker processes "
                "to start, for example `phalanx run -n 4 train.py`."
            )
        if self.nnodes < 1 or self.max_nodes < self.nnodes:
            raise ConfigurationError(
                f"--nnodes {self.nnodes}:{self.max_nodes} is not a valid range: pass N, or MIN:MAX with 1 <= MIN <= MAX."
            )
        if not 0 <= self.node_rank < self.max_nodes:
            raise ConfigurationError(
                f"node rank {self.node_rank} is not within {self.max_nodes} nodes: "
                "pass a node rank from 0 to nnodes - 1."
            )
        if self.min_workers is not None and not 1 <= self.min_workers <= self.world_size:
            raise ConfigurationError(
                f"--min-workers must be between 1 and the job's {self.world_size} workers, got {self.min_workers}."
            )
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s <= 0:
            raise ConfigurationError(
                f"--heartbeat-timeout must be a positive number of seconds, got {self.heartbeat_timeout_s:g}."
            )
        if self.grace_s < 0:
            raise ConfigurationError(f"--grace must be 0 or more seconds, got {self.grace_s:g}.")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigurationError(f"--timeout must be a positive number of seconds, got {self.timeout_s:g}.")

    def _validate_network(self) -> None:
        if not 0 <= self.master_port <= 65535:
            raise ConfigurationError(
                f"--master-port must be within 0-65535, got {self.master_port}; 0 picks a free port."
            )
        if not self.master_addr:
            raise ConfigurationError("--master-addr is empty: pass the address of the host running node 0.")
        if self.max_nodes > 1 and self.master_port == 0:
            raise ConfigurationError(
                "a multi-host launch needs --master-port: every host's launcher must be told the port of "
                "node 0's rendezvous store, for example --master-port 29500."
            )

    def _validate_target(self) -> None:
        if not self.target:
            raise ConfigurationError(
                "nothing to run: give a script (`phalanx run -n 2 train.py`) "
                "or a module (`phalanx run -n 2 -m package.module`)."
            )
        if self.is_module:
            _check_module(self.target)
        elif not os.path.exists(self.target):
            raise ConfigurationError(
                f"script {self.target!r} not found (from {os.getcwd()}): check the path, "
                "or pass -m to run a module by its dotted name."
            )


def _check_module(name: str) -> None:
    """Fail fast on a module the workers could not import; only the top-level package is looked up."""
    if name.endswith(".py") or os.sep in name:
        raise ConfigurationError(
            f"-m takes a dotted module name, not a file: got {name!r}. "
            f"Drop -m to run a script, or write it as `-m {_module_name_hint(name)}`."
        )
    if not _importable_from_cwd(name.split(".")[0]):
        raise ConfigurationError(
            f"module {name!r} not found: check the name, that its package is installed in "
            f"{sys.executable}, or that it is importable from {os.getcwd()} or $PYTHONPATH."
        )


def _importable_from_cwd(top_level: str) -> bool:
    """Whether ``python -m`` run here would find ``top_level`` (it searches the working directory first).

    Looking up a top-level name imports nothing, so the check has no side effects.
    """
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(top_level) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def _module_name_hint(path: str) -> str:
    stem = path[:-3] if path.endswith(".py") else path
    return stem.strip(os.sep).replace(os.sep, ".")


# --------------------------------------------------------------------------------------------
# How it ended
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerFailure:
    """The first worker that exited with an error, and the tail of what it wrote to stderr."""

    rank: int
    pid: int
    exit_code: int
    stderr_tail: tuple[str, ...]
    others_stopped: int

    def describe(self) -> str:
        """A summary for the launcher's stderr: who failed, how, and its traceback again."""
        head = (f"phalanx run: worker rank {self.rank} (pid {self.pid}) failed with {describe_exit(self.exit_code)}; "
                f"stopped the other {self.others_stopped} running worker(s).")
        if not self.stderr_tail:
            return f"{head}\nphalanx run: rank {self.rank} wrote nothing to stderr."
        tail = "\n".join(self.stderr_tail)
        return (f"{head}\n---- last {len(self.stderr_tail)} line(s) of rank {self.rank}'s stderr ----\n"
                f"{tail}\n---- end of rank {self.rank}'s stderr ----")


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: the launcher's exit code, and why when it is not 0."""

    exit_code: int
    failure: WorkerFailure | None = None
    stop_signal: int | None = None
    workers_stopped: int = 0
    message: str | None = None

    def describe(self) -> str | None:
        """A message for the launcher's stderr, or None when every worker succeeded."""
        if self.failure is not None:
            return self.failure.describe()
        if self.stop_signal is not None:
            return (f"phalanx run: received {signal.Signals(self.stop_signal).name}; "
                    f"stopped {self.workers_stopped} running worker(s).")
        return self.message


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: a process killed by signal N exits with 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(exit_code: int) -> str:
    """``exit code 3`` or ``signal SIGKILL (exit code 137)``."""
    if exit_code > 128:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(exit_code - 128).name} (exit code {exit_code})"
    return f"exit code {exit_code}"


# --------------------------------------------------------------------------------------------
# Output relay
# --------------------------------------------------------------------------------------------


class OutputRelay:
    """Copies workers' output to the launcher's stdout and stderr, whole lines at a time.

    One lock covers both streams, so no two lines ever mix on a terminal. Lines end at ``\\n`` or
    ``\\r``, so progress bars (which redraw with ``\\r``) stay live; each gets a ``[rank] `` prefix.
    """

    def __init__(self, stdout: IO[str], stderr: IO[str], prefix: bool = True):
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._prefix = prefix
        self._lock = threading.Lock()

    def start(self, rank: int, pipe: IO[bytes], stream: str, tail: Deque[str] | None = None) -> threading.Thread:
        """Relay ``pipe`` to ``stream`` on a daemon thread until EOF; remember lines in ``tail``."""
        thread = threading.Thread(target=self._pump, args=(rank, pipe, stream, tail),
                                  name=f"phalanx-relay-{rank}-{stream}", daemon=True)
        thread.start()
        return thread

    def _pump(self, rank: int, pipe: IO[bytes], stream: str, tail: Deque[str] | None) -> None:
        pending = b""
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(pipe.fileno(), 1 << 16):
                lines, pending = split_lines(pending + chunk)
                self._emit(rank, lines, stream, tail)
        if pending:
            self._emit(rank, [pending + b"\n"], stream, tail)
        with contextlib.suppress(OSError):
            pipe.close()

    def _emit(self, rank: int, lines: Sequence[bytes], stream: str, tail: Deque[str] | None) -> None:
        lines = [line for line in lines if line != b"\r"]  # a bare \r would only print an empty prefix
        if not lines:
            return
        if tail is not None:
            tail.extend(line.decode(errors="replace").rstrip("\r\n") for line in lines)
        prefix = f"[{rank}] ".encode() if self._prefix else b""
        self.write(stream, b"".join(prefix + line for line in lines))

    def write(self, stream: str, data: bytes) -> None:
        """Write bytes to one of the launcher's streams under the lock, and flush."""
        target = self._streams[stream]
        with self._lock, contextlib.suppress(OSError, ValueError):
            buffer = getattr(target, "buffer", None)
            if buffer is None:
                target.write(data.decode(errors="replace"))
            else:
                target.flush()
                buffer.write(data)
                buffer.flush()
            target.flush()


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Split into complete lines (terminator kept) and the unfinished rest.

    A trailing ``\\r`` is held back because a ``\\n`` may follow in the next chunk; a rest longer than
    64 KiB is released as a line so a worker that never writes a newline cannot fill memory.
    """
    lines, start = [], 0
    for match in _LINE_END.finditer(data):
        if match.end() == len(data) and match.group() == b"\r":
            break
        lines.append(data[start:match.end()])
        start = match.end()
    rest = data[start:]
    if len(rest) >= MAX_PENDING_LINE:
        lines.append(rest + b"\n")
        rest = b""
    return lines, rest


# --------------------------------------------------------------------------------------------
# One worker process
# --------------------------------------------------------------------------------------------


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, or None where it does not exist (then only group kills protect)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_launcher(launcher_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the kernel SIGKILL the child when the launcher dies, even by SIGKILL.

    Everything is prepared in the parent; the child only makes the call. If the launcher died
    before the call took effect, the child exits at once instead of running as an orphan.
    """
    prctl = _load_prctl()
    option, death_signal = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)

    def setup_child() -> None:
        if prctl is not None:
            prctl(option, death_signal)
        if os.getppid() != launcher_pid:
            os._exit(1)

    return setup_child


class Worker:
    """One worker process: its spec, its process group, its output relays and the tail of its stderr."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None
        self.stderr_tail: Deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.exited = threading.Event()
        self._relays: list[threading.Thread] = []

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    @property
    def running(self) -> bool:
        """Started and not yet reaped."""
        return self.process is not None and not self.exited.is_set()

    @property
    def exit_code(self) -> int | None:
        """The shell-style exit code once the worker has exited, else None."""
        if not self.exited.is_set() or self.process is None or self.process.returncode is None:
            return None
        return exit_code_of(self.process.returncode)

    def start(self, relay: OutputRelay, on_exit: Callable[[Worker], None]) -> None:
        """Start the process in its own session; relay its output; call ``on_exit`` from a thread when it ends."""
        self.process = subprocess.Popen(
            self.spec.command, env=self.spec.environment(os.environ), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_launcher(os.getpid()),
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self._relays = [relay.start(self.rank, self.process.stdout, "stdout"),
                        relay.start(self.rank, self.process.stderr, "stderr", self.stderr_tail)]
        threading.Thread(target=self._wait, args=(on_exit,), name=f"phalanx-wait-{self.rank}", daemon=True).start()

    def _wait(self, on_exit: Callable[[Worker], None]) -> None:
        assert self.process is not None
        self.process.wait()
        self.exited.set()
        on_exit(self)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group (its children too); ignore a gone group."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def join_output(self, deadline: float) -> None:
        """Wait, until ``deadline`` (monotonic), for the relays to copy the last of the output."""
        for thread in self._relays:
            thread.join(max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------------------------
# The supervisor
# --------------------------------------------------------------------------------------------


class Supervisor:
    """Runs one launch: hosts the store, starts the workers, watches them, stops them together.

    The decision taken when a worker exits lives in :meth:`on_worker_exit`; an elastic policy
    (restart, or carry on with fewer workers) replaces that one method.
    """

    def __init__(self, config: LaunchConfig, stdout: IO[str] | None = None, stderr: IO[str] | None = None):
        config.validate()
        self.config = config
        self.relay = OutputRelay(stdout or sys.stdout, stderr or sys.stderr, config.prefix_output)
        self.workers: list[Worker] = []
        self.store: Any = None
        self.board: JobBoard | None = None
        self._exits: queue.Queue[Worker] = queue.Queue()
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
                self.leave_job()
        return result

    def start_workers(self, master_port: int) -> None:
        """Start one worker per local spec."""
        for spec in self.config.worker_specs(master_port):
            self.start_worker(spec)

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
            result = self.on_worker_exit(worker)
            if result is not None:
                return result

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
        others = sum(w.running for w in self.workers)
        if self.board is not None:  # the other hosts stop their workers too
            self._aborting = True
            with contextlib.suppress(RuntimeError, OSError):
                self.board.post_failure(self.config.node_rank, worker.rank, worker.exit_code or 1)
        self.terminate_all()  # the tail is complete only once the worker's stderr reached EOF
        assert worker.exit_code is not None
        failure = WorkerFailure(worker.rank, worker.pid, worker.exit_code, tuple(worker.stderr_tail), others)
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


def host_store(master_addr: str, master_port: int, timeout_s: float | None) -> Any:
    """Start the rendezvous ``TCPStore`` server in this process; port 0 picks a free port.

    It listens only on ``master_addr`` when that is an address of this host (so the default,
    127.0.0.1, keeps the store on loopback), and on every interface otherwise.
    """
    import torch.distributed as dist  # imported here: only the launching process needs the store

    try:
        listener = listen_socket(master_addr, master_port)
        port = listener.getsockname()[1]
        return dist.TCPStore(
            master_addr, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s or DEFAULT_STORE_TIMEOUT_S),
            master_listen_fd=listener.detach(),  # the store owns and closes it
        )
    except (RuntimeError, OSError) as error:
        raise ConfigurationError(
            f"could not host the rendezvous store on {master_addr}:{master_port} ({error}). "
            "Pick another --master-port, or 0 for a free one."
        ) from error


def connect_store(master_addr: str, master_port: int, timeout_s: float | None) -> Any:
    """Connect this (non-zero) node's launcher to node 0's store, waiting for it up to the timeout."""
    import torch.distributed as dist

    timeout = timeout_s or DEFAULT_STORE_TIMEOUT_S
    try:
        return dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as error:
        raise ConfigurationError(
            f"could not reach node 0's rendezvous store at {master_addr}:{master_port} within {timeout:g}s "
            f"({str(error).splitlines()[0][:200]}). Start node 0 first, and pass the same --master-addr and "
            "--master-port to every host."
        ) from error


def listen_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address`` if it belongs to this host, else on every interface."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    try:
        return socket.create_server(sockaddr[:2], family=family, backlog=1024)
    except OSError as error:
        if error.errno != errno.EADDRNOTAVAIL:
            raise
        return socket.create_server(("", port), family=family, backlog=1024)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a name or a literal) means this host's loopback interface."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_towards(address: str) -> str | None:
    """The name of this host's interface holding the address it uses to reach ``address`` (Linux).

    For an address of this host itself, that is the interface holding it, not loopback.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            local = ipaddress.ip_address(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
    for name, addresses in _interface_addresses().items():
        if local in addresses:
            return name
    return None


def _interface_addresses() -> dict[str, set[Any]]:
    """This host's interfaces and their addresses, read from ``ip -o addr`` (empty if unavailable)."""
    try:
        listing = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, set[Any]] = {}
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            with contextlib.suppress(ValueError):
                found.setdefault(fields[1].split("@")[0], set()).add(ipaddress.ip_address(fields[3].split("/")[0]))
    return found


class JobBoard:
    """What the launchers of a multi-host job tell each other through node 0's store.

    Each launcher counts itself in when it starts and out when it ends, so node 0 can keep the
    store up until the last one is done; the first launcher to see a worker fail posts it, so the
    others stop their workers too (non-elastic jobs). Used from the launcher's main thread only.
    """

    PREFIX = "phalanx/launch/"
    FAILURE = PREFIX + "failure"
    JOINED = PREFIX + "joined"
    LEFT = PREFIX + "left"

    def __init__(self, store: Any):
        self.store = store

    def join(self) -> None:
        self.store.add(self.JOINED, 1)

    def leave(self) -> None:
        self.store.add(self.LEFT, 1)

    def post_failure(self, node: int, rank: int, exit_code: int) -> None:
        """Record the job's first failure (later ones keep the first)."""
        record = json.dumps({"node": node, "rank": rank, "exit_code": exit_code})
        self.store.compare_set(self.FAILURE, "", record)

    def failure(self) -> dict[str, Any] | None:
        """The failure another launcher posted, or None (also when the store is unreachable)."""
        try:
            if not self.store.check([self.FAILURE]):
                return None
            return json.loads(self.store.get(self.FAILURE))
        except (RuntimeError, OSError, ValueError):
            return None

    def wait_for_others(self, deadline: float, interrupted: Callable[[], bool]) -> None:
        """Node 0: wait until every launcher that joined has left, or the deadline passes."""
        while time.monotonic() < deadline and not interrupted():
            try:
                if self.store.add(self.LEFT, 0) >= self.store.add(self.JOINED, 0):
                    return
            except (RuntimeError, OSError):
                return
            time.sleep(POLL_INTERVAL_S)


def launch(config: LaunchConfig, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run ``config`` to the end, print why it failed if it did, and return the launcher's exit code."""
    if config.elastic:
        from phalanx.cli.elastic import ElasticSupervisor

        result = ElasticSupervisor(config, stdout, stderr).run()
    else:
        result = Supervisor(config, stdout, stderr).run()
    message = result.describe()
    if message:
        err = stderr or sys.stderr
        err.write(message + "\n")
        err.flush()
    return result.exit_code
