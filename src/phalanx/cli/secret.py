"""The launcher's part in the job secret (:mod:`phalanx.comm.auth`): find or make it, prove it.

Node 0 uses the secret the user gave, or makes one; when other nodes may join (``--nnodes`` above
1) it keeps a made one in an owner-only file under ``~/.phalanx/secrets`` and says, in one line,
how to hand that file to them. It seals the job's name into the store; a launcher of another node
can open it only with the same secret, and otherwise stops with a message saying how to get it.
Its own workers get the secret through their environment.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

from phalanx.comm import auth
from phalanx.comm.membership import Keys
from phalanx.errors import AuthenticationError, ConfigurationError

JOB_KEY = "phalanx/launch/sealed-job"  # node 0's sealed job name: proof for the other nodes that they hold its secret
SECRETS_DIR = Path.home() / ".phalanx" / "secrets"


def resolve(hosts_store: bool, other_nodes: bool, log: Callable[[str], None]) -> tuple[auth.JobSecret, Path | None]:
    """The job's secret on this node, and the file node 0 saved a made one in (to remove at the end)."""
    given = auth.from_environment()
    if given is not None:
        return given, None
    secret = auth.JobSecret.generate()  # on another node: one that cannot prove anything (refused below)
    if not (hosts_store and other_nodes):
        return secret, None
    path = auth.write_file(secret, SECRETS_DIR)
    log(f"phalanx run: this job's secret is in {path} (owner-only); start the other nodes with "
        f"{auth.SECRET_FILE_ENV}={path} (on a shared filesystem, or copied over a trusted channel).")
    return secret, path


def publish(store: Any, secret: auth.JobSecret, job: str) -> None:
    """Node 0: seal the job's name into the store."""
    store.set(JOB_KEY, secret.seal(JOB_KEY, job))


def prove(store: Any, secret: auth.JobSecret, node_rank: int, elastic: bool) -> None:
    """Another node: announce this node (sealed) and check node 0's sealed job name with our secret."""
    if elastic:  # node 0's coordinator reads it, and warns if it does not carry the secret
        hello = {"type": "hello", "node": node_rank, "host": socket.gethostname()}
        store.queue_push(Keys.INBOX, secret.seal(Keys.INBOX, json.dumps(hello)))
    try:
        secret.open(JOB_KEY, store.get(JOB_KEY))
    except AuthenticationError:
        raise ConfigurationError(
            f"node {node_rank}: node 0 of this job did not accept this node: it does not hold the job's secret. "
            f"Give it as {auth.SECRET_FILE_ENV}=<the file node 0 named when it started> or {auth.SECRET_ENV}=<the "
            "secret>, the same on every node.") from None
