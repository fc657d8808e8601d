"""A channel to a parameter server whose peer dies part-way through a message fails at once,
naming the peer, not at the timeout (Gloo holds such a transfer until then)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.comm.channel import Channel, ChannelClosed

SRC = Path(__file__).resolve().parents[2] / "src"
MESSAGE = 32 << 20  # bytes: more than a connection holds, so the send waits part-way when the peer stops

PEER = textwrap.dedent("""
    import datetime, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    from phalanx.comm.channel import Channel
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
    channel = Channel(store, "test/1", 0, 30.0, "worker 1")
    threading.Thread(target=channel.recv, args=([torch.empty(int(sys.argv[2]) // 4)], 7), daemon=True).start()
    time.sleep(0.3)  # the receive posted: the sender's bytes flow, until this process stops reading them
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def test_a_send_cut_part_way_by_the_peers_death_fails_at_once_naming_it() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH", "")]))}
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), str(MESSAGE)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        channel = Channel(store, "test/1", 1, 30.0, "parameter server 0")
        assert peer.stdout is not None and peer.stdout.readline().strip() == "stopping"
        threading.Timer(1.0, peer.send_signal, (signal.SIGKILL,)).start()  # stopped with the send part-way
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="could not send to parameter server 0"):
            channel.send([torch.ones(MESSAGE // 4)], 7)
        assert time.monotonic() - started < 10.0  # the timeout is 30 s
        channel.close()
    finally:
        peer.kill()
        peer.wait()
