"""How a failed launch is told, in process: the error a traceback ends with, held tracebacks, the summary.

The launches themselves are in test_launcher.py (``test_first_failure_...``, ``test_the_first_traceback_...``).
"""

from __future__ import annotations

from phalanx.cli.workers import HeldTraceback, WorkerFailure, compact_labels, error_line

TORCH_TRACEBACK = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 9, in <module>
[rank1]:     raise
[rank1]: ValueError: bad batch
[W1023 12:00:00 ProcessGroupGloo.cpp:1] Warning: a teardown warning"""


def test_error_line_is_the_exception_a_traceback_ends_with() -> None:
    assert error_line(TORCH_TRACEBACK.splitlines()) == "ValueError: bad batch"
    assert error_line(["Traceback (most recent call last):", "  File 'x'", "KeyboardInterrupt"]) == "KeyboardInterrupt"
    assert error_line(["loading", "out of patience"], exit_code=3) == "out of patience"  # sys.exit("...")
    assert error_line(["epoch 1"], exit_code=137) == ""  # killed: its last line is no error
    assert error_line([]) == ""


def test_compact_labels() -> None:
    assert compact_labels(["0", "2", "3", "4", "7", "s1"]) == "0,2-4,7,s1"


def test_a_traceback_is_held_from_its_first_line() -> None:
    held = HeldTraceback()
    assert held.take([b"step 3\n", b"Traceback (most recent call last):\n", b"  File\n"]) == [b"step 3\n"]
    assert held.since is not None and held.take([b"ValueError: x\n"]) == []
    assert held.release() == [b"Traceback (most recent call last):\n", b"  File\n", b"ValueError: x\n"]
    assert held.since is None and held.take([b"step 4\n"]) == [b"step 4\n"]


def test_failure_summary_points_at_the_streamed_traceback() -> None:
    failure = WorkerFailure(1, 42, 1, tuple(TORCH_TRACEBACK.splitlines()), ("[0] stopped by the launcher: x",),
                            label="1")
    assert failure.describe(shown=True).splitlines() == [
        "phalanx run: worker rank 1 (pid 42) failed with exit code 1: ValueError: bad batch",
        "phalanx run: its traceback is above, in the lines prefixed [1].",
        "phalanx run: why the others stopped:",
        "  [0] stopped by the launcher: x"]
    repeated = failure.describe()  # its stderr went elsewhere (px.diagnose captures it): the tail is repeated
    assert "---- last 5 line(s) of worker rank 1's stderr ----\n" + TORCH_TRACEBACK in repeated
    assert WorkerFailure(0, 7, 137, ()).describe() == (
        "phalanx run: worker rank 0 (pid 7) failed with signal SIGKILL (exit code 137); it wrote nothing to stderr.")
