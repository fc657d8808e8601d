"""Worker processes of one launcher: starting them, relaying their output, how they ended."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Deque, Sequence

from phalanx.cli.config import WorkerSpec
from phalanx.lifetime import die_with_parent

STDERR_TAIL_LINES = 40
MAX_PENDING_LINE = 1 << 16
_LINE_END = re.compile(rb"\r\n|\n|\r")


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
    name: str = ""  # "worker rank 3" or "parameter server 1"; from the rank when empty

    def describe(self) -> str:
        """A summary for the launcher's stderr: who failed, how, and its traceback again."""
        name = self.name or f"worker rank {self.rank}"
        head = (f"phalanx run: {name} (pid {self.pid}) failed with {describe_exit(self.exit_code)}; "
                f"stopped the other {self.others_stopped} running process(es).")
        if not self.stderr_tail:
            return f"{head}\nphalanx run: {name} wrote nothing to stderr."
        tail = "\n".join(self.stderr_tail)
        return (f"{head}\n---- last {len(self.stderr_tail)} line(s) of {name}'s stderr ----\n"
                f"{tail}\n---- end of {name}'s stderr ----")


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

    def start(self, label: int | str, pipe: IO[bytes], stream: str, tail: Deque[str] | None = None) -> threading.Thread:
        """Relay ``pipe`` to ``stream`` on a daemon thread until EOF; remember lines in ``tail``."""
        thread = threading.Thread(target=self._pump, args=(label, pipe, stream, tail),
                                  name=f"phalanx-relay-{label}-{stream}", daemon=True)
        thread.start()
        return thread

    def _pump(self, label: int | str, pipe: IO[bytes], stream: str, tail: Deque[str] | None) -> None:
        pending = b""
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(pipe.fileno(), 1 << 16):
                lines, pending = split_lines(pending + chunk)
                self._emit(label, lines, stream, tail)
        if pending:
            self._emit(label, [pending + b"\n"], stream, tail)
        with contextlib.suppress(OSError):
            pipe.close()

    def _emit(self, label: int | str, lines: Sequence[bytes], stream: str, tail: Deque[str] | None) -> None:
        lines = [line for line in lines if line != b"\r"]  # a bare \r would only print an empty prefix
        if not lines:
            return
        if tail is not None:
            tail.extend(line.decode(errors="replace").rstrip("\r\n") for line in lines)
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


# --------------------------------------------------------------------------------------------
# One worker process
# --------------------------------------------------------------------------------------------


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

    def start(self, relay: OutputRelay, on_exit: Callable[[Worker], None]) -> None:
        """Start the process in its own session; relay its output; call ``on_exit`` from a thread when it ends."""
        self.process = subprocess.Popen(
            self.spec.command, env=self.spec.environment(os.environ), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self._relays = [relay.start(self.label, self.process.stdout, "stdout"),
                        relay.start(self.label, self.process.stderr, "stderr", self.stderr_tail)]
        threading.Thread(target=self._wait, args=(on_exit,), name=f"phalanx-wait-{self.label}", daemon=True).start()

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
