"""The control plane authenticates (issue 30): an elastic job attacked the ways an outsider who
reaches its port would, and by another user of the host, finishes with its own result.

One job of node 0 (``--nnodes 1:2``, 2 workers, a secret it made itself: the suite's own
``PHALANX_SECRET`` is removed) is attacked while it runs: a second node without the secret, one
with a wrong secret, a raw store client that pushes a pickle that would create a file when
unpickled into the inbox and other keys, and a replayed sealed message. A legitimate second node
with the secret joins in tests/elastic/test_jobs.py (the suite gives every launcher the same one).
"""

from __future__ import annotations

import datetime
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.cli import secret as job_secret
from phalanx.comm import auth
from phalanx.comm.membership import Keys
from tests.cli.test_launcher import phalanx_command, worker_env
from tests.elastic.launch import free_port
from tests import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")

JOB = """
import os, time, torch, phalanx as px
torch.set_num_threads(1)
px.init()
steps = total = 0
while True:  # until the test's attacks have all landed (it says so with a file), however busy the host
    attacked = float(px.rank() == 0 and os.path.exists("attacks-done"))
    reduced = px.allreduce(torch.tensor([1.0, attacked]))
    steps, total = steps + 1, total + float(reduced[0])
    if reduced[1] > 0 or steps == 1200:
        break
    time.sleep(0.15)
if px.rank() == 0:
    print("result", px.size(), "undisturbed" if total == 2 * steps else f"{total} over {steps} steps", flush=True)
"""


class Payload:
    """Unpickling it would create ``path``: proof that something from the network ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def joiner(tmp_path: Path, port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return warm.run(phalanx_command("-n", "1", "--nnodes", "1:2", "--node-rank", "1", "--master-port",
                                    str(port), "--timeout", "20", "job.py"),
                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_an_elastic_job_refuses_outsiders_and_finishes_with_its_own_result(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    port, marker = free_port(), tmp_path / "ran"
    without_secret = {k: v for k, v in worker_env().items() if k != auth.SECRET_ENV}
    secret_file = auth.write_file(auth.JobSecret.generate(), tmp_path / "secrets")
    node0 = warm.Popen(phalanx_command("-n", "2", "--nnodes", "1:2", "--node-rank", "0", "--master-port",
                                       str(port), "--timeout", "30", "job.py"),
                       cwd=tmp_path, env={**without_secret, auth.SECRET_FILE_ENV: str(secret_file)},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        store.wait([job_secret.JOB_KEY])
        no_secret = joiner(tmp_path, port, without_secret)
        wrong_secret = joiner(tmp_path, port, {**without_secret, auth.SECRET_ENV: "0f" * 32})
        # A raw client: a pickle that would run code, into the inbox and into keys phalanx reads.
        crafted = pickle.dumps(Payload(marker))
        store.queue_push(Keys.INBOX, crafted)
        for key in (Keys.answer(1, 1), Keys.answer(2, 1), Keys.STATUS + "-x", "phalanx/elastic/g0/extra"):
            store.set(key, crafted)
        # A replayed message: sealed with the right secret once (as sniffed off the wire), sent twice.
        secret = auth.read_file(secret_file)
        hello = secret.seal(Keys.INBOX, json.dumps({"type": "hello", "node": 1, "host": "replayed"}))
        store.queue_push(Keys.INBOX, hello)
        store.queue_push(Keys.INBOX, hello)
        deadline = time.monotonic() + 60
        while store.queue_len(Keys.INBOX) and time.monotonic() < deadline:  # the launcher has read them all
            time.sleep(0.05)
        (tmp_path / "attacks-done").touch()
        out, err = node0.communicate(timeout=90)
    finally:
        node0.kill()
    for refused in (no_secret, wrong_secret):
        assert refused.returncode == 2, refused.stderr
        assert "did not accept this node: it does not hold the job's secret" in refused.stderr, refused.stderr
        assert "PHALANX_SECRET_FILE" in refused.stderr
    assert node0.returncode == 0, err
    assert "result 2 undisturbed" in out, out  # every allreduce of ones over 2 workers summed to 2
    assert err.count("refused a message on the job's inbox that does not carry the job's secret") >= 3, err
    assert err.count("refused a replayed message") == 1, err
    assert not marker.exists()
    assert secret.hex() not in out + err + no_secret.stderr + wrong_secret.stderr  # the secret is never printed


def test_forged_heartbeats_and_bumped_generation_counters_decide_nothing(tmp_path: Path) -> None:
    """An outsider writes junk over every member's heartbeat (a value the store cannot add to: it cut the
    coordinator's connection, and the launcher then hung, logging forever) and bumps every generation's
    broken and signal counters (which made members re-form, then killed healthy ones): the job is not
    re-formed, nobody is declared dead, the result is its own, each forged key is reported once."""
    (tmp_path / "job.py").write_text(JOB)  # no px.elastic.run: a single re-form would fail the job
    port = free_port()
    node0 = warm.Popen(phalanx_command("-n", "2", "--min-workers", "1", "--master-port", str(port),
                                       "--timeout", "30", "job.py"),
                       cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        store.wait([Keys.heartbeat(1), Keys.heartbeat(2)])  # both workers beat: training has begun
        for _ in range(10):
            for member in (1, 2, 3):
                store.set(Keys.heartbeat(member), "not-a-number")
            for generation in range(20):
                store.add(Keys.broken(generation), 1)
                store.add(Keys.signal(generation), 1)
            time.sleep(0.2)
        (tmp_path / "attacks-done").touch()
        started = time.monotonic()
        out, err = node0.communicate(timeout=90)
    finally:
        node0.kill()
    assert node0.returncode == 0, err
    assert "result 2 undisturbed" in out, out  # every allreduce summed 2 workers' ones, in one generation throughout
    assert "declared dead" not in err and "re-formed" not in err + out, err
    assert err.count("ignoring the value at phalanx/elastic/heartbeat/1") == 1, err
    assert len(err.splitlines()) < 40 and "Broken pipe" not in err, err
    assert time.monotonic() - started < 30, "the launcher outlived its job"


def test_node_0_makes_a_secret_and_says_where_it_keeps_it_without_printing_it(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("import phalanx as px\npx.init()\n")
    without_secret = {k: v for k, v in worker_env().items() if k != auth.SECRET_ENV}
    done = warm.run(phalanx_command("-n", "1", "--nnodes", "1:2", "--master-port", str(free_port()),
                                    "--timeout", "30", "job.py"),
                    cwd=tmp_path, env=without_secret, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "this job's secret is in" in line]
    assert len(lines) == 1 and f"{auth.SECRET_FILE_ENV}=" in lines[0], done.stderr
    path = Path(lines[0].split(" is in ")[1].split(" ")[0])
    assert path.parent == job_secret.SECRETS_DIR and not path.exists()  # removed when the job ended


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(Exception, match="chmod 600"):
        auth.read_file(path)
    path.chmod(0o600)
    assert auth.read_file(path).hex() == "ab" * 32


def test_a_message_sealed_for_one_place_does_not_open_in_another() -> None:
    secret = auth.JobSecret.generate()
    sealed = secret.seal("phalanx/elastic/answer/1/1", '{"status": "ok"}')
    assert secret.open("phalanx/elastic/answer/1/1", sealed)[0] == b'{"status": "ok"}'
    for place, key in (("phalanx/elastic/answer/2/1", secret), ("phalanx/elastic/answer/1/1", auth.JobSecret.generate())):
        with pytest.raises(auth.AuthenticationError):
            key.open(place, sealed)


def test_shared_memory_names_cannot_be_guessed_and_a_squatter_changes_nothing(tmp_path: Path) -> None:
    """Another user pre-creates the segment names of the next launches' pids (the old names):
    the job still runs, through shared memory, on names of its own."""
    probe = subprocess.Popen([sys.executable, "-c", "pass"])
    probe.wait()
    squatted = [Path(f"/dev/shm/phalanx-{pid}-g0") for pid in range(probe.pid, probe.pid + 400)]
    for path in squatted:
        path.touch(exist_ok=True)
    try:
        (tmp_path / "job.py").write_text(
            "import torch, phalanx as px\npx.init()\nprint('shm', px.communicator().shares_one_host(), "
            "float(px.allreduce(torch.ones(1))[0]), flush=True)\n")
        done = warm.run(phalanx_command("-n", "2", "--timeout", "30", "job.py"), cwd=tmp_path, env=worker_env(),
                        capture_output=True, text=True, timeout=60)
    finally:
        for path in squatted:
            path.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("shm True 2.0") == 2, done.stdout


def test_the_store_of_a_loopback_address_listens_on_loopback_only() -> None:
    from phalanx.cli.network import bind_store, host_store

    for address in ("127.0.0.1", "localhost"):
        store = host_store(address, bind_store(address, 0), 5)
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{store.port}"], capture_output=True, text=True).stdout
        assert listening.strip(), listening
        assert all(local.startswith(("127.", "[::1]", "[::ffff:127.")) for local in
                   (line.split()[3] for line in listening.splitlines())), listening
        del store
        time.sleep(0.1)


LISTENING = """
import json, os, subprocess, torch, phalanx as px
px.init()
px.allreduce(torch.ones(1))
listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
print("listens", json.dumps([line.split()[3] for line in listening.splitlines() if f"pid={os.getpid()}," in line]),
      flush=True)
px.barrier()
"""


def test_a_one_host_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket the workers listen on (Gloo's, shared memory's helpers) stays on loopback."""
    (tmp_path / "job.py").write_text(LISTENING)
    done = warm.run(phalanx_command("-n", "2", "--timeout", "30", "job.py"), cwd=tmp_path, env=worker_env(),
                    capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    addresses = [address for line in done.stdout.splitlines() if "listens" in line
                 for address in json.loads(line.split("listens ", 1)[1])]
    assert addresses and all(address.startswith(("127.", "[::1]", "[::ffff:127.")) for address in addresses), \
        done.stdout


def test_a_forged_rendezvous_value_is_skipped_until_the_real_one_arrives() -> None:
    """torch's own rendezvous goes through a SealedStore: a raw client that writes a worker's
    address key first cannot stand in for it; the real value, once written, is the one read."""
    import threading

    from phalanx.comm.sealed_store import SealedStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    secret = auth.JobSecret.generate()
    sealed = SealedStore(server, secret, timeout_s=3)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    raw.set("g0/rank_1", b"attacker:1234")
    writer = threading.Timer(0.3, lambda: SealedStore(raw.clone(), secret, 3).set("g0/rank_1", b"worker:5678"))
    writer.start()
    assert dist.PrefixStore("g0", sealed).get("rank_1") == b"worker:5678"  # as torch's groups read it
    writer.join()
    raw.set("rank_2", b"attacker:1234")
    with pytest.raises(auth.AuthenticationError):
        SealedStore(server, secret, timeout_s=0.3).get("rank_2")
