"""Worker processes of one launcher: starting them, relaying their output, how they ended."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Deque, Iterable, Sequence

from phalanx.cli.config import WORKER_MAIN, WorkerSpec
from phalanx.cli.forkserver import ForkedProcess, ForkServer
from phalanx.lifetime import die_with_parent

logger = logging.getLogger(__name__)

STDERR_TAIL_LINES = 40
MAX_PENDING_LINE = 1 << 16
TRACEBACK_LINE = "Traceback (most recent call last):"
HOLD_S = 3.0  # how long a traceback is held back while its worker runs on
MAX_HELD_LINES = 2000
_LINE_END = re.compile(rb"\r\n|\n|\r")
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch's excepthook marks tracebacks "[rank1]: "
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(:\s|$)")  # "ValueError: boom", "pkg.errors.Error: ..."


# --------------------------------------------------------------------------------------------
# How it ended
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerFailure:
    """The worker that failed first, the tail of what it wrote to stderr, and why the others stopped."""

    rank: int
    pid: int
    exit_code: int
    stderr_tail: tuple[str, ...]
    others: tuple[str, ...] = ()  # "[0,2-5] stopped by the launcher: ...", one line per reason
    name: str = ""  # "worker rank 3" or "parameter server 1"; from the rank when empty
    label: str = ""  # the prefix of its output lines ("3", "s1"); empty when output is not prefixed

    def describe(self, shown: bool = False) -> str:
        """A summary for the launcher's stderr: who failed, how, with what error, why the others stopped.

        ``shown``: the worker's stderr went to the stream this summary goes to, so the summary says
        where its traceback is instead of repeating it; otherwise the tail of its stderr is repeated.
        """
        name = self.name or f"worker rank {self.rank}"
        error = error_line(self.stderr_tail, self.exit_code)
        lines = [f"phalanx run: {name} (pid {self.pid}) failed with {describe_exit(self.exit_code)}"
                 + (f": {error}" if error else "" if self.stderr_tail else "; it wrote nothing to stderr.")]
        if self.stderr_tail:
            lines += [self._where_shown()] if shown else self._tail(name)
        if self.others:
            lines += ["phalanx run: why the others stopped:", *(f"  {line}" for line in self.others)]
        return "\n".join(lines)

    def _where_shown(self) -> str:
        what = "traceback" if any(TRACEBACK_LINE in line for line in self.stderr_tail) else "stderr"
        return f"phalanx run: its {what} is above" + (f", in the lines prefixed [{self.label}]." if self.label else ".")

    def _tail(self, name: str) -> list[str]:
        return [f"---- last {len(self.stderr_tail)} line(s) of {name}'s stderr ----", *self.stderr_tail,
                f"---- end of {name}'s stderr ----"]


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: the launcher's exit code, and why when it is not 0."""

    exit_code: int
    failure: WorkerFailure | None = None
    stop_signal: int | None = None
    workers_stopped: int = 0
    message: str | None = None

    def describe(self, shown: bool = False) -> str | None:
        """A message for the launcher's stderr, or None when every worker succeeded (``shown``: as
        :meth:`WorkerFailure.describe`)."""
        if self.failure is not None:
            return self.failure.describe(shown)
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


def error_line(lines: Iterable[str], exit_code: int = 1) -> str:
    """The error a worker's stderr ends with, without torch's ``[rankN]:`` mark: after its last
    traceback, the last ``Name: message`` line; without one, its last line, unless a signal killed
    it (its last line is then no error). Empty when there is none."""
    lines = [_TORCH_RANK_PREFIX.sub("", line).rstrip() for line in lines]
    starts = [i for i, line in enumerate(lines) if line == TRACEBACK_LINE]
    written = [line for line in lines[starts[-1] if starts else 0:] if line.strip()]
    if not starts:
        return written[-1].strip() if written and exit_code <= 128 else ""
    return next((line for line in reversed(written) if _EXCEPTION_LINE.match(line)), written[-1].strip())


def compact_labels(labels: Sequence[str]) -> str:
    """``0,2-5,s1``: output prefixes, with runs of consecutive ranks as ranges."""
    ranks = sorted(int(label) for label in labels if label.isdigit())
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    words = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ",".join(words + [label for label in labels if not label.isdigit()])


# --------------------------------------------------------------------------------------------
# Output relay
# --------------------------------------------------------------------------------------------


class OutputRelay:
    """Copies workers' output to the launcher's stdout and stderr, whole lines at a time.

    One lock covers both streams, so no two lines ever mix on a terminal. Lines end at ``\\n`` or
    ``\\r``, so progress bars (which redraw with ``\\r``) stay live; each gets a ``[rank] `` prefix.
    A worker's traceback may be held back (see :class:`HeldTraceback`).
    """

    def __init__(self, stdout: IO[str], stderr: IO[str], prefix: bool = True):
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._prefix = prefix
        self._lock = threading.Lock()

    def start(self, label: int | str, pipe: IO[bytes], stream: str, tail: Deque[str] | None = None,
              held: HeldTraceback | None = None) -> threading.Thread:
        """Relay ``pipe`` to ``stream`` on a daemon thread until EOF; remember lines in ``tail``."""
        thread = threading.Thread(target=self._pump, args=(label, pipe, stream, tail, held),
                                  name=f"phalanx-relay-{label}-{stream}", daemon=True)
        thread.start()
        return thread

    def _pump(self, label: int | str, pipe: IO[bytes], stream: str, tail: Deque[str] | None,
              held: HeldTraceback | None) -> None:
        pending = b""
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(pipe.fileno(), 1 << 16):
                lines, pending = split_lines(pending + chunk)
                self._relay(label, lines, stream, tail, held)
        if pending:
            self._relay(label, [pending + b"\n"], stream, tail, held)
        with contextlib.suppress(OSError):
            pipe.close()

    def _relay(self, label: int | str, lines: Sequence[bytes], stream: str, tail: Deque[str] | None,
               held: HeldTraceback | None) -> None:
        lines = [line for line in lines if line != b"\r"]  # a bare \r would only print an empty prefix
        if tail is not None:
            tail.extend(line.decode(errors="replace").rstrip("\r\n") for line in lines)
        self.emit(label, held.take(lines) if held is not None else lines, stream)

    def emit(self, label: int | str, lines: Sequence[bytes], stream: str) -> None:
        """Write a worker's ``lines`` to ``stream``, each with the worker's prefix."""
        if lines:
            prefix = f"[{label}] ".encode() if self._prefix else b""
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


class HeldTraceback:
    """A worker's stderr from its latest traceback on, held back from the launcher's stderr.

    A worker that raises prints its traceback, then exits. Held until then, the launcher can show
    in full only the traceback of the worker that failed first, and sum up the others' (often the
    same error, or a peer's death seen from their side) in one line each. A worker still running
    :data:`HOLD_S` after its traceback handled the error: the launcher shows the lines then.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[bytes] = []
        self.since: float | None = None  # when the traceback held now began (monotonic)

    def take(self, lines: Sequence[bytes]) -> list[bytes]:
        """Of a worker's new stderr lines, those to write now; from a traceback's first line on, none."""
        with self._lock:
            start = 0
            if self.since is None:
                start = next((i for i, line in enumerate(lines) if TRACEBACK_LINE.encode() in line), len(lines))
                self.since = time.monotonic() if start < len(lines) else None
            self._lines.extend(lines[start:])
            overflow = self._release() if len(self._lines) > MAX_HELD_LINES else []  # not a dying worker's
            return [*lines[:start], *overflow]

    def release(self) -> list[bytes]:
        """Stop holding; return the lines held."""
        with self._lock:
            return self._release()

    def _release(self) -> list[bytes]:
        lines, self._lines, self.since = self._lines, [], None
        return lines


# --------------------------------------------------------------------------------------------
# One worker process
# --------------------------------------------------------------------------------------------


class Worker:
    """One worker process: its spec, its process group, its output relays and the tail of its stderr."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.process: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.stderr_tail: Deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.held = HeldTraceback()
        self.exited = threading.Event()
        self.exited_at: float | None = None  # monotonic
        self._relay: OutputRelay | None = None
        self._relays: list[threading.Thread] = []

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def label(self) -> str:
        """The prefix of its output lines: the rank, or ``s1`` for parameter server 1."""
        return self.spec.label

    @property
    def name(self) -> str:
        """``worker rank 3`` or ``parameter server 1``, for messages."""
        return self.spec.name

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

    @property
    def killed(self) -> bool:
        """Whether it died of SIGKILL, which nothing inside a process sends: a user, the OOM killer, or
        the launcher when it stops everyone (which it does only after choosing the first failure)."""
        return self.process is not None and self.exited.is_set() and self.process.returncode == -signal.SIGKILL

    @property
    def failing_since(self) -> float | None:
        """When it began to fail: its traceback held back, else its exit with an error; None if it did not."""
        code = self.exit_code
        if code == 0:
            return None
        if self.held.since is not None:
            return self.held.since
        return self.exited_at if code is not None else None

    def start(self, relay: OutputRelay, on_exit: Callable[[Worker], None], forks: ForkServer | None = None) -> None:
        """Start the process in its own session (forked by ``forks`` where it can, else a fresh
        ``python``); relay its output; call ``on_exit`` from a thread when it ends."""
        environment = self.spec.environment(os.environ)
        self.process = self._forked(forks, environment) or subprocess.Popen(
            self.spec.command, env=environment, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self._relay = relay
        self._relays = [relay.start(self.label, self.process.stdout, "stdout"),
                        relay.start(self.label, self.process.stderr, "stderr", self.stderr_tail, self.held)]
        threading.Thread(target=self._wait, args=(on_exit,), name=f"phalanx-wait-{self.label}", daemon=True).start()

    def _forked(self, forks: ForkServer | None, environment: dict[str, str]) -> ForkedProcess | None:
        """The worker forked by ``forks``, or None where it cannot be (then it starts the old way)."""
        command = self.spec.command
        if forks is None or len(command) < 3 or command[1] != WORKER_MAIN or not forks.serves(environment):
            return None
        try:
            return forks.spawn(command[2:], environment, os.getcwd())
        except OSError as error:
            logger.info("phalanx: %s started with python, not forked: %s", self.name, error)
            return None

    def _wait(self, on_exit: Callable[[Worker], None]) -> None:
        assert self.process is not None
        self.process.wait()
        # A forked worker was reaped by the fork server, which noted the time; otherwise it is now.
        reaped_at = self.process.exited_at if isinstance(self.process, ForkedProcess) else None
        # The launcher owns what a worker leaves behind: processes it forked that still run in its
        # process group (its session) are killed with it, whatever its exit code. The group's id
        # cannot have been reused while any of them lives; with none left, this finds nobody.
        self.signal_group(signal.SIGKILL)
        self.exited_at = reaped_at if reaped_at is not None else time.monotonic()
        self.exited.set()
        on_exit(self)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group (its children too); ignore a gone group."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def show_held(self) -> None:
        """Write the traceback held back, if any, to the launcher's stderr now."""
        lines = self.held.release()
        if self._relay is not None:
            self._relay.emit(self.label, lines, "stderr")

    def withhold(self) -> str:
        """Drop the traceback held back, for good; return the error it ends with ("" if none was held)."""
        return error_line(line.decode(errors="replace") for line in self.held.release())

    def join_output(self, deadline: float) -> None:
        """Wait, until ``deadline`` (monotonic), for the relays to copy the last of the output."""
        for thread in self._relays:
            thread.join(max(0.0, deadline - time.monotonic()))
