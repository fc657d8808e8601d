"""``phalanx run``: real launcher and worker processes, each run under a hard timeout.

Worker scripts avoid importing torch (except the ``px.init`` test) so each launch costs about
one torch import, in the launcher. Pids that workers write to files prove no process outlives
the launcher.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.cli.config import WORKER_MAIN, LaunchConfig, job_id
from phalanx.errors import ConfigurationError
from phalanx.lifetime import is_alive
from phalanx.cli.workers import describe_exit, exit_code_of, split_lines
from phalanx.cli.main import build_parser, main, split_run_argv
from tests import warm

LAUNCH_TIMEOUT_S = 60
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the launcher uses POSIX process groups")


def worker_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launch variables it might itself have been started with."""
    launch_keys = ("PHALANX_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launch_keys) or k == "PHALANX_SECRET"}
    env.update(extra)
    return env


def phalanx_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", *args]


def run_on_hosts(hosts: list[str], common: list[str], target: list[str], cwd: Path, env: dict[str, str],
                 timeout: float = 90) -> tuple[list[int], list[tuple[str, str]]]:
    """One ``phalanx run`` per network namespace (node rank = its index); their exit codes and outputs."""
    launchers = [subprocess.Popen(["ip", "netns", "exec", host,
                                   *phalanx_command(*common, "--node-rank", str(node), *target)],
                                  cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node, host in enumerate(hosts)]
    try:
        outputs = [launcher.communicate(timeout=timeout) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    return [launcher.returncode for launcher in launchers], outputs


def run_phalanx(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the launcher to completion (forked warm); killed if it overruns the timeout."""
    return warm.run(phalanx_command(*args), cwd=cwd, env=env or worker_env(), capture_output=True,
                    text=True, timeout=LAUNCH_TIMEOUT_S)


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


def assert_all_gone(pids: list[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if is_alive(pid)]
    for pid in survivors:  # do not leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the launcher: {survivors}"


def read_pids(directory: Path, expected: int, within_s: float = 30.0) -> list[int]:
    """Wait until ``expected`` pid files exist in ``directory``; return the pids."""
    deadline = time.monotonic() + within_s
    while True:
        files = [f for f in directory.glob("*.pid") if f.read_text().strip()]
        if len(files) >= expected:
            return [int(f.read_text()) for f in files]
        if time.monotonic() >= deadline:
            raise AssertionError(f"only {len(files)} of {expected} workers wrote their pid")
        time.sleep(0.1)


PRINT_RANK = """\
    import os, sys
    print(os.environ["PHALANX_RANK"], os.environ["PHALANX_WORLD_SIZE"], *sys.argv[1:])
    print("stderr of", os.environ["RANK"], file=sys.stderr)
"""

# Writes its pid, then: rank 1 fails with code 3 after printing a traceback; rank 2 answers
# SIGTERM with code 9 (a later failure that must not be the one reported); the rest sleep.
FAIL_ONE = """\
    import os, signal, sys, time, traceback
    rank = os.environ["PHALANX_RANK"]
    if rank == "2":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(9))
    open(os.path.join(sys.argv[1], rank + ".pid"), "w").write(str(os.getpid()))
    if rank == "1":
        while len(os.listdir(sys.argv[1])) < 3:
            time.sleep(0.05)
        try:
            raise ValueError("boom")
        except ValueError:
            traceback.print_exc()
            sys.exit(3)
    time.sleep(1000)
"""

# Every worker ignores SIGTERM and has a child process; rank 0 then dies by SIGKILL.
STUBBORN = """\
    import os, signal, subprocess, sys, time
    rank = os.environ["PHALANX_RANK"]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    open(os.path.join(sys.argv[1], "child" + rank + ".pid"), "w").write(str(child.pid))
    open(os.path.join(sys.argv[1], rank + ".pid"), "w").write(str(os.getpid()))
    if rank == "0":
        while len(os.listdir(sys.argv[1])) < 4:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1000)
"""

SLEEP = """\
    import os, sys, time
    open(os.path.join(sys.argv[1], os.environ["PHALANX_RANK"] + ".pid"), "w").write(str(os.getpid()))
    print("ready", flush=True)
    time.sleep(1000)
"""


# ---- whole launches -------------------------------------------------------------------------


def test_every_rank_prints_with_its_prefix(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ranks.py", PRINT_RANK)
    result = run_phalanx("-n", "3", str(script), "--flag", "--", "-n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}] {r} 3 --flag -- -n" for r in range(3)]
    relayed = [line for line in result.stderr.splitlines() if not line.startswith("phalanx run: warning:")]
    assert sorted(relayed) == [f"[{r}] stderr of {r}" for r in range(3)]  # no hint: the launcher was given -n


def test_no_prefix_and_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_script(package, "job.py", PRINT_RANK)
    # the package's folder ahead of what the test's own path holds (phalanx itself, where it is not installed)
    env = worker_env(PYTHONPATH=os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])))
    result = run_phalanx("-n", "2", "--no-prefix", "-m", "pkg.job", "a", cwd=tmp_path / "pkg", env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["0 2 a", "1 2 a"]


def test_first_failure_sets_exit_code_and_stops_the_others(tmp_path: Path) -> None:
    script = write_script(tmp_path, "fail.py", FAIL_ONE)
    pids = tmp_path / "pids"
    pids.mkdir()
    started = time.monotonic()
    result = run_phalanx("-n", "3", str(script), str(pids), cwd=tmp_path)
    assert time.monotonic() - started < 15, "the sleeping workers were not stopped promptly"
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == 1  # the live, prefixed copy only
    summary = result.stderr.split("\n[1] ValueError: boom\n", 1)[1].splitlines()
    assert summary[:3] == ["phalanx run: worker rank 1 (pid %d) failed with exit code 3: ValueError: boom"
                           % int((pids / "1.pid").read_text()),
                           "phalanx run: its traceback is above, in the lines prefixed [1].",
                           "phalanx run: why the others stopped:"]
    assert sorted(summary[3:]) == ["  [0] stopped by the launcher: signal SIGTERM (exit code 143)",
                                   "  [2] stopped by the launcher: exit code 9"]
    assert_all_gone(read_pids(pids, 3, within_s=0))


# Rank 1 prints its traceback, then takes 1.5 s to exit (a slow teardown) with code 3; rank 0 sees it
# and fails 0.5 s later, as the peer of a dead rank does. Rank 0 exits first; rank 1 failed first.
# (The launcher dates a traceback when its relay thread reads it: on a loaded host that thread may run
# tens of milliseconds late, so two tracebacks closer than that cannot be told apart.)
CAUSE_EXITS_LAST = """\
    import os, sys, time, traceback
    marker = os.path.join(sys.argv[1], "failed")
    if os.environ["PHALANX_RANK"] == "1":
        try:
            raise ValueError("the cause")
        except ValueError:
            traceback.print_exc()
        open(marker, "w").close()
        time.sleep(1.5)
        sys.exit(3)
    while not os.path.exists(marker):
        time.sleep(0.02)
    time.sleep(0.5)
    raise ConnectionError("peer rank 1 is gone")
"""


# Rank 1, the cause, is killed with SIGKILL; rank 0's traceback about the broken connection reaches
# the launcher first (as when a busy host delays reaping the dead one), and rank 0 takes a second to
# tear down before it exits.
KILLED_AFTER_ITS_PEER_NOTICED = """\
    import os, signal, sys, time, traceback
    noticed = os.path.join(sys.argv[1], "noticed")
    if os.environ["PHALANX_RANK"] == "1":
        while not os.path.exists(noticed):
            time.sleep(0.02)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        raise ConnectionError("peer rank 1 is gone")
    except ConnectionError:
        traceback.print_exc()
    sys.stderr.flush()
    open(noticed, "w").close()
    time.sleep(1.0)
    sys.exit(1)
"""


def test_a_worker_killed_with_sigkill_is_named_as_the_cause_even_when_reaped_after_its_peer(tmp_path: Path) -> None:
    script = write_script(tmp_path, "killed.py", KILLED_AFTER_ITS_PEER_NOTICED)
    result = run_phalanx("-n", "2", str(script), str(tmp_path), cwd=tmp_path)
    assert "phalanx run: worker rank 1 (pid" in result.stderr and "failed with signal SIGKILL" in result.stderr, \
        result.stderr


def test_the_first_traceback_is_shown_once_and_the_others_in_one_line(tmp_path: Path) -> None:
    script = write_script(tmp_path, "cause.py", CAUSE_EXITS_LAST)
    result = run_phalanx("-n", "2", str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("Traceback") == 1 and "[1] ValueError: the cause" in result.stderr, result.stderr
    assert "worker rank 1 (pid" in result.stderr and "failed with exit code 3: ValueError: the cause" in result.stderr
    assert result.stderr.endswith("\n  [0] exit code 1: ConnectionError: peer rank 1 is gone\n"), result.stderr


def test_a_launcher_that_looks_late_still_holds_back_the_cause_until_it_exits(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher loads PyTorch (for the store) while its workers already run: on a busy host it
    # may look at them only after both ended. Rank 1's traceback, 1.5 s before its exit, is still the cause.
    from phalanx.cli import launcher

    served = launcher.host_store
    monkeypatch.setattr(launcher, "host_store", lambda *args: (time.sleep(launcher.HOLD_S + 1.5), served(*args))[1])
    script = write_script(tmp_path, "cause.py", CAUSE_EXITS_LAST)
    out, err = io.StringIO(), io.StringIO()
    config = LaunchConfig(target=str(script), nproc_per_node=2, args=(str(tmp_path),), timeout_s=60)
    with monkeypatch.context() as env:
        for key, value in worker_env().items():
            env.setenv(key, value)
        result = launcher.Supervisor(config, out, err).run()
    assert result.exit_code == 3, err.getvalue()
    assert err.getvalue().count("Traceback") == 1 and "[1] ValueError: the cause" in err.getvalue(), err.getvalue()
    assert "worker rank 1" in result.describe() and "ValueError: the cause" in result.describe(), result.describe()


def test_workers_ignoring_sigterm_are_killed_with_their_children(tmp_path: Path) -> None:
    script = write_script(tmp_path, "stubborn.py", STUBBORN)
    pids = tmp_path / "pids"
    pids.mkdir()
    started = time.monotonic()
    result = run_phalanx("-n", "2", "--grace", "1", str(script), str(pids), cwd=tmp_path)
    assert time.monotonic() - started < 15
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "rank 0" in result.stderr and "signal SIGKILL" in result.stderr
    assert_all_gone(read_pids(pids, 4, within_s=0))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_stops_every_worker(tmp_path: Path, signum: int) -> None:
    script = write_script(tmp_path, "sleep.py", SLEEP)
    launcher = warm.Popen(phalanx_command("-n", "2", str(script), str(tmp_path)), cwd=tmp_path,
                          env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = read_pids(tmp_path, 2)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    assert f"received {signal.Signals(signum).name}" in stderr
    assert_all_gone(pids)


def test_ctrl_c_at_a_terminal_stops_the_workers_through_the_launcher(tmp_path: Path) -> None:
    # a terminal's Ctrl-C reaches the launcher's whole process group, its fork server included: the
    # server must leave stopping the workers to the launcher, not take them down with it (SIGKILL)
    script = write_script(tmp_path, "sleep.py", "import signal, sys\n"
                          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(print('stopped by SIGTERM', flush=True)))\n"
                          + textwrap.dedent(SLEEP))
    launcher = warm.Popen(phalanx_command("-n", "2", str(script), str(tmp_path)), cwd=tmp_path,
                          env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    try:
        pids = read_pids(tmp_path, 2)
        os.killpg(launcher.pid, signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT and "received SIGINT" in stderr, stderr
    assert stdout.count("stopped by SIGTERM") == 2, stdout + stderr  # stopped by the launcher, not killed
    assert_all_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_killed_launcher_leaves_no_orphans(tmp_path: Path) -> None:
    script = write_script(tmp_path, "sleep.py", SLEEP)
    launcher = warm.Popen(phalanx_command("-n", "2", str(script), str(tmp_path)), cwd=tmp_path,
                          env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = read_pids(tmp_path, 2)
    finally:
        launcher.kill()
        launcher.wait(LAUNCH_TIMEOUT_S)
    assert_all_gone(pids)


def test_px_init_sees_the_launched_world(tmp_path: Path) -> None:
    script = write_script(tmp_path, "init.py", """\
        import torch
        torch.set_num_threads(1)
        import phalanx as px
        px.init()
        print(px.rank(), px.size())
        px.shutdown()
    """)
    result = run_phalanx("-n", "3", "--timeout", "60", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{r}] {r} 3" for r in range(3)]


def test_bad_arguments_exit_2_without_traceback(tmp_path: Path) -> None:
    result = run_phalanx("-n", "0", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "-n must be at least 1" in result.stderr and "Traceback" not in result.stderr


# ---- the command line, in process -----------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["run", "-n", "2", "missing.py"], "script 'missing.py' not found"),
    (["run", "-n", "2", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found"),
    (["run", "-n", "2", "-m", "train.py"], "-m takes a dotted module name"),
    (["run", "-n", "2"], "nothing to run"),
    (["run", "-n", "two", "train.py"], "invalid int value"),
    (["run", "--master-port", "70000", "train.py"], "--master-port must be within 0-65535"),
    (["run", "--grace", "-1", "train.py"], "--grace must be 0 or more"),
    (["run", "--timeout", "0", "train.py"], "--timeout must be a positive"),
    (["run", "--bogus", "train.py"], "unrecognized arguments: --bogus"),
    (["fly"], "invalid choice"),
])
def test_bad_arguments(argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    assert "--no-prefix" in capsys.readouterr().out


def test_split_run_argv_leaves_the_script_arguments_alone() -> None:
    values = build_parser()[1].values
    assert split_run_argv(["-n", "2", "t.py", "-n", "5", "--", "x"], values) == (
        ["-n", "2"], ["t.py", "-n", "5", "--", "x"])
    assert split_run_argv(["-n3", "-m", "pkg.mod", "--lr", "1"], values) == (
        ["-n3", "-m"], ["pkg.mod", "--lr", "1"])
    assert split_run_argv(["--grace=1", "--", "-odd.py"], values) == (["--grace=1"], ["-odd.py"])
    assert split_run_argv(["--no-prefix"], values) == (["--no-prefix"], [])


def test_worker_environment() -> None:
    config = LaunchConfig(target="t.py", nproc_per_node=2, nnodes=2, node_rank=1, timeout_s=30)
    spec = config.worker_specs(master_port=1234)[1]
    env = spec.environment({"OMP_NUM_THREADS": "4", "HOME": "/h"})
    assert (spec.rank, spec.local_rank, spec.world_size) == (3, 1, 4)
    expected = {"PHALANX_RANK": "3", "RANK": "3", "PHALANX_WORLD_SIZE": "4", "WORLD_SIZE": "4",
                "PHALANX_LOCAL_RANK": "1", "LOCAL_RANK": "1", "PHALANX_LOCAL_WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "PHALANX_NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1234", "PHALANX_STORE_HOSTED": "1", "PYTHONUNBUFFERED": "1",
                "PHALANX_TIMEOUT": "30", "OMP_NUM_THREADS": "4", "HOME": "/h",
                "PHALANX_INTERACTIVE": "1" if sys.stdout.isatty() else "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "phalanx-1234",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",
                "PHALANX_SERVERS": "0", "PHALANX_JOB_ID": job_id(),
                "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
                "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": socket.gethostname()}
    assert env == expected
    assert job_id().startswith(f"{os.getpid()}-") and len(job_id().split("-")[1]) == 16  # 64 random bits
    assert spec.command == (sys.executable, WORKER_MAIN, "t.py")
    assert LaunchConfig(target="t.py").worker_specs(1)[0].environment({})["OMP_NUM_THREADS"] == "1"


def test_split_lines_keeps_lines_whole() -> None:
    assert split_lines(b"a\nb\r\nc") == ([b"a\n", b"b\r\n"], b"c")
    assert split_lines(b"10%\r20%\r") == ([b"10%\r"], b"20%\r")  # the last \r may precede a \n
    lines, rest = split_lines(b"x" * (1 << 16))
    assert lines == [b"x" * (1 << 16) + b"\n"] and rest == b""


def test_exit_codes() -> None:
    assert exit_code_of(3) == 3 and exit_code_of(-signal.SIGKILL) == 137
    assert describe_exit(137) == "signal SIGKILL (exit code 137)"
    assert describe_exit(3) == "exit code 3"


def test_parameter_servers_get_their_role_and_a_rank_beyond_the_workers() -> None:
    config = LaunchConfig(target="t.py", nproc_per_node=2, nnodes=2, node_rank=1, servers_per_node=1)
    (server,) = config.server_specs(master_port=1234)
    env = server.environment({})
    assert (server.label, server.name, server.rank) == ("s1", "parameter server 1", 5)
    assert {key: env[key] for key in ("PHALANX_ROLE", "PHALANX_SERVER_RANK", "PHALANX_SERVERS", "PHALANX_RANK",
                                      "PHALANX_WORLD_SIZE")} == {
        "PHALANX_ROLE": "server", "PHALANX_SERVER_RANK": "1", "PHALANX_SERVERS": "2", "PHALANX_RANK": "5",
        "PHALANX_WORLD_SIZE": "4"}
    assert "RANK" not in env  # not a torch.distributed rank
    assert config.worker_specs(1234)[0].environment({})["PHALANX_SERVERS"] == "2"


def test_parameter_servers_need_a_fixed_set_of_hosts() -> None:
    with pytest.raises(ConfigurationError, match="fixed set of hosts"):
        LaunchConfig(target=__file__, nnodes=1, max_nnodes=2, master_port=1, servers_per_node=1).validate()


def test_what_a_worker_forked_and_left_running_ends_with_it(tmp_path: Path) -> None:
    """The launcher owns a worker's children: a script that forks a child and exits 0 does not leave
    it running after the job (nor does the child's copy of the output pipes hold the launcher up)."""
    write_script(tmp_path, "forks.py", """
        import os, sys, time
        child = os.fork()
        if child == 0:  # the child outlives its parent, holding the worker's stdout and stderr
            time.sleep(120)
            os._exit(0)
        open(f"child-{os.environ['PHALANX_RANK']}.pid", "w").write(str(child))
        print("forked", child, flush=True)
    """)
    started = time.monotonic()
    done = run_phalanx("-n", "2", "forks.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30, "the launcher waited for the children"
    for rank in (0, 1):
        pid = int((tmp_path / f"child-{rank}.pid").read_text())
        deadline = time.monotonic() + 5
        while is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(pid), f"rank {rank}'s child {pid} outlived the job"
