"""``phalanx tune --storage postgresql://...``: two searches share a study on a real PostgreSQL server.

The test starts its own server (initdb + pg_ctl, trust authentication on 127.0.0.1, in a
temporary folder) where the Debian package ``postgresql`` is installed, and skips elsewhere.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.tune.storage import load_study
from phalanx.tune.study import counted
from tests.cli.test_launcher import worker_env
from tests.tune.test_search import HERE, tune_command, write_space
from tests import warm

SERVER_BINARIES = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _as_server_user(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its programs as the `postgres` user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture
def postgres_url() -> Iterator[str]:
    if not SERVER_BINARIES:
        pytest.skip("no PostgreSQL server here: install the Debian package `postgresql` (apt-get install postgresql) "
                    "to run this test")
    pytest.importorskip("psycopg2", reason="the PostgreSQL driver is missing: pip install psycopg2-binary")
    binaries = Path(SERVER_BINARIES[-1])
    folder = Path(tempfile.mkdtemp(prefix="phalanx-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    data, port = folder / "data", _free_port()
    try:
        subprocess.run(_as_server_user([str(binaries / "initdb"), "-D", str(data), "-U", "postgres",
                                        "--auth=trust"]), check=True, capture_output=True, timeout=120)
        subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w",
                                        "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start"]),
                       check=True, capture_output=True, timeout=120)
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_server_user([str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")
def test_two_searches_share_a_postgresql_study(tmp_path: Path, postgres_url: str) -> None:
    space = write_space(tmp_path)
    searches = [warm.Popen(tune_command("--space", space, "--trials", "4", "--metric", "loss", "--pruner", "none",
                                        "--storage", postgres_url, "--study-dir", f"host{k}",
                                        str(HERE / "objective.py")),
                           cwd=tmp_path, env=worker_env(OBJECTIVE_SLEEP="0.2"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for k in range(2)]
    outputs = [search.communicate(timeout=180)[0] for search in searches]
    assert [search.returncode for search in searches] == [0, 0], outputs
    finished = counted(load_study(postgres_url, "objective"))
    assert len(finished) == 4 and all(t.state.name == "COMPLETE" for t in finished)
