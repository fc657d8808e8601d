"""The worker entry point runs a target exactly as ``python`` would, then exits without teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.cli.config import WORKER_MAIN
from tests.cli.test_launcher import write_script

PROBE = """\
    import os, sys
    print(__name__, sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0] == os.path.dirname(__file__))
    log = open(os.path.join(os.path.dirname(__file__), "unclosed.log"), "w")
    log.write("kept")  # never closed nor flushed by the script
    sys.open_log = log  # still referenced when the process ends
    code = sys.argv[1]
    if code == "raise":
        raise ValueError("bad input")
    if code != "none":
        sys.exit(int(code) if code.isdigit() else code)
"""


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, WORKER_MAIN, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("code, expected", [("none", 0), ("0", 0), ("3", 3), ("a message", 1), ("raise", 1)])
def test_exit_codes_match_python(tmp_path: Path, code: str, expected: int) -> None:
    script = write_script(tmp_path, "probe.py", PROBE)
    worker = run(str(script), code, cwd=tmp_path)
    assert (tmp_path / "unclosed.log").read_text() == "kept"
    plain = subprocess.run([sys.executable, str(script), code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=30)
    assert worker.returncode == plain.returncode == expected, worker.stderr
    assert worker.stdout == plain.stdout == f"__main__ ['{code}'] probe.py True\n"


def test_traceback_shows_only_the_users_frames(tmp_path: Path) -> None:
    script = write_script(tmp_path, "probe.py", PROBE)
    worker = run(str(script), "raise", cwd=tmp_path)
    assert worker.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 8, in <module>',
        '    raise ValueError("bad input")',
        "ValueError: bad input",
    ]


def test_a_module_runs_like_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n")
    worker = run("-m", "pkg.train", "--lr", "0.1", cwd=tmp_path)
    assert (worker.returncode, worker.stdout) == (4, "__main__ ['--lr', '0.1']\n"), worker.stderr
