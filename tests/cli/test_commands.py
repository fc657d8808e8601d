"""The ``phalanx`` command line in process: help, hints and warnings, no worker started."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.cli import main as cli
from phalanx.cli.config import LaunchConfig
from phalanx.host import oversubscription

COMMANDS = (["run"], ["tune"], ["doctor"], ["bench"], ["bench", "comm"])


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    listing = capsys.readouterr().out.split("  COMMAND\n", 1)[1].split("\n\n")[0].splitlines()
    named = [line.split()[:2] for line in listing if not line.startswith(" " * 6)]
    assert [words[0] for words in named] == ["run", "tune", "doctor", "bench"] and all(len(w) == 2 for w in named)


@pytest.mark.parametrize("command", COMMANDS + ([],), ids=lambda words: " ".join(words) or "phalanx")
def test_every_help_shows_a_runnable_example(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*command, "--help"]) == 0
    examples = capsys.readouterr().out.split("examples", 1)[1]
    assert f"\n  phalanx {' '.join(command or ['run'])} " in examples


@pytest.mark.parametrize("argv, meant", [
    (["x.py", "-n", "2"], "phalanx run -n 2 x.py"),
    (["-n", "2", "x.py", "--lr", "1", "-np", "4", "--", "-H", "h"], "phalanx run -n 2 -np 4 x.py --lr 1 -- -H h"),
    (["x.py", "--nproc-per-node=2"], "phalanx run --nproc-per-node=2 x.py"),
    (["-np", "2", "python", "x.py"], "phalanx run -np 2 x.py"),
    (["/usr/bin/python3.11", "-u", "-m", "pkg.train", "-n", "2"], "phalanx run -n 2 -m pkg.train"),
])
def test_a_command_written_for_another_launcher_gets_a_hint(argv: list[str], meant: str) -> None:
    flags = cli.build_parser()[1]
    hint = cli.run_hint(*cli.split_run_argv(argv, flags.values), flags)
    assert hint is not None and hint.startswith("phalanx run: hint: ") and "\n" not in hint
    assert f"You may mean: {meant}" in hint


@pytest.mark.parametrize("argv", [
    ["-n", "2", "x.py", "-n", "3"],  # phalanx was given -n: the script's own -n is the script's
    ["--nproc-per-node", "2", "x.py", "-n", "3"],
    ["x.py", "--help", "--epochs", "3"],
    ["x.py", "--", "-n", "3"],
    [],
])
def test_no_hint_for_a_command_meant_as_written(argv: list[str]) -> None:
    flags = cli.build_parser()[1]
    assert cli.run_hint(*cli.split_run_argv(argv, flags.values), flags) is None


@pytest.fixture()
def no_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    """``phalanx run`` up to the launch, on a host of 2 cores; the configurations it would launch."""
    launched: list[LaunchConfig] = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setattr(cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(cli, "launch", lambda config: launched.append(config) or 0)
    return launched


def test_hints_and_warnings_on_the_command_line(no_launch: list[LaunchConfig],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "x.py", "-n", "2"]) == 0 and no_launch[-1].args == ("-n", "2")  # torchrun's rule
    assert "You may mean: phalanx run -n 2 x.py" in capsys.readouterr().err
    assert cli.main(["run", "-n", "2", "--", "x.py", "-n", "2"]) == 0
    assert capsys.readouterr().err == ""  # -- says the script's arguments are meant as written
    assert cli.main(["run", "-np", "2", "python", "x.py"]) == 2 and len(no_launch) == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert "script 'python' not found" in error and hint.endswith("You may mean: phalanx run -np 2 x.py")
    assert cli.main(["run", "-n", "1000", "x.py"]) == 0  # warned, not refused
    assert capsys.readouterr().err == (
        "phalanx run: warning: 1000 processes on 2 cores: each runs about 500.0x slower than on a core of its "
        "own, and every collective waits for the slowest worker; -n 2 gives each worker a core.\n")


def test_oversubscription_counts_parameter_servers() -> None:
    assert oversubscription(2, 2) is None
    config = LaunchConfig(target="x.py", nproc_per_node=2, servers_per_node=1)
    assert config.local_processes == 3 and oversubscription(3, 2) is not None
