"""Horovod's environment variables: each one honoured with Horovod's meaning or refused by name.

A script moved from Horovod keeps its job's environment, so every ``HOROVOD_*`` variable it sets
must either do what Horovod documents or stop ``hvd.init()`` with a message saying what to do,
never be ignored without a word. :mod:`phalanx.comm.environment` reads them once, with the rest of
the launch (``LaunchInfo.horovod_variables``); :func:`read` interprets them into frozen
:class:`Settings`, refusing every variable it cannot honour in one error. docs/horovod.md has the
table ("Horovod's environment variables").

Honoured: ``HOROVOD_FUSION_THRESHOLD`` (DistributedOptimizer's bucket size), ``HOROVOD_CYCLE_TIME``
(the negotiation's shortest cycle), ``HOROVOD_TIMELINE``/``HOROVOD_TIMELINE_MARK_CYCLES``, the stall
check (``HOROVOD_STALL_CHECK_DISABLE``, ``..._TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``),
``HOROVOD_HIERARCHICAL_ALLREDUCE`` (shared memory within a host, or Gloo's sockets),
``HOROVOD_DYNAMIC_PROCESS_SETS``, ``HOROVOD_LOG_LEVEL``/``HOROVOD_LOG_HIDE_TIME``, the layout
``phalanx run`` exports (``HOROVOD_RANK``...), and the values of :data:`ONLY` that describe what
phalanx does anyway. Horovod's build variables (``HOROVOD_WITH_*``, ``HOROVOD_GPU_*``...) configure
``pip install horovod``; there is nothing to build here, and Horovod ignores them at run time too.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar

from phalanx.comm.communicator import Communicator
from phalanx.errors import ConfigurationError

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_STALL_CHECK_S = 60.0  # Horovod's: warn about an operation some ranks have not submitted after a minute
LOG_HANDLER = "phalanx.horovod HOROVOD_LOG_LEVEL"  # the name of the handler HOROVOD_LOG_LEVEL adds
LOG_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "fatal": logging.CRITICAL}

#: Honoured with Horovod's meaning (see :class:`Settings`).
HONOURED = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES",
             "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
             "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_LOG_LEVEL",
             "HOROVOD_LOG_HIDE_TIME")
#: What ``phalanx run`` exports for scripts that read horovodrun's layout: accepted as they are.
LAYOUT = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
          "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")
#: Prefixes of the variables that configure Horovod's build (``pip install horovod``), not a run.
BUILD = ("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU", "HOROVOD_BUILD_", "HOROVOD_CUDA_", "HOROVOD_NCCL_",
         "HOROVOD_ROCM_", "HOROVOD_CMAKE", "HOROVOD_DEBUG")

_HOROVODRUN = ("was set by horovodrun (or for Horovod's own rendezvous): phalanx cannot join horovodrun's "
               "rendezvous. Launch with `phalanx run -np N script.py` instead, without horovodrun's variables.")
_AUTOTUNE = ("phalanx does not autotune: set HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME yourself, "
             "or unset it.")
_TIMEOUT = "phalanx has one timeout for the rendezvous and every collective: set PHALANX_TIMEOUT (seconds) instead."

#: Refused whatever their value: why, and what to do instead.
REFUSED: dict[str, str] = {
    "HOROVOD_AUTOTUNE_LOG": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": _AUTOTUNE,
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": _AUTOTUNE,
    "HOROVOD_GLOO_TIMEOUT_SECONDS": _TIMEOUT,
    "HOROVOD_START_TIMEOUT": _TIMEOUT,
    "HOROVOD_GLOO_IFACE": "torch.distributed takes Gloo's network interface from GLOO_SOCKET_IFNAME: set that instead.",
    "HOROVOD_IFACE": "torch.distributed takes Gloo's network interface from GLOO_SOCKET_IFNAME: set that instead.",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": _HOROVODRUN,
    "HOROVOD_GLOO_RENDEZVOUS_PORT": _HOROVODRUN,
    "HOROVOD_ELASTIC": "is horovodrun's elastic mode: start an elastic job with `phalanx run -np N --min-workers K "
                       "script.py` (docs/elastic.md) and unset it.",
    "HOROVOD_NUM_NCCL_STREAMS": "NCCL collectives run on torch.distributed's own stream: unset it.",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "gradient buckets are filled by torch's copies, not Horovod's batched kernels: "
                                   "unset it.",
    "HOROVOD_THREAD_AFFINITY": "phalanx does not pin its threads: pin the worker instead (taskset, numactl), "
                               "and unset it.",
    "HOROVOD_CCL_CACHE": "oneCCL is not supported (Gloo on CPU, NCCL on GPU): unset it.",
    "HOROVOD_MLSL_BGT_AFFINITY": "MLSL is not supported (Gloo on CPU, NCCL on GPU): unset it.",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "Adasum is not supported (op=hvd.Adasum raises): unset it.",
}


@dataclass(frozen=True)
class Only:
    """A variable whose one accepted value is what phalanx does anyway; any other is refused."""

    value: str  # as :meth:`normal` writes it
    reason: str  # why another value cannot be honoured, and what to do
    kind: str = "flag"  # "flag" (1/0), "count" (a whole number) or "name" (case does not matter)

    def normal(self, value: str) -> str:
        """``value`` written as :attr:`value` is: a flag as "0"/"1", a count in digits, a name lower-case."""
        if self.kind == "flag":
            return "1" if _flag(value) else "0"
        if self.kind == "count":
            return str(_count(value, "entries"))
        return value.strip().lower()


#: Accepted with one value only.
ONLY: dict[str, Only] = {
    "HOROVOD_AUTOTUNE": Only("0", _AUTOTUNE),
    "HOROVOD_CACHE_CAPACITY": Only("0", "phalanx keeps no response cache: every operation is negotiated in full, "
                                        "as Horovod does with capacity 0. Set it to 0 or unset it.", "count"),
    "HOROVOD_HIERARCHICAL_ALLGATHER": Only("0", "phalanx's allgather is flat, over Gloo (only allreduce goes "
                                                "through shared memory within a host): set it to 0 or unset it."),
    "HOROVOD_CONTROLLER": Only("gloo", "phalanx negotiates over Gloo (torch.distributed), never MPI or oneCCL: "
                                       "set it to gloo or unset it.", "name"),
    "HOROVOD_CPU_OPERATIONS": Only("gloo", "CPU tensors travel over Gloo (or shared memory within a host), never "
                                           "MPI or oneCCL: set it to gloo or unset it.", "name"),
    "HOROVOD_MPI_THREADS_DISABLE": Only("1", "phalanx uses no MPI, so no MPI threads: set it to 1 or unset it."),
    "HOROVOD_DISABLE_NVTX_RANGES": Only("1", "phalanx emits no NVTX ranges (use HOROVOD_TIMELINE or torch.profiler): "
                                             "set it to 1 or unset it."),
    "HOROVOD_DISABLE_GROUP_FUSION": Only("1", "a grouped operation of phalanx runs on its own, never fused with "
                                              "others: set it to 1 or unset it."),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": Only("0", "collectives complete when synchronize() or backward waits for them: "
                                                 "set it to 0 or unset it."),
    "HOROVOD_ENABLE_XLA_OPS": Only("0", "XLA ops are TensorFlow's: set it to 0 or unset it."),
}

_FLAGS = {"1": "1", "true": "1", "yes": "1", "on": "1", "0": "0", "false": "0", "no": "0", "off": "0"}


@dataclass(frozen=True)
class Settings:
    """What the job's ``HOROVOD_*`` variables ask of phalanx; where unset, phalanx's defaults (Horovod's
    for the stall check's warning)."""

    fusion_threshold_mb: float | None = None  # DistributedOptimizer's buckets; None: phalanx's (25 MB)
    cycle_time_s: float = 0.0  # the shortest time between two negotiation cycles
    timeline: str | None = None  # the file hvd.init starts the timeline in (rank 0)
    timeline_mark_cycles: bool = False
    stall_warning_s: float | None = DEFAULT_STALL_CHECK_S  # None: the stall check is off
    stall_shutdown_s: float | None = None  # None: the job's timeout fails a stalled operation
    hierarchical_allreduce: bool | None = None  # None: phalanx's choice (shared memory where it can)
    dynamic_process_sets: bool = False
    log_level: int | None = None  # None: phalanx's loggers as the application configured them
    log_hide_time: bool = False
    unknown: tuple[str, ...] = ()  # HOROVOD_* names neither Horovod nor phalanx knows (warned about)

    @property
    def transport(self) -> str:
        """The ``px.init`` transport HOROVOD_HIERARCHICAL_ALLREDUCE asks for."""
        return {None: "auto", True: "shm", False: "gloo"}[self.hierarchical_allreduce]


def read(variables: Mapping[str, str] | tuple[tuple[str, str], ...]) -> Settings:
    """Interpret the ``HOROVOD_*`` variables (an empty one counts as unset); raise one
    :class:`ConfigurationError` naming every variable that cannot be honoured (or is malformed), each
    with what to do."""
    env = {name: value for name, value in dict(variables).items() if value.strip()}
    problems: list[str] = []

    def parsed(name: str, parse: Callable[[str], T], default: T) -> T:
        if name not in env:
            return default
        try:
            return parse(env[name])
        except ValueError as error:
            problems.append(f"{name}={env[name]!r}: {error}")
            return default

    for name, value in env.items():
        if name in REFUSED:
            problems.append(f"{name}={value!r}: {REFUSED[name]}")
        elif name in ONLY:
            try:
                normal = ONLY[name].normal(value)
            except ValueError as error:
                problems.append(f"{name}={value!r}: {error}")
                continue
            if normal != ONLY[name].value:
                problems.append(f"{name}={value!r}: {ONLY[name].reason}")
    threshold: int | None = parsed("HOROVOD_FUSION_THRESHOLD", lambda v: _count(v, "bytes"), None)
    stall_s = parsed("HOROVOD_STALL_CHECK_TIME_SECONDS", lambda v: _seconds(v, "seconds", positive=True),
                     DEFAULT_STALL_CHECK_S)
    timeline = env.get("HOROVOD_TIMELINE") or None
    settings = Settings(
        fusion_threshold_mb=None if threshold is None else threshold / 2**20,
        cycle_time_s=parsed("HOROVOD_CYCLE_TIME", lambda v: _seconds(v, "milliseconds"), 0.0) / 1000.0,
        timeline=None if timeline is None or timeline.upper() == "DYNAMIC" else timeline,
        timeline_mark_cycles=parsed("HOROVOD_TIMELINE_MARK_CYCLES", _flag, False),
        stall_warning_s=None if parsed("HOROVOD_STALL_CHECK_DISABLE", _flag, False) else stall_s,
        stall_shutdown_s=parsed("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _shutdown_seconds, None),
        hierarchical_allreduce=parsed("HOROVOD_HIERARCHICAL_ALLREDUCE", _flag, None),
        dynamic_process_sets=parsed("HOROVOD_DYNAMIC_PROCESS_SETS", _flag, False),
        log_level=parsed("HOROVOD_LOG_LEVEL", _log_level, None),
        log_hide_time=parsed("HOROVOD_LOG_HIDE_TIME", _flag, False),
        unknown=tuple(sorted(name for name in env if not _known(name))),
    )
    if problems:
        raise ConfigurationError(
            "hvd.init(): Horovod environment variable(s) that phalanx cannot honour: " + "; ".join(problems)
            + " (docs/horovod.md lists every Horovod variable and what phalanx does with it).")
    return settings


def _known(name: str) -> bool:
    return name in HONOURED or name in REFUSED or name in ONLY or name in LAYOUT or name.startswith(BUILD)


def _flag(value: str) -> bool:
    """Horovod's on/off values: 1/0 (also true/false, yes/no, on/off)."""
    normal = _FLAGS.get(value.strip().lower())
    if normal is None:
        raise ValueError("expected 1 or 0.")
    return normal == "1"


def _count(value: str, unit: str) -> int:
    try:
        count = int(value.strip())
    except ValueError:
        raise ValueError(f"expected a whole number of {unit}.") from None
    if count < 0:
        raise ValueError(f"expected a number of {unit} of at least 0.")
    return count


def _seconds(value: str, unit: str, positive: bool = False) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number of {unit}.") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"expected a {'positive' if positive else 'non-negative'} number of {unit}.")
    return number


def _shutdown_seconds(value: str) -> float:
    seconds = _seconds(value, "seconds")
    if seconds == 0:
        raise ValueError("0 (never) cannot be honoured: phalanx fails a stalled operation after the job's timeout "
                         "at the latest. Unset it (the timeout is PHALANX_TIMEOUT), or give a number of seconds.")
    return seconds


def _log_level(value: str) -> int:
    level = LOG_LEVELS.get(value.strip().lower())
    if level is None:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}.")
    return level


def check_joined(settings: Settings, communicator: Communicator) -> None:
    """Refuse a job already joined (``px.init()`` before ``hvd.init()``) with another allreduce than
    HOROVOD_HIERARCHICAL_ALLREDUCE asks for: shared memory within a host (1) or Gloo's sockets (0)."""
    wanted = settings.hierarchical_allreduce
    if wanted is None or communicator.size == 1 or (communicator.shared_memory is not None) == wanted:
        return
    if wanted:
        raise ConfigurationError(
            "HOROVOD_HIERARCHICAL_ALLREDUCE=1 asks for allreduces through shared memory within each host, but this "
            f"job was joined without it (transport={communicator.transport!r}, backend {communicator.backend}). "
            "Leave px.init() to hvd.init(), or call px.init(transport='shm'), which says why where it cannot; "
            "or unset the variable.")
    raise ConfigurationError(
        "HOROVOD_HIERARCHICAL_ALLREDUCE=0 asks for a flat allreduce over Gloo's sockets, but px.init() joined this "
        "job with shared memory within the host. Leave px.init() to hvd.init(), or call px.init(transport='gloo'); "
        "or unset the variable.")


def configure_logging(settings: Settings, rank: int) -> None:
    """HOROVOD_LOG_LEVEL: phalanx's messages at that level and above go to stderr, each line with the
    time (unless HOROVOD_LOG_HIDE_TIME) and the rank, as Horovod's own log lines do."""
    if settings.log_level is None:
        return
    root = logging.getLogger("phalanx")
    root.setLevel(settings.log_level)
    handler = next((h for h in root.handlers if h.name == LOG_HANDLER), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.name = LOG_HANDLER
        root.addHandler(handler)
    when = "" if settings.log_hide_time else "%(asctime)s: "
    handler.setFormatter(logging.Formatter(f"[{when}%(levelname)s %(name)s] [{rank}]: %(message)s"))
