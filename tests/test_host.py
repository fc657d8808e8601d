"""What the host offers: usable cores, the cost of more processes, and room for their open files."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from phalanx.host import oversubscription, usable_cores


def test_more_processes_than_cores_are_costed_and_a_core_each_is_not() -> None:
    assert usable_cores() >= 1
    assert oversubscription(2, 2) is None
    assert oversubscription(1000, 2) == "1000 processes on 2 cores: each runs about 500.0x slower than on a core of its own"


def limited(soft: int, hard: int, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a Python whose open-file limits were lowered to ``soft`` and ``hard`` first."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_the_open_file_limit_is_raised_for_many_workers_up_to_the_hard_limit() -> None:
    done = limited(100, 1000, """
        from phalanx.host import ensure_open_files
        ensure_open_files(200)
        print(resource.getrlimit(resource.RLIMIT_NOFILE))
    """)
    assert done.returncode == 0 and done.stdout.strip() == "(864, 1000)", done.stderr


def test_more_workers_than_the_hard_limit_holds_are_refused_before_any_starts(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not start')\n")
    done = limited(100, 300, f"""
        from phalanx.cli.main import main
        raise SystemExit(main(["run", "-n", "100", {str(script)!r}]))
    """)
    assert done.returncode == 2, done.stderr
    assert "100 processes need about 464 open files here, and this shell allows at most 300" in done.stderr
    assert "must not start" not in done.stderr
