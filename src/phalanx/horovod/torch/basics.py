"""Horovod's process-level API: init and shutdown, where this process sits, how it was built.

``init`` joins the job through :func:`px.init <phalanx.comm.runtime.init>` (so ``phalanx run``,
torchrun, SLURM and mpirun launches all work) and registers the static process sets. The
``*_built``/``*_enabled`` answers describe this installation truthfully: Gloo carries CPU tensors;
NCCL is there when torch was built with it and CUDA is usable; MPI, DDL and oneCCL never are.
"""

from __future__ import annotations

import logging
import socket
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives, runtime
from phalanx.errors import ConfigurationError, NotInitializedError

logger = logging.getLogger(__name__)

# Reduction operations, with Horovod's values.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "product"}

_layout: dict[str, Any] | None = None  # cross rank/size and homogeneity, agreed at init
_on_shutdown: list[Callable[[], None]] = []  # what the other modules forget at shutdown (on_shutdown)
_on_init: list[Callable[[], None]] = []  # what the other modules start with each generation (on_init)


def on_shutdown(forget: Callable[[], None]) -> None:
    """Have ``shutdown`` call ``forget``: a module's state of this job (ops in flight) goes with it."""
    _on_shutdown.append(forget)


def on_init(begin: Callable[[], None]) -> None:
    """Have ``init`` (and every re-forming of an elastic job) call ``begin``, on every rank alike."""
    _on_init.append(begin)


def begin_generation() -> None:
    """Start what the other modules run per generation of the job (collective: every rank calls it)."""
    for begin in _on_init:
        begin()


def init(comm: Any = None, process_sets: Sequence[Any] | str | None = None) -> None:
    """Join the job and register ``process_sets``: a list of ``ProcessSet``, or ``"dynamic"``.

    Calling it again does nothing. ``comm`` (an MPI communicator or a list of ranks) is refused:
    phalanx forms its groups through torch.distributed; use process sets for subsets of ranks.
    """
    from phalanx.horovod.torch import process_sets as sets

    if is_initialized():
        return
    if comm is not None:
        raise ConfigurationError(
            "hvd.init(comm=...) is not supported: phalanx forms its groups through torch.distributed, not MPI. "
            "Call hvd.init() and pass process_sets=[hvd.ProcessSet(ranks), ...] to work on subsets of ranks."
        )
    runtime.init()
    refresh_layout()
    sets.setup(process_sets)
    begin_generation()


def shutdown() -> None:
    """Leave the job; ``init`` may be called again."""
    from phalanx.horovod.torch import process_sets as sets

    global _layout
    for forget in _on_shutdown:
        forget()
    sets.forget()
    _layout = None
    runtime.shutdown()


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return runtime.is_initialized() and _layout is not None


def refresh_layout() -> None:
    """Agree on every rank's host and local rank (one small allgather): cross ranks and homogeneity.

    Called by ``init`` and again after an elastic change of membership.
    """
    global _layout
    host = f"{socket.gethostname()}/{runtime.node_rank()}"
    everyone = collectives.allgather_object((host, runtime.local_rank()))
    per_host: dict[str, int] = {}
    for name, _ in everyone:
        per_host[name] = per_host.get(name, 0) + 1
    mine = runtime.local_rank()
    same_local = [r for r, (_, local) in enumerate(everyone) if local == mine]
    _layout = {"cross_size": len(same_local), "cross_rank": same_local.index(runtime.rank()),
               "homogeneous": len(set(per_host.values())) == 1}
    logger.debug("horovod layout: %s", _layout)


def require_init() -> dict[str, Any]:
    if _layout is None or not runtime.is_initialized():
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    return _layout


def size() -> int:
    """The number of processes in the job."""
    require_init()
    return runtime.size()


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    require_init()
    return runtime.rank()


def local_size() -> int:
    """The number of processes on this host."""
    require_init()
    return runtime.local_size()


def local_rank() -> int:
    """This process's index among the processes of its host."""
    require_init()
    return runtime.local_rank()


def cross_size() -> int:
    """The number of hosts that run a process with this process's local rank."""
    return int(require_init()["cross_size"])


def cross_rank() -> int:
    """This process's index among the processes with its local rank, one per host."""
    return int(require_init()["cross_rank"])


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return bool(require_init()["homogeneous"])


def mpi_threads_supported() -> bool:
    """Horovod raises when MPI is not enabled, and it never is here."""
    raise ConfigurationError("Horovod MPI is not enabled: phalanx runs on torch.distributed (Gloo, NCCL), not MPI.")


def mpi_built() -> bool:
    """False: phalanx does not use MPI (it does run under mpirun, reading its variables)."""
    return False


def mpi_enabled() -> bool:
    """False: collectives do not go through MPI."""
    return False


def gloo_built() -> bool:
    """Whether torch.distributed has Gloo (it carries every CPU tensor)."""
    return bool(dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether collectives of CPU tensors run on Gloo: always, once initialised."""
    return gloo_built() and runtime.is_initialized()


def nccl_built() -> bool:
    """Whether torch.distributed was built with NCCL and CUDA is usable."""
    return bool(dist.is_nccl_available() and torch.cuda.is_available())


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether this torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def op_name(op: int | None, average: bool | None = None) -> str:
    """The phalanx op of a Horovod ``op`` (default Average), honouring the deprecated ``average``."""
    if op is not None and average is not None:
        raise ConfigurationError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    if op is None:
        op = Average
    if op == Adasum:
        raise ConfigurationError(
            "op=hvd.Adasum is not supported by phalanx.horovod (Adasum needs Horovod's own MPI/NCCL kernels); "
            "use op=hvd.Average, or hvd.Sum."
        )
    if op not in _OP_NAMES:
        raise ConfigurationError(f"op must be hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product, got {op!r}.")
    return _OP_NAMES[op]
