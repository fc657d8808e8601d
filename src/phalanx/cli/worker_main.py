"""What every worker of ``phalanx run`` executes: the user's script or module, then a clean exit.

Run by path (``python .../worker_main.py [-m] TARGET ARGS...``), so that it imports nothing before
the user's code does. The target runs as ``python TARGET`` would run it (``__main__``, ``sys.argv``,
``sys.path[0]``, exit codes, tracebacks). Then, after non-daemon threads were joined and every
``atexit`` handler ran, the process ends with ``os._exit``: torch leaves process groups that a
model still references (``DistributedDataParallel`` does) to interpreter teardown, where Python
stops Gloo's threads in a way that aborts the process (SIGABRT) in a good share of runs. Files
left open are flushed first, so skipping teardown loses no output.

A worker forked by the fork server (:mod:`phalanx.cli.forkserver`) imports this module and calls
:func:`run` and :func:`finish` itself; importing it registers nothing.
"""

import atexit
import os
import sys

_exit_code = 0


def finish(code: int) -> None:
    """Flush what is still open, then end the process with ``code``, without interpreter teardown."""
    import gc
    import io

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if issubclass(type(obj), writers):  # by type: an instance check may touch deprecated objects
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


def end(code: int) -> None:
    """End as the interpreter would, less its teardown: wait for non-daemon threads, run the exit
    handlers, then :func:`finish`. For processes that end on their own terms (a forked worker, the
    launcher), where torch's teardown alone takes a second."""
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    finish(code)


def _end_process() -> None:
    """Registered first, so it runs last, after every exit handler of the script's."""
    finish(_exit_code)


if __name__ == "__main__":
    atexit.register(_end_process)

import runpy  # noqa: E402 - after the exit handler, so that it runs after every later one
import traceback  # noqa: E402

_THIS_FILE = os.path.abspath(__file__)
#: What the target leaves behind (its globals; the exception that ended it, whose frames hold them), kept
#: until the process ends without teardown: freed when the target returns, a DistributedDataParallel's
#: reducer joins Gloo's threads holding the GIL that one of them waits for to free a finished
#: operation's tensors, and the worker hangs at its end (seen in 2 of 3 runs of a 3-worker DDP script).
_left_behind: list[object] = []


def _exit_code_of(exit: SystemExit) -> int:
    """What the interpreter itself would exit with for ``raise SystemExit(code)``."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code & 0xFF
    print(exit.code, file=sys.stderr)
    return 1


def _report(error: BaseException) -> None:
    """Print the traceback as ``python TARGET`` would: without this module's and runpy's frames."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_globals.get("__name__") == "runpy"
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) == _THIS_FILE):
        tb = tb.tb_next
    error.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb  # as the interpreter sets them
    try:
        sys.excepthook(type(error), error, tb)
    except Exception:  # noqa: BLE001 - a broken hook must not hide the error
        traceback.print_exception(error)


def run(argv: list[str]) -> int:
    """Run ``[-m] TARGET ARGS...`` as ``__main__``; return the exit code ``python`` would give."""
    is_module = argv[0] == "-m"
    target = argv[1] if is_module else argv[0]
    sys.argv = [target, *argv[2 if is_module else 1:]]
    sys.path[0] = os.getcwd() if is_module else os.path.dirname(os.path.abspath(target))
    try:
        if is_module:
            _left_behind.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            _left_behind.append(runpy.run_path(target, run_name="__main__"))
    except SystemExit as exit:
        _left_behind.append(exit)
        return _exit_code_of(exit)
    except KeyboardInterrupt as interrupt:
        _left_behind.append(interrupt)
        _report(interrupt)
        return 130
    except BaseException as error:  # noqa: BLE001 - reported exactly like an uncaught exception
        _left_behind.append(error)
        _report(error)
        return 1
    return 0


if __name__ == "__main__":
    _exit_code = run(sys.argv[1:])
    sys.exit(_exit_code)
