"""Shared fixtures: every test starts and ends outside any phalanx job; two hosts on one machine.

The suite is a CPU suite wherever it runs: GPUs are hidden from this process and every process it
starts (before anything asks CUDA), so a GPU machine runs the same tests as CI. Tests marked
``cuda`` (tests/test_cuda.py) start their jobs with the GPUs visible again, and skip without one.
"""

import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile

VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")  # as the user set it, for the cuda tests
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Every launcher of the suite's multi-node jobs holds the same secret, as a user gives it to all
# nodes; tests/cli/test_security.py takes it away or changes it where that is the point.
os.environ["PHALANX_SECRET"] = "5ec2e7" * 8

import pytest  # noqa: E402  (after hiding the GPUs)
import torch  # noqa: E402

try:
    import phalanx as px  # noqa: E402
except ModuleNotFoundError as missing:
    raise pytest.UsageError(
        f"the suite cannot import phalanx with {sys.executable} ({missing}): install it into this interpreter "
        "(pip install -e . from the clone, as `make test` does), or put the clone's src/ on PYTHONPATH.") from None


def pytest_report_header(config: pytest.Config) -> str:
    """Which phalanx the suite tests and how the workers its tests start (fresh interpreters) find it."""
    where = os.path.dirname(os.path.dirname(px.__file__))
    searched = [os.path.realpath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if os.path.realpath(where) in searched:
        return f"phalanx from {where}, on PYTHONPATH (the tests' workers find it there too)"
    try:
        return f"phalanx {importlib.metadata.version('phalanx')} from {where}, installed in {sys.prefix}"
    except importlib.metadata.PackageNotFoundError:
        return (f"phalanx from {where}: neither installed nor on PYTHONPATH, so the workers the tests start (fresh "
                "interpreters) will not find it: pip install -e . (as `make test` does), or set PYTHONPATH")


def gpu_environment(base: dict[str, str]) -> dict[str, str]:
    """``base`` with the GPUs visible as they were before the suite hid them."""
    env = dict(base)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if VISIBLE_GPUS is not None:
        env["CUDA_VISIBLE_DEVICES"] = VISIBLE_GPUS
    return env


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """The GPUs a fresh process sees (this one hid them), asked once (not at all without a driver)."""
    if not os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is None:
        return 0
    asked = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           env=gpu_environment(dict(os.environ)), capture_output=True, text=True, timeout=120)
    return int(asked.stdout.strip() or 0) if asked.returncode == 0 else 0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``cuda`` tests where no GPU is visible; the others run the same everywhere. Under
    pytest-xdist (``-n N --dist loadgroup``), the tests on the session's Ray cluster share one worker,
    which starts that cluster once; they are the suite's longest (about 150 s together), so they go
    first, while the other workers share the rest (last, they ran alone for minutes). The next
    longest, 5-30 s each (jobs on two network namespaces, the examples), follow them, so that the
    suite ends on short tests and no worker waits long for the last one."""
    if config.pluginmanager.hasplugin("xdist"):
        on_ray = [item for item in items if "ray_cluster" in getattr(item, "fixturenames", ())]
        for item in on_ray:
            item.add_marker(pytest.mark.xdist_group("ray"))
        long = [item for item in items if item not in on_ray and
                ("two_hosts" in getattr(item, "fixturenames", ()) or item.path.name == "test_examples.py")]
        items[:] = on_ray + long + [item for item in items if item not in on_ray and item not in long]
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if cuda and gpu_count() == 0:
        for item in cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.device_count() is 0 here"))


@pytest.fixture(autouse=True)
def _no_leftover_job():
    torch.set_num_threads(1)
    yield
    px.shutdown()


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Two network namespaces, 198.18.0.1 and 198.18.0.2 on a veth pair; always deleted afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    tag = f"px{os.getpid() % 100000}"
    hosts = [f"{tag}a", f"{tag}b"]
    links = [f"{tag}va", f"{tag}vb"]
    try:
        for host in hosts:
            created = ip("netns", "add", host)
            if created.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {created.stderr.strip()}")
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for host, link, address in zip(hosts, links, ("198.18.0.1/24", "198.18.0.2/24")):
            steps += [("link", "set", link, "netns", host), ("-n", host, "addr", "add", address, "dev", link),
                      ("-n", host, "link", "set", link, "up"), ("-n", host, "link", "set", "lo", "up")]
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair: ip {' '.join(step)}: {done.stderr.strip()}")
        yield hosts
    finally:
        for host in hosts:
            ip("netns", "del", host)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray cluster of 2 CPUs for the suite's Ray tests (started once: about 5 s), with its
    own token; yields the environment a driver connects with (``RAY_ADDRESS`` set). Skips where
    Ray is not installed (``pip install 'phalanx[ray]'``; ``make test`` installs it)."""
    pytest.importorskip("ray.train", reason="Ray is not installed: pip install 'phalanx[ray]'")
    folder = tmp_path_factory.mktemp("ray")
    session = tempfile.mkdtemp(prefix="pxray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token = folder / "token"
    token.write_text(os.urandom(32).hex())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5")  # Ray Train notices an ended or dead worker sooner (2 s)
    port = _free_port()
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                             "--include-dashboard=false", f"--temp-dir={session}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        ready = subprocess.run([sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert ready.returncode == 0, ready.stderr[-3000:]
        yield env
    finally:
        # `ray start --block` stops its cluster in about 1 s on SIGINT, when it does: at the suite's end it
        # sometimes waited out the whole 30 s here, so its process group is killed after 5.
        os.killpg(head.pid, 2)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
            head.wait()
        shutil.rmtree(session, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
