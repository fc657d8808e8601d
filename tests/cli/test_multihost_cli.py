"""``phalanx run`` across hosts and in elastic mode: arguments, store binding, and failure propagation."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.cli.config import LaunchConfig
from phalanx.cli.network import bind_store, host_store, interface_towards, is_loopback
from phalanx.cli.main import main, parse_nnodes
from tests.cli.test_launcher import phalanx_command, worker_env, write_script
from tests import warm

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the launcher uses POSIX process groups")


def test_parse_nnodes() -> None:
    assert parse_nnodes("2") == (2, None)
    assert parse_nnodes("1:4") == (1, 4)


@pytest.mark.parametrize("argv, message", [
    (["run", "--nnodes", "two", "train.py"], "--nnodes takes a number of hosts or a range"),
    (["run", "--nnodes", "3:2", "train.py"], "is not a valid range"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--master-port", "1234", "train.py"], "node rank 2 is not within 2"),
    (["run", "--nnodes", "2", "train.py"], "a multi-host launch needs --master-port"),
    (["run", "-n", "2", "--min-workers", "3", "train.py"], "--min-workers must be between 1 and the job's 2"),
    (["run", "-n", "2", "--min-workers", "1", "--heartbeat-timeout", "0", "train.py"], "--heartbeat-timeout must be"),
])
def test_bad_multihost_arguments(argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_elastic_configuration() -> None:
    config = LaunchConfig(target="t.py", nproc_per_node=2, nnodes=1, max_nnodes=3, node_rank=2, master_port=1)
    assert config.elastic and config.world_size == 6 and config.min_world_size == 2
    spec = config.worker_specs(master_port=1)[1]
    assert (spec.rank, spec.world_size) == (5, 6)
    assert spec.variables["PHALANX_ELASTIC"] == "1"
    assert LaunchConfig(target="t.py", nproc_per_node=4, min_workers=2).min_world_size == 2
    assert LaunchConfig(target="t.py", timeout_s=8, min_workers=1).effective_heartbeat_timeout_s == 4
    assert LaunchConfig(target="t.py", min_workers=1).effective_heartbeat_timeout_s == 30
    plain = LaunchConfig(target="t.py", nproc_per_node=2)
    assert not plain.elastic
    assert "PHALANX_ELASTIC" not in plain.worker_specs(1)[0].variables


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_the_store_listens_on_loopback_only_by_default() -> None:
    store = host_store("127.0.0.1", bind_store("127.0.0.1", 0), 10)
    assert _listeners(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("198.18.0.1") and not is_loopback("node0.example")
    if sys.platform.startswith("linux"):
        assert interface_towards("127.0.0.1") in ("lo", None)


FAIL_ON_NODE_1 = """\
    import os, sys, time
    open(os.path.join(sys.argv[1], os.environ["PHALANX_RANK"] + ".pid"), "w").write(str(os.getpid()))
    if os.environ["PHALANX_NODE_RANK"] == "1":
        time.sleep(1)
        sys.exit(3)
    time.sleep(1000)
"""


def test_a_failure_on_one_host_stops_every_host(tmp_path: Path) -> None:
    from tests.cli.test_launcher import assert_all_gone, read_pids
    from tests.elastic.launch import free_port

    script = write_script(tmp_path, "fail.py", FAIL_ON_NODE_1)
    common = ["-n", "1", "--nnodes", "2", "--master-port", str(free_port()), "--grace", "1"]
    launchers = [warm.Popen(phalanx_command(*common, "--node-rank", str(node), str(script), str(tmp_path)),
                            cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for node in (0, 1)]
    try:
        started = time.monotonic()
        outputs = [launcher.communicate(timeout=60) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert time.monotonic() - started < 30
    assert [launcher.returncode for launcher in launchers] == [3, 3], outputs
    assert "worker rank 1 on node 1 failed with exit code 3" in outputs[0][1]
    assert "worker rank 1 (pid" in outputs[1][1] and "exit code 3" in outputs[1][1]
    assert_all_gone(read_pids(tmp_path, 2, within_s=0))


LOSE_RANK_1 = """\
    import os, sys, time
    open(os.path.join(sys.argv[1], os.environ["PHALANX_RANK"] + ".pid"), "w").write(str(os.getpid()))
    if os.environ["PHALANX_RANK"] == "1":
        print("rank 1 gives up", file=sys.stderr)
        sys.exit(3)
    time.sleep(2)
"""


def test_elastic_launcher_survives_a_lost_worker(tmp_path: Path) -> None:
    script = write_script(tmp_path, "lose.py", LOSE_RANK_1)
    result = warm.run(phalanx_command("-n", "3", "--min-workers", "2", str(script), str(tmp_path)),
                      cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "worker rank 1 (pid" in result.stderr and "was lost: exit code 3: rank 1 gives up;" in result.stderr
    assert "[1] rank 1 gives up" in result.stderr and "the elastic job completed" in result.stderr
    assert "---- last" not in result.stderr  # its stderr is shown once, live


def test_elastic_launcher_stops_every_worker_on_sigterm(tmp_path: Path) -> None:
    from tests.cli.test_launcher import SLEEP, assert_all_gone, read_pids

    script = write_script(tmp_path, "sleep.py", SLEEP)
    launcher = warm.Popen(phalanx_command("-n", "2", "--min-workers", "1", str(script), str(tmp_path)),
                          cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    try:
        pids = read_pids(tmp_path, 2)
        launcher.send_signal(15)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr
    assert_all_gone(pids)
