"""Shared fixtures: every test starts and ends outside any phalanx job; two hosts on one machine."""

import os
import shutil
import subprocess

import pytest
import torch

import phalanx as px


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
