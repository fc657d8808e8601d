"""What ``phalanx run`` launches: the job's shape, each worker's command and environment, validation."""

from __future__ import annotations

import functools
import importlib.util
import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from phalanx.cli.network import DEFAULT_STORE_TIMEOUT_S, interface_towards, is_loopback
from phalanx.comm.devices import check_gpus, visible_gpus
from phalanx.comm.environment import DEVICE_ENV, ELASTIC_ENV, JOB_ENV, TIMEOUT_ENV
from phalanx.errors import ConfigurationError

WORKER_MAIN = str(Path(__file__).with_name("worker_main.py"))
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_GRACE_S = 5.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------
# What to launch
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker: its place in the job, its command, its variables.

    ``variables`` holds only what the launcher adds; :meth:`environment` layers it on top of the
    launcher's own environment.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    command: tuple[str, ...]
    variables: Mapping[str, str] = field(default_factory=dict)
    server: int | None = None  # this process's index among the job's parameter servers, if it is one

    @property
    def label(self) -> str:
        """The prefix of its output lines: the worker's rank, or ``s1`` for parameter server 1."""
        return str(self.rank) if self.server is None else f"s{self.server}"

    @property
    def name(self) -> str:
        """``worker rank 3`` or ``parameter server 1``, for the launcher's messages."""
        return f"worker rank {self.rank}" if self.server is None else f"parameter server {self.server}"

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The worker's full environment: ``base`` plus the launcher's variables."""
        env = WorkerSpec.shared_environment(base)
        env.update(self.variables)
        return env

    @staticmethod
    def shared_environment(base: Mapping[str, str]) -> dict[str, str]:
        """What every worker's environment holds before its own variables (the fork server's):
        ``base`` with ``OMP_NUM_THREADS`` defaulting to 1, so N workers do not oversubscribe the cores,
        and unbuffered output, so the launcher relays each line as it is written."""
        env = dict(base)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        return env


@dataclass(frozen=True)
class LaunchConfig:
    """What ``phalanx run`` was asked to do. Validated by :meth:`validate` before anything starts.

    ``nnodes`` and ``node_rank`` describe a multi-host job: one launcher per host, each starting
    ``nproc_per_node`` workers. The job is *elastic* when ``min_workers`` or ``max_nnodes`` is set
    (``--min-workers K``, ``--nnodes MIN:MAX``): it survives lost workers while at least
    ``min_workers`` remain, and admits workers started later, up to ``nproc_per_node * max_nnodes``.
    """

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    timeout_s: float | None = None
    grace_s: float = DEFAULT_GRACE_S
    prefix_output: bool = True
    fork_server: bool = True  # workers forked from a process that imported torch once (cli/forkserver.py)
    max_nnodes: int | None = None
    min_workers: int | None = None
    heartbeat_timeout_s: float | None = None
    servers_per_node: int = 0
    hostname: str | None = None  # this host's name in -H/--hostfile (HOROVOD_HOSTNAME)
    device: str = "auto"  # --device: "cuda", "cpu" or "auto" (GPUs when visible), see phalanx.comm.devices

    @property
    def num_servers(self) -> int:
        """Parameter-server processes in the whole job (``--servers S`` on each of the hosts)."""
        return self.servers_per_node * self.nnodes

    @property
    def local_processes(self) -> int:
        """The processes this launcher starts: its workers and its parameter servers."""
        return self.nproc_per_node + self.servers_per_node

    @property
    def elastic(self) -> bool:
        """Whether lost workers are survived and new ones admitted (``--min-workers``, ``--nnodes MIN:MAX``)."""
        return self.min_workers is not None or self.max_nnodes is not None

    @property
    def max_nodes(self) -> int:
        return self.max_nnodes if self.max_nnodes is not None else self.nnodes

    @property
    def world_size(self) -> int:
        """The number of workers in the whole job, over all hosts (elastic: at most)."""
        return self.nproc_per_node * self.max_nodes

    @property
    def min_world_size(self) -> int:
        """The fewest workers an elastic job goes on with."""
        return self.min_workers if self.min_workers is not None else self.nproc_per_node * self.nnodes

    @property
    def effective_heartbeat_timeout_s(self) -> float:
        """How long an elastic worker may stay silent before it is declared dead and killed."""
        if self.heartbeat_timeout_s is not None:
            return self.heartbeat_timeout_s
        return min(0.5 * (self.timeout_s or DEFAULT_STORE_TIMEOUT_S), DEFAULT_HEARTBEAT_TIMEOUT_S)

    @property
    def hosts_store(self) -> bool:
        """Whether this launcher hosts the rendezvous store (the launcher of node 0 does)."""
        return self.node_rank == 0

    def validate(self) -> None:
        """Raise :class:`ConfigurationError`, naming the fix, if this launch cannot work."""
        self._validate_counts()
        self._validate_network()
        self._validate_target()
        self._validate_devices()

    def command(self) -> tuple[str, ...]:
        """The command every worker runs: this Python interpreter on the script or module.

        The target runs under :mod:`phalanx.cli.worker_main`, which ends the process cleanly.
        """
        target = ("-m", self.target) if self.is_module else (self.target,)
        return (sys.executable, WORKER_MAIN, *target, *self.args)

    def worker_specs(self, master_port: int) -> list[WorkerSpec]:
        """One spec per local worker; global ranks follow ``node_rank * nproc_per_node + local_rank``."""
        return [self._worker_spec(local_rank, master_port) for local_rank in range(self.nproc_per_node)]

    def server_specs(self, master_port: int) -> list[WorkerSpec]:
        """One spec per local parameter server (``--servers``); their indices follow the node rank.

        A server runs the same command as the workers with ``PHALANX_ROLE=server``; its
        ``px.rank()`` is the job's worker count plus its index, so ``px.rank() == 0`` stays one worker.
        """
        specs = []
        for local in range(self.servers_per_node):
            server = self.node_rank * self.servers_per_node + local
            variables = self._common_variables(master_port)
            variables.update(PHALANX_ROLE="server", PHALANX_SERVER_RANK=str(server),
                             PHALANX_RANK=str(self.world_size + server), PHALANX_WORLD_SIZE=str(self.world_size),
                             PHALANX_LOCAL_RANK=str(self.nproc_per_node + local),
                             PHALANX_LOCAL_WORLD_SIZE=str(self.nproc_per_node))
            specs.append(WorkerSpec(rank=self.world_size + server, local_rank=self.nproc_per_node + local,
                                    world_size=self.world_size, local_world_size=self.nproc_per_node,
                                    node_rank=self.node_rank, command=self.command(), variables=variables,
                                    server=server))
        return specs

    def _worker_spec(self, local_rank: int, master_port: int) -> WorkerSpec:
        rank = self.node_rank * self.nproc_per_node + local_rank
        return WorkerSpec(
            rank=rank,
            local_rank=local_rank,
            world_size=self.world_size,
            local_world_size=self.nproc_per_node,
            node_rank=self.node_rank,
            command=self.command(),
            variables=self._worker_variables(rank, local_rank, master_port),
        )

    def _worker_variables(self, rank: int, local_rank: int, master_port: int) -> dict[str, str]:
        """The phalanx variables, plus torch's ``env://`` ones so plain torch.distributed code works."""
        layout = {"RANK": rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": local_rank,
                  "LOCAL_WORLD_SIZE": self.nproc_per_node}
        variables = {key: str(value) for key, value in layout.items()}
        variables.update({f"PHALANX_{key}": value for key, value in variables.items()})
        variables.update(self._torchrun_variables(rank, master_port))
        variables.update(self._horovod_variables(rank, local_rank))
        variables.update(self._common_variables(master_port))
        if self.elastic:
            variables[ELASTIC_ENV] = "1"
        if self.device != "auto":
            variables[DEVICE_ENV] = self.device
        return variables

    def _common_variables(self, master_port: int) -> dict[str, str]:
        """What workers and parameter servers alike are told: the store, the node, the servers, the timeout."""
        variables = dict(PHALANX_NODE_RANK=str(self.node_rank), PHALANX_STORE_HOSTED="1",
                         MASTER_ADDR=self.master_addr, MASTER_PORT=str(master_port),
                         PHALANX_INTERACTIVE="1" if sys.stdout.isatty() else "0",
                         PHALANX_SERVERS=str(self.num_servers), **{JOB_ENV: job_id()})
        if self.timeout_s is not None:
            variables[TIMEOUT_ENV] = f"{self.timeout_s:g}"
        if not is_loopback(self.master_addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = interface_towards(self.master_addr)
            if interface:  # Gloo would otherwise pick the address the host name resolves to
                variables["GLOO_SOCKET_IFNAME"] = interface
        return variables

    def _torchrun_variables(self, rank: int, master_port: int) -> dict[str, str]:
        """What torchrun exports besides ``env://``'s variables, so scripts written for it run unchanged.

        ``TORCHELASTIC_USE_AGENT_STORE`` makes torch's ``env://`` rendezvous connect every rank to
        the launcher's store as a client, instead of starting a second server on its port on rank 0.
        """
        return {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": f"phalanx-{master_port}",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "GROUP_RANK": str(self.node_rank), "GROUP_WORLD_SIZE": str(self.max_nodes),
                "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size)}

    def _horovod_variables(self, rank: int, local_rank: int) -> dict[str, str]:
        """What horovodrun's Gloo mode tells each worker, for scripts that read them."""
        layout = {"RANK": rank, "SIZE": self.world_size, "LOCAL_RANK": local_rank,
                  "LOCAL_SIZE": self.nproc_per_node, "CROSS_RANK": self.node_rank, "CROSS_SIZE": self.max_nodes,
                  "HOSTNAME": self.hostname or socket.gethostname()}
        return {f"HOROVOD_{key}": str(value) for key, value in layout.items()}

    def _validate_counts(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigurationError(
                f"-n must be at least 1, got {self.nproc_per_node}: pass how many worker processes "
                "to start, for example `phalanx run -n 4 train.py`."
            )
        if self.nnodes < 1 or self.max_nodes < self.nnodes:
            raise ConfigurationError(
                f"--nnodes {self.nnodes}:{self.max_nodes} is not a valid range: pass N, or MIN:MAX with 1 <= MIN <= MAX."
            )
        if not 0 <= self.node_rank < self.max_nodes:
            raise ConfigurationError(
                f"node rank {self.node_rank} is not within {self.max_nodes} nodes: "
                "pass a node rank from 0 to nnodes - 1."
            )
        if self.min_workers is not None and not 1 <= self.min_workers <= self.world_size:
            raise ConfigurationError(
                f"--min-workers must be between 1 and the job's {self.world_size} workers, got {self.min_workers}."
            )
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s <= 0:
            raise ConfigurationError(
                f"--heartbeat-timeout must be a positive number of seconds, got {self.heartbeat_timeout_s:g}."
            )
        if self.servers_per_node < 0:
            raise ConfigurationError(f"--servers must be 0 or more parameter servers per host, got {self.servers_per_node}.")
        if self.servers_per_node and self.max_nnodes is not None:
            raise ConfigurationError(
                "--servers needs a fixed set of hosts: parameter servers hold the model, so the hosts running "
                "them cannot come and go. Pass --nnodes N (not MIN:MAX); --min-workers still lets workers be lost."
            )
        if self.grace_s < 0:
            raise ConfigurationError(f"--grace must be 0 or more seconds, got {self.grace_s:g}.")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigurationError(f"--timeout must be a positive number of seconds, got {self.timeout_s:g}.")

    def _validate_devices(self) -> None:
        """On GPUs (``--device cuda``, or auto where this host has some), a GPU per worker."""
        if self.device == "cpu":
            return
        gpus = visible_gpus()
        if self.device == "cuda" and gpus == 0:
            raise ConfigurationError("--device cuda, but no GPU usable with NCCL is visible on this host; drop "
                                     "--device cuda (or pass --device cpu) to train on the CPU.")
        if gpus:
            check_gpus(self.nproc_per_node, gpus, f"-n {self.nproc_per_node}")

    def _validate_network(self) -> None:
        if not 0 <= self.master_port <= 65535:
            raise ConfigurationError(
                f"--master-port must be within 0-65535, got {self.master_port}; 0 picks a free port."
            )
        if not self.master_addr:
            raise ConfigurationError("--master-addr is empty: pass the address of the host running node 0.")
        if self.max_nodes > 1 and self.master_port == 0:
            raise ConfigurationError(
                "a multi-host launch needs --master-port: every host's launcher must be told the port of "
                "node 0's rendezvous store, for example --master-port 29500."
            )

    def _validate_target(self) -> None:
        if not self.target:
            raise ConfigurationError(
                "nothing to run: give a script (`phalanx run -n 2 train.py`) "
                "or a module (`phalanx run -n 2 -m package.module`)."
            )
        if self.is_module:
            _check_module(self.target)
        elif not os.path.exists(self.target):
            raise ConfigurationError(
                f"script {self.target!r} not found (from {os.getcwd()}): check the path, "
                "or pass -m to run a module by its dotted name."
            )


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"host1:4,host2:4"`` (horovodrun's -H) as ``[(host, slots), ...]``; a host without ``:slots`` has 1."""
    hosts = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        try:
            count = int(slots)
        except ValueError:
            count = 0
        if not name or count < 1:
            raise ConfigurationError(f"-H takes host:slots entries separated by commas, like host1:4,host2:4; "
                                     f"got {entry!r}.")
        hosts.append((name, count))
    if not hosts:
        raise ConfigurationError("-H names no host: pass host1:slots,host2:slots.")
    return hosts


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """A horovodrun/MPI host file: one host per line, ``host slots=N`` or ``host:N`` (``#`` comments)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as error:
        raise ConfigurationError(f"cannot read the host file {path!r}: {error.strerror}.") from None
    entries = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
        entries.append(f"{words[0]}:{slots}" if slots is not None else words[0])
    return parse_hosts(",".join(entries))


def this_host_index(hosts: list[tuple[str, int]]) -> int:
    """Which entry of ``hosts`` is this machine: its host name, fully qualified name or one of its addresses."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    for index, (host, _) in enumerate(hosts):
        if host in names or (len(hosts) == 1 and is_loopback(host)) or host.split(".")[0] == socket.gethostname():
            return index
    raise ConfigurationError(
        f"this host ({socket.gethostname()}) is not among the hosts {[h for h, _ in hosts]}: name it as its host "
        "name or address, or pass --node-rank to say which entry it is."
    )


@functools.lru_cache(maxsize=None)
def job_id() -> str:
    """This launch's id on this host: the launcher's pid and 64 random bits. It names the workers'
    shared-memory segments, which another user of the host must not be able to guess and pre-create."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def _check_module(name: str) -> None:
    """Fail fast on a module the workers could not import; only the top-level package is looked up."""
    if name.endswith(".py") or os.sep in name:
        raise ConfigurationError(
            f"-m takes a dotted module name, not a file: got {name!r}. "
            f"Drop -m to run a script, or write it as `-m {_module_name_hint(name)}`."
        )
    if not _importable_from_cwd(name.split(".")[0]):
        raise ConfigurationError(
            f"module {name!r} not found: check the name, that its package is installed in "
            f"{sys.executable}, or that it is importable from {os.getcwd()} or $PYTHONPATH."
        )


def _importable_from_cwd(top_level: str) -> bool:
    """Whether ``python -m`` run here would find ``top_level`` (it searches the working directory first).

    Looking up a top-level name imports nothing, so the check has no side effects.
    """
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(top_level) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def _module_name_hint(path: str) -> str:
    stem = path[:-3] if path.endswith(".py") else path
    return stem.strip(os.sep).replace(os.sep, ".")
