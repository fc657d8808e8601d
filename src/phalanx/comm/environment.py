"""How this process was launched: one small class per launch environment, read once.

Each environment reads only variables; :func:`detect` asks them in a fixed order and returns
the first that recognises the process. Adding a scheduler means adding one class here. The
variables phalanx's own launcher adds under any of them (the timeout, the job's id, an elastic
member's id) are read here too, and so are Horovod's (``HOROVOD_*``, kept as they are for
``phalanx.horovod`` to interpret), so this module is the whole launch contract: nothing else in the
package reads a launch variable.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from phalanx.errors import ConfigurationError

DEFAULT_MASTER_PORT = 29500
TIMEOUT_ENV = "PHALANX_TIMEOUT"  # seconds bounding the rendezvous and every collective
JOB_ENV = "PHALANX_JOB_ID"  # the launcher's: names this job's shared-memory segments
ELASTIC_ENV = "PHALANX_ELASTIC"  # "1": an elastic launch, whose coordinator admits members
MEMBER_ENV = "PHALANX_MEMBER_ID"  # this worker's id among an elastic job's members
DEVICE_ENV = "PHALANX_DEVICE"  # "cuda" or "cpu": the launcher's --device (absent: auto)
DEVICES = ("auto", "cuda", "cpu")  # what a launch may say the workers train on (phalanx.comm.devices)
HOROVOD_PREFIX = "HOROVOD_"  # Horovod's variables: read here, interpreted by phalanx.horovod.torch.variables


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, and where the rendezvous store lives.

    ``store_hosted`` is true when the launcher already runs the store and every worker,
    rank 0 included, connects to it as a client (so the store outlives any worker).
    """

    source: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    store_hosted: bool = False
    role: str = "worker"  # or "server": a parameter server (``phalanx run --servers``)
    server_rank: int = -1  # a server's index among the job's servers
    num_servers: int = 0  # parameter servers in the job
    timeout_s: float | None = None  # $PHALANX_TIMEOUT; None: px.init's argument or the default
    job_id: str = ""  # the launcher's job id; empty: the workers agree on one through the store
    elastic_member: int | None = None  # this worker's member id in an elastic launch, else None
    device: str = "auto"  # $PHALANX_DEVICE: "cuda" or "cpu" when the launch chose (phalanx.comm.devices)
    horovod_variables: tuple[tuple[str, str], ...] = ()  # every HOROVOD_* variable (name, value), sorted


class Environment:
    """A launch environment: recognises itself from variables and reads the job layout."""

    name = "environment"

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def detected(self) -> bool:
        raise NotImplementedError

    def info(self) -> LaunchInfo:
        raise NotImplementedError

    def _int(self, key: str, default: int | None = None) -> int:
        value = self.env.get(key)
        if value is None or value == "":
            if default is None:
                raise ConfigurationError(f"{self.name} launch: ${key} is not set; set it or launch with `phalanx run`.")
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigurationError(f"{self.name} launch: ${key}={value!r} is not an integer.") from None

    def _master_port(self, default: int = DEFAULT_MASTER_PORT) -> int:
        return self._int("MASTER_PORT", default)

    def _required_master_addr(self) -> str:
        addr = self.env.get("MASTER_ADDR")
        if not addr:
            raise ConfigurationError(
                f"{self.name} launch: $MASTER_ADDR is not set. Export the address of the host running "
                "rank 0 (for example `-x MASTER_ADDR=host0` with mpirun) so the workers can meet."
            )
        return addr


class PhalanxLauncher(Environment):
    """Started by ``phalanx run``, which also hosts the rendezvous store."""

    name = "phalanx"

    def detected(self) -> bool:
        return "PHALANX_RANK" in self.env

    def info(self) -> LaunchInfo:
        return LaunchInfo(
            source=self.name,
            rank=self._int("PHALANX_RANK"),
            world_size=self._int("PHALANX_WORLD_SIZE"),
            local_rank=self._int("PHALANX_LOCAL_RANK"),
            local_world_size=self._int("PHALANX_LOCAL_WORLD_SIZE"),
            node_rank=self._int("PHALANX_NODE_RANK", 0),
            master_addr=self.env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=self._master_port(),
            store_hosted=self.env.get("PHALANX_STORE_HOSTED", "0") == "1",
            role=self.env.get("PHALANX_ROLE", "worker"),
            server_rank=self._int("PHALANX_SERVER_RANK", -1),
            num_servers=self._int("PHALANX_SERVERS", 0),
        )


class Torchrun(Environment):
    """``torchrun`` / ``torch.distributed.launch``: the ``RANK``/``WORLD_SIZE`` convention."""

    name = "torchrun"

    def detected(self) -> bool:
        return "RANK" in self.env and "WORLD_SIZE" in self.env

    def info(self) -> LaunchInfo:
        world_size = self._int("WORLD_SIZE")
        local_world_size = self._int("LOCAL_WORLD_SIZE", world_size)
        rank = self._int("RANK")
        return LaunchInfo(
            source=self.name,
            rank=rank,
            world_size=world_size,
            local_rank=self._int("LOCAL_RANK", 0),
            local_world_size=local_world_size,
            node_rank=self._int("GROUP_RANK", rank // max(local_world_size, 1)),
            master_addr=self.env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=self._master_port(),
            store_hosted=self.env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",  # torchrun's agent hosts it
        )


class RayTrain(Environment):
    """A Ray Train worker (``TorchTrainer``): torchrun's variables, which Ray sets, with its node rank.

    Ray has already formed the process group; ``px.init`` adopts it. See docs/ray.md.
    """

    name = "ray"

    def detected(self) -> bool:
        return "RAY_JOB_ID" in self.env and all(key in self.env for key in ("RANK", "WORLD_SIZE", "NODE_RANK"))

    def info(self) -> LaunchInfo:
        return dataclasses.replace(Torchrun(self.env).info(), source=self.name, node_rank=self._int("NODE_RANK"))


class Slurm(Environment):
    """``srun``: ranks from ``SLURM_PROCID``; the first host of the node list is the master."""

    name = "slurm"

    def detected(self) -> bool:
        return "SLURM_PROCID" in self.env and "SLURM_NTASKS" in self.env

    def info(self) -> LaunchInfo:
        world_size = self._int("SLURM_NTASKS")
        nnodes = self._int("SLURM_NNODES", 1)
        job_id = self._int("SLURM_JOB_ID", 0)
        master = self.env.get("MASTER_ADDR") or first_slurm_host(self.env.get("SLURM_JOB_NODELIST", ""))
        return LaunchInfo(
            source=self.name,
            rank=self._int("SLURM_PROCID"),
            world_size=world_size,
            local_rank=self._int("SLURM_LOCALID", 0),
            local_world_size=_slurm_tasks_on_this_node(self.env, world_size, nnodes),
            node_rank=self._int("SLURM_NODEID", 0),
            master_addr=master or "127.0.0.1",
            # Jobs sharing a node must not share a port: derive a default from the job id.
            master_port=self._master_port(20000 + job_id % 20000),
        )


class OpenMPI(Environment):
    """``mpirun`` from Open MPI. The master address must come from ``MASTER_ADDR``."""

    name = "openmpi"

    def detected(self) -> bool:
        return "OMPI_COMM_WORLD_RANK" in self.env

    def info(self) -> LaunchInfo:
        world_size = self._int("OMPI_COMM_WORLD_SIZE")
        local_size = self._int("OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
        rank = self._int("OMPI_COMM_WORLD_RANK")
        return LaunchInfo(
            source=self.name,
            rank=rank,
            world_size=world_size,
            local_rank=self._int("OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_world_size=local_size,
            node_rank=self._int("OMPI_COMM_WORLD_NODE_RANK", rank // max(local_size, 1)),
            master_addr=self._required_master_addr() if world_size > 1 else "127.0.0.1",
            master_port=self._master_port(),
        )


class Pmi(Environment):
    """MPICH, Intel MPI and other PMI launchers. The master address comes from ``MASTER_ADDR``."""

    name = "pmi"

    def detected(self) -> bool:
        return "PMI_RANK" in self.env and "PMI_SIZE" in self.env

    def info(self) -> LaunchInfo:
        world_size = self._int("PMI_SIZE")
        local_size = self._int("MPI_LOCALNRANKS", world_size)
        rank = self._int("PMI_RANK")
        return LaunchInfo(
            source=self.name,
            rank=rank,
            world_size=world_size,
            local_rank=self._int("MPI_LOCALRANKID", 0),
            local_world_size=local_size,
            node_rank=rank // max(local_size, 1),
            master_addr=self._required_master_addr() if world_size > 1 else "127.0.0.1",
            master_port=self._master_port(),
        )


ENVIRONMENTS: tuple[type[Environment], ...] = (PhalanxLauncher, RayTrain, Torchrun, Slurm, OpenMPI, Pmi)


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Return the layout of the job this process belongs to; a plain process is a world of one."""
    env = os.environ if env is None else env
    for environment_type in ENVIRONMENTS:
        environment = environment_type(env)
        if environment.detected():
            info = dataclasses.replace(environment.info(), **phalanx_variables(env))
            _validate(info)
            return info
    return LaunchInfo(source="single", **phalanx_variables(env))


def phalanx_variables(env: Mapping[str, str]) -> dict[str, Any]:
    """The variables phalanx's launcher adds under any launch environment, as LaunchInfo fields."""
    raw = env.get(TIMEOUT_ENV)
    try:
        timeout_s = float(raw) if raw else None
    except ValueError:
        raise ConfigurationError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
    if timeout_s is not None and timeout_s <= 0:
        raise ConfigurationError(f"${TIMEOUT_ENV} must be positive seconds, got {raw!r}.")
    member = env.get(MEMBER_ENV) if env.get(ELASTIC_ENV) == "1" else None
    if member is not None and not member.isdigit():
        raise ConfigurationError(f"${MEMBER_ENV}={member!r} is not a member id; launch with `phalanx run`.")
    device = env.get(DEVICE_ENV) or "auto"
    if device not in DEVICES:
        raise ConfigurationError(f"${DEVICE_ENV}={device!r} is not a device: use 'cuda' or 'cpu'.")
    horovod = tuple(sorted((name, value) for name, value in env.items() if name.startswith(HOROVOD_PREFIX)))
    return {"timeout_s": timeout_s, "job_id": env.get(JOB_ENV, ""),
            "elastic_member": int(member) if member is not None else None, "device": device,
            "horovod_variables": horovod}


def _validate(info: LaunchInfo) -> None:
    if info.role == "server":  # ranks size + server index, beyond the workers'
        if not 0 <= info.server_rank < info.num_servers or info.rank != info.world_size + info.server_rank:
            raise ConfigurationError(f"{info.source} launch: parameter server {info.server_rank} of "
                                     f"{info.num_servers} has an inconsistent rank {info.rank}.")
        return
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise ConfigurationError(
            f"{info.source} launch: rank {info.rank} is not within a world of {info.world_size}; "
            "check the launcher's rank and size variables."
        )
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise ConfigurationError(
            f"{info.source} launch: local rank {info.local_rank} is not within {info.local_world_size} local workers."
        )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` gives ``"gpu07"``."""
    nodelist = nodelist.strip()
    if not nodelist:
        return ""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return nodelist.split(",")[0]
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_on_this_node(env: Mapping[str, str], world_size: int, nnodes: int) -> int:
    """Parse ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``) for this node; fall back to an even split."""
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    node = int(env.get("SLURM_NODEID", "0") or 0)
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            counts = []
            break
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if node < len(counts):
        return counts[node]
    return max(1, world_size // max(nnodes, 1))
