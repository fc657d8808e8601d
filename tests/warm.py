"""``phalanx`` commands for the tests, forked from a warm process as ``phalanx tune`` forks its trials.

A test that runs ``python -m phalanx run ...`` pays, in its launcher, a python start and an import of
torch (about 2.5 s of CPU here), and in each worker whose script makes an optimizer, the import of
TorchDynamo (about 2.3 s). A fork server of phalanx's own (:mod:`phalanx.cli.forkserver`) loads both
once for the session; a command forked from it starts at once, and its launcher forks its workers from
itself. :func:`run` and :class:`Popen` take ``subprocess.run``'s and ``subprocess.Popen``'s arguments.
Anything else starts as a fresh python, as a user's command would: a command that is not
``python -m phalanx ...`` (a prefix such as ``ip netns exec``), standard input, or more distinct
start-up settings (``PYTHON*``, ``OMP_*``, ...) than :data:`MAX_SERVERS` servers hold. A test about how
a command starts from a shell calls ``subprocess`` itself.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Mapping, Sequence

from phalanx.cli.config import WorkerSpec
from phalanx.cli.forkserver import STARTUP_PREFIXES, TORCHDYNAMO, ForkedProcess, ForkServer

MAX_SERVERS = 3  # the session's distinct start-up settings served warm (each server: one import of torch)
_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_lock = threading.Lock()


def _server_for(environment: Mapping[str, str]) -> ForkServer | None:
    """The session's server for these start-up settings (started at first use), or ``None``."""
    shared = WorkerSpec.shared_environment(environment)
    settings = tuple(sorted((k, v) for k, v in shared.items() if k.startswith(STARTUP_PREFIXES)))
    with _lock:
        server = _servers.get(settings)
        if server is None and len(_servers) < MAX_SERVERS:
            server = _servers[settings] = ForkServer(shared, preload=[TORCHDYNAMO])
            server.start()
    return server if server is not None and server.serves(shared) else None


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


def _warm_arguments(args: Sequence[str]) -> list[str] | None:
    """``["-m", "phalanx", ...]`` for ``[sys.executable, "-m", "phalanx", ...]``; ``None`` for any other command."""
    args = [str(arg) for arg in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1:3] == ["-m", "phalanx"]:
        return args[1:]
    return None


def _descriptor(target: Any, name: str, pipes: dict[str, tuple[int, int]], opened: list[int]) -> int:
    """The descriptor a forked command writes its ``name`` stream to: a new pipe's write end for ``PIPE``
    (its read end kept in ``pipes``), /dev/null, the test's own, or the file given."""
    if target == subprocess.PIPE:
        pipes[name] = os.pipe()
        opened.append(pipes[name][1])
        return pipes[name][1]
    if target == subprocess.DEVNULL:
        opened.append(os.open(os.devnull, os.O_WRONLY))
        return opened[-1]
    if target is None:
        return 1 if name == "stdout" else 2
    return target if isinstance(target, int) else target.fileno()


class Popen:
    """A command forked warm where it can be, else a real ``subprocess.Popen``; used as the latter is."""

    def __init__(self, args: Sequence[str], *, cwd: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, stdin: Any = None, stdout: Any = None, stderr: Any = None,
                 text: bool = False, start_new_session: bool = False, **popen_only: Any):
        environment = dict(os.environ if env is None else env)
        arguments = _warm_arguments(args)
        server = _server_for(environment) if arguments is not None and stdin is None and not popen_only else None
        self._forked: ForkedProcess | None = None
        self._real: subprocess.Popen | None = None
        self._chunks: dict[str, list[bytes]] = {}
        self._readers: list[threading.Thread] = []
        if server is None:
            self._real = subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                          start_new_session=start_new_session, **popen_only)
            self.stdout, self.stderr, self.pid = self._real.stdout, self._real.stderr, self._real.pid
            return
        # A forked command is a session leader (``start_new_session`` always holds) with stdin /dev/null
        pipes: dict[str, tuple[int, int]] = {}
        opened: list[int] = []  # descriptors made here, closed once the command holds them
        out_fd = _descriptor(stdout, "stdout", pipes, opened)
        err_fd = out_fd if stderr == subprocess.STDOUT else _descriptor(stderr, "stderr", pipes, opened)
        try:
            self._forked = server.spawn(arguments, environment, os.fspath(cwd or os.getcwd()), stdout=out_fd,
                                        stderr=err_fd)
        finally:
            for fd in opened:
                os.close(fd)
        streams = {name: open(read, "rb") for name, (read, _) in pipes.items()}
        if text:
            streams = {name: io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
                       for name, stream in streams.items()}
        self.stdout: IO[Any] | None = streams.get("stdout")
        self.stderr: IO[Any] | None = streams.get("stderr")
        self.pid = self._forked.pid
        self._text = text

    @property
    def returncode(self) -> int | None:
        return self._real.returncode if self._real is not None else self._forked.returncode  # type: ignore[union-attr]

    def poll(self) -> int | None:
        return self._real.poll() if self._real is not None else self._forked.poll()  # type: ignore[union-attr]

    def wait(self, timeout: float | None = None) -> int:
        return self._real.wait(timeout) if self._real is not None else self._forked.wait(timeout)  # type: ignore[union-attr]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr to their ends and wait, as ``Popen.communicate`` does (called again
        after a ``TimeoutExpired``, it goes on with what was read)."""
        assert input is None, "a forked command's standard input is /dev/null"
        if self._real is not None:
            return self._real.communicate(input, timeout)
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    self._chunks[name] = []
                    reader = threading.Thread(target=self._read_all, args=(stream, self._chunks[name]), daemon=True)
                    reader.start()
                    self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        empty = "" if self._text else b""
        return tuple(empty.join(self._chunks[name]) if name in self._chunks else None  # type: ignore[return-value]
                     for name in ("stdout", "stderr"))

    @staticmethod
    def _read_all(stream: IO[Any], into: list[Any]) -> None:
        for chunk in iter(lambda: stream.read(1 << 16), "" if isinstance(stream, io.TextIOBase) else b""):
            into.append(chunk)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def run(args: Sequence[str], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a command that may be forked warm: on a timeout the command's whole
    session is killed (a forked command leads its own) and ``TimeoutExpired`` raised."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.kill()
            process.communicate()
            raise
    done = subprocess.CompletedProcess(list(args), process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done
