"""Workers forked from a process that has imported PyTorch and phalanx once: a fork server.

A worker started with ``python`` spends 1.5 to 3 s of CPU importing PyTorch before its script
runs; every worker of a job, every elastic replacement and every parameter server paid it again.
``phalanx run`` instead has one server process per launch, which has imported torch and phalanx (and
in which nothing else happens), and asks it for each worker: the server forks, and the child runs
the script as :mod:`phalanx.cli.worker_main` would, already warm. The launcher needs torch itself
(it hosts the rendezvous store), so it imports torch first and forks the server from itself before
it starts any thread: a launch pays one import of torch in all, where torchrun pays one per worker
and one more in its launcher. Where that fork cannot be made (torch already loaded, threads
running) the server is a fresh ``python`` importing torch itself.

What a worker may not inherit, and how that is made sure:

* **Threads.** ``fork`` copies only the calling thread; a lock held by another one would stay
  held forever in the child. The launcher forks the server only while it runs no other thread; the
  server runs no thread of its own and runs no torch operation
  (which could start intra-op or OpenMP pools); before announcing itself ready it checks that the
  kernel lists exactly one thread for it, and refuses to serve otherwise.
* **A CUDA context.** CUDA cannot be used in a forked child once its parent initialised it. The
  server never touches CUDA; it checks ``torch.cuda.is_initialized()`` is false before it serves.
* **Open files and sockets.** The server forked from the launcher keeps only its channel to it;
  each worker closes every descriptor but the three standard ones (which it points at its own
  pipes and ``/dev/null``) before the script starts.
* **Random state.** torch's default generator, Python's ``random`` and NumPy's global generator
  are seeded from the OS at import, so forked children would draw the same numbers; each child
  reseeds all three from the OS, as a fresh interpreter would (``torch.seed()``, which reaches the
  GPUs' generators lazily, when CUDA starts). Python's string-hash seed cannot be changed after
  start: workers share the server's (a fresh process draws its own), which changes only the
  iteration order of sets of strings, identically on every worker.
* **Start-up settings.** Variables read when an interpreter or a library starts (``PYTHON*``,
  ``OMP_*``, ``MKL_*``, ``LD_*``, ...) cannot take effect in a forked child: a worker whose
  environment differs from the server's in one of them is started the old way (a fresh
  ``python``), and the log says so.

Where the server cannot serve (no ``fork``, a refused check, a server that did not start), workers
are started the old way and the log says why. Each worker is its own session (``setsid``), dies
with the server (which dies with the launcher), and its exit is reaped by the server, which tells
the launcher at once with the time of the exit: the launcher's judgement of which worker failed
first reads those times, recorded when each worker exited.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import IO

import phalanx
from phalanx.lifetime import die_with_parent

__all__ = ["TORCHDYNAMO", "ForkServer", "ForkedProcess", "startup_variables_differ"]

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # the server's imports, on a host busy with other jobs
POLL_S = 0.1
_MESSAGE_BYTES = 1 << 20
#: Loaded by the first torch optimizer a script makes (``torch._disable_dynamo``): about as costly as
#: torch itself. A server that forks many short jobs (``phalanx tune``'s) preloads it once for all.
TORCHDYNAMO = "torch._dynamo"
#: Read when an interpreter or a library loads: a forked child cannot take a new value of these.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_", "TORCH_")


#: The start-up settings (``OMP_*``, ...) under which this process, or the server it was forked
#: from, loaded torch to fork workers; ``None`` where torch was not loaded for that.
_loaded_under: dict[str, str] | None = None


def _library_settings(environment: Mapping[str, str]) -> dict[str, str]:
    """The start-up variables that libraries read when they load (``PYTHON*`` are the interpreter's)."""
    return {name: value for name, value in environment.items()
            if name.startswith(STARTUP_PREFIXES) and not name.startswith("PYTHON")}


def startup_variables_differ(wanted: Mapping[str, str], server: Mapping[str, str]) -> list[str]:
    """The start-up variables (:data:`STARTUP_PREFIXES`) whose values differ between two environments."""
    names = {name for name in (*wanted, *server) if name.startswith(STARTUP_PREFIXES)}
    return sorted(name for name in names if wanted.get(name) != server.get(name))


# --------------------------------------------------------------------------------------------
# The launcher's side
# --------------------------------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the server: what the launcher needs of a ``subprocess.Popen``, plus
    ``exited_at``, the monotonic time at which the server reaped it."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self._exited = threading.Event()

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it has exited; raises ``subprocess.TimeoutExpired`` after ``timeout``."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def _ended(self, returncode: int, at: float) -> None:
        self.returncode, self.exited_at = returncode, at
        self._exited.set()


class ForkServer:
    """The launcher's handle on its fork server: :meth:`start` it first, before the launcher starts
    any thread, then :meth:`spawn` workers; :meth:`close` at the end of the launch."""

    def __init__(self, environment: Mapping[str, str], preload: Sequence[str] = ()):
        self.environment = dict(environment)
        #: modules the server loads beyond torch and phalanx, shared by every fork (``phalanx tune``'s
        #: server loads TorchDynamo, which each trial's first optimizer loads); a launch's own server
        #: loads nothing more, so that a script that never needs them is not kept waiting
        self.preload = tuple(preload)
        self.refused: str | None = None  # why it does not serve, once known
        self._process: subprocess.Popen[bytes] | _ForkedServer | None = None
        self._socket: socket.socket | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._replies: list[int] = []
        self._reply = threading.Condition()
        self._processes: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, tuple[int, float]] = {}  # reaped before spawn() registered them

    def start(self) -> None:
        """Start the server and return at once (it finishes its imports meanwhile).

        A launcher that has not imported torch yet imports it here (it needs torch for its store
        anyway) and forks the server from itself, before it starts any thread: the job pays one
        import of torch in all. Elsewhere (torch already loaded with other start-up settings, other
        threads running) the server is a fresh ``python`` that imports torch itself.
        """
        if not hasattr(os, "fork"):
            self.refused = "this platform has no fork()"
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        why_not_here = self._why_not_fork_this_process()
        if why_not_here is None:
            self._process = _ForkedServer.start(theirs, ours, self.preload)
        else:
            logger.debug("phalanx: the fork server is a fresh python: %s", why_not_here)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "phalanx.cli.forkserver", str(theirs.fileno()), *self.preload],
                env=self.environment,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                preexec_fn=die_with_parent(os.getpid()))
        theirs.close()
        self._socket = ours
        threading.Thread(target=self._read, name="phalanx-forkserver", daemon=True).start()

    def _why_not_fork_this_process(self) -> str | None:
        """Why this process cannot become the server by a fork, or ``None`` once it has imported
        what a worker imports, under the server's start-up settings (OpenMP reads its variables
        when torch loads it, so they are set first). A process forked warm from a server (a trial's
        launcher under ``phalanx tune``) has them already, and imports nothing."""
        global _loaded_under
        wanted = _library_settings(self.environment)
        if "torch" in sys.modules and _loaded_under != wanted:
            return "torch was imported before, under other start-up settings than the workers'"
        if _threads_of_this_process() != 1:
            return "this process runs threads"
        if "torch" not in sys.modules:
            os.environ.update(wanted)
            _import_what_workers_import()
            _loaded_under = wanted
        return _why_not_serving()

    def serves(self, environment: Mapping[str, str]) -> bool:
        """Whether a worker with ``environment`` can be forked (waits for the server to be ready);
        when not, the reason is logged and the caller starts it the old way."""
        if self.refused is None and self._socket is not None and not self._ready.wait(READY_TIMEOUT_S):
            self._refuse(f"the fork server was not ready after {READY_TIMEOUT_S:.0f} s")
        if self.refused is not None:
            return False
        differ = startup_variables_differ(environment, self.environment)
        if differ:
            logger.info("phalanx: a worker started with python, not forked: its %s differ from the fork server's, "
                        "and they take effect only when a process starts", ", ".join(differ))
        return not differ

    def spawn(self, argv: Sequence[str], environment: Mapping[str, str], cwd: str,
              stdout: int | None = None, stderr: int | None = None) -> ForkedProcess:
        """Fork a process running ``worker_main``'s ``argv`` (a script, or ``-m`` and a module) with
        ``environment`` in ``cwd``. ``stdout`` and ``stderr`` are descriptors it writes to (a log
        file; both may be the same one); each left ``None`` comes back as a pipe, as with
        ``Popen(..., stdout=PIPE)``."""
        assert self._socket is not None
        pipes = {name: os.pipe() for name, given in (("stdout", stdout), ("stderr", stderr)) if given is None}
        ends = [pipes["stdout"][1] if stdout is None else stdout, pipes["stderr"][1] if stderr is None else stderr]
        request = json.dumps({"argv": list(argv), "env": dict(environment), "cwd": cwd}).encode()
        try:
            with self._lock, self._reply:
                socket.send_fds(self._socket, [request], ends)
                while not self._replies and self.refused is None:
                    self._reply.wait(POLL_S)
                if self.refused is not None and not self._replies:
                    raise OSError(f"the fork server stopped: {self.refused}")
                pid = self._replies.pop(0)
                readers = {name: open(read, "rb") for name, (read, _) in pipes.items()}
                process = ForkedProcess(pid, readers.get("stdout"), readers.get("stderr"))
                self._processes[pid] = process
                if pid in self._early_exits:
                    process._ended(*self._early_exits.pop(pid))
        except BaseException:
            for read, _ in pipes.values():
                os.close(read)
            raise
        finally:
            for _, write in pipes.values():
                os.close(write)
        return process

    def close(self) -> None:
        """Stop the server (its workers were stopped by the launcher before)."""
        if self._socket is not None:
            with contextlib.suppress(OSError):  # wakes the reader thread's recv, and tells the server to end
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
        if self._process is not None:
            try:
                self._process.wait(5.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason
            logger.info("phalanx: workers start with python, each importing torch (%s)", reason)

    def _read(self) -> None:
        """The server's messages: ready (or refused), each fork's pid, each worker's exit."""
        assert self._socket is not None
        while True:
            try:
                data = self._socket.recv(_MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                if message["ready"]:
                    self._ready.set()
                else:
                    self._refuse(message["reason"])
                    self._ready.set()
            elif "pid" in message:
                with self._reply:
                    self._replies.append(message["pid"])
                    self._reply.notify_all()
            elif "exited" in message:
                with self._reply:
                    process = self._processes.get(message["exited"])
                    if process is None:
                        self._early_exits[message["exited"]] = (message["returncode"], message["at"])
                if process is not None:
                    process._ended(message["returncode"], message["at"])
        self._refuse("the fork server ended")
        self._ready.set()
        with self._reply:
            self._reply.notify_all()
        for process in self._processes.values():  # its workers died with it (they are killed when it dies)
            if process.returncode is None:
                process._ended(-signal.SIGKILL, time.monotonic())


class _ForkedServer:
    """The server forked from the launcher: waited for and killed as a ``Popen`` would be."""

    def __init__(self, pid: int):
        self.pid = pid

    @classmethod
    def start(cls, channel: socket.socket, launchers_end: socket.socket, preload: Sequence[str]) -> _ForkedServer:
        """Fork; the child serves on ``channel`` and never returns."""
        parent = os.getpid()
        pid = os.fork()
        if pid:
            return cls(pid)
        try:
            launchers_end.close()
            die_with_parent(parent)()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            keep = channel.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, _max_fd())
            serve(channel, preload)
        finally:
            os._exit(0)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.01)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def _threads_of_this_process() -> int:
    """Threads the kernel lists for this process (Python's count misses those C++ started)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _why_not_serving() -> str | None:
    """Why this process may not fork workers, or ``None``: the checks of the module's docstring."""
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised in the fork server"
    threads = _threads_of_this_process()
    if threads != 1:
        return f"the fork server runs {threads} threads after importing torch"
    return None


def _import_what_workers_import() -> None:
    import torch  # noqa: F401 - what every worker would import: the point of the server

    import phalanx.cli.worker_main  # noqa: F401 - imported, not run: it registers nothing at import


def _keep_import_time_finalizers_from_workers() -> None:
    """Clean-ups that the imports registered to run at exit (torch's operator libraries, ~0.1 s
    each worker) belong to the server, which owns what they clean: a worker's exit skips them."""
    for candidate in gc.get_objects():
        if type(candidate) is weakref.finalize:
            candidate.atexit = False


def _send(channel: socket.socket, message: dict) -> None:
    channel.send(json.dumps(message).encode())


def serve(channel: socket.socket, preload: Sequence[str] = ()) -> None:
    """Import what workers import, check nothing leaks into a fork, then fork workers on request and
    report each one's exit, until the launcher closes the channel."""
    global _loaded_under
    # Ctrl-C at a terminal reaches the whole process group: stopping the workers is the owner's to do
    # (a server that died of it would take them down at once, with SIGKILL); each worker resets it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _loaded_under is None:  # a fresh server: torch loads now, under its environment, the workers'
        _loaded_under = _library_settings(os.environ)
    _import_what_workers_import()
    # What workers load at first use, loaded once here while the launcher goes on with its own work
    phalanx.import_everything()
    for module in preload:
        importlib.import_module(module)
    _keep_import_time_finalizers_from_workers()
    # Everything loaded so far lives as long as the server: frozen, the workers' garbage collections
    # never walk it (nor copy the pages they would touch: a fork shares them until written).
    gc.freeze()
    reason = _why_not_serving()
    _send(channel, {"ready": reason is None, **({"reason": reason} if reason else {})})
    if reason is not None:
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select through the wakeup fd
    while True:
        ready, _, _ = select.select([channel, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(channel)
        if channel in ready:
            try:
                data, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 2)
            except OSError:
                data = b""
            if not data:
                return
            pid = _fork(json.loads(data), fds)
            for fd in fds:
                os.close(fd)
            _send(channel, {"pid": pid})


def _reap(channel: socket.socket) -> None:
    """Report every child that ended, with the time it was reaped."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status), "at": time.monotonic()})


def _fork(request: dict, fds: list[int]) -> int:
    """Fork one worker (its stdout and stderr: ``fds``); in the child, never return."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        code = _become_worker(request, fds, parent)
    except BaseException:  # noqa: BLE001 - a child must never return into the server's loop
        import traceback

        traceback.print_exc()
        code = 1
    from phalanx.cli.worker_main import end

    end(code)  # the script's threads and exit handlers, then out without teardown


def _become_worker(request: dict, fds: list[int], parent: int) -> int:
    """The child's side: a fresh session, its own output and environment, fresh random state; then
    the script, run as worker_main runs it; returns its exit code."""
    os.setsid()
    die_with_parent(parent)()
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.closerange(3, _max_fd())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    from phalanx.cli import worker_main

    return worker_main.run(request["argv"])


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 4096


def _reseed() -> None:
    """Seed torch's, Python's and NumPy's global generators from the OS, as a fresh interpreter does."""
    import random

    import torch

    torch.seed()
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    # served by the module as imported, not by this copy run as __main__: the state that forks inherit
    # (what torch was loaded under) must be where a forked launcher's phalanx code looks for it
    from phalanx.cli import forkserver

    forkserver.serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
    os._exit(0)  # nothing to flush or tear down: the interpreter's teardown of torch alone takes a second here
