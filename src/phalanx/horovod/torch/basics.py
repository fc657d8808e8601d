"""Horovod's process-level API: init and shutdown, where this process sits, how it was built.

``init`` reads Horovod's environment variables first (:mod:`~phalanx.horovod.torch.variables`:
each honoured, or refused by name before anything is joined), joins the job through
:func:`px.init <phalanx.comm.runtime.init>` (so ``phalanx run``, torchrun, SLURM and mpirun launches
all work) and registers the static process sets. The
``*_built``/``*_enabled`` answers describe this installation truthfully: Gloo carries CPU tensors;
NCCL is there when torch was built with it and CUDA is usable; MPI, DDL and oneCCL never are.

What Horovod holds for a generation of the job (its settings, layout, process sets and negotiation) hangs on that
generation's communicator (:meth:`~phalanx.comm.communicator.Communicator.attached`): ``init`` and
every elastic reset start them on the current one (:func:`begin_generation`), and the generation's end
(``shutdown``, a re-form) closes them with it, so the next one starts afresh.
"""

from __future__ import annotations

import logging
import socket
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import runtime
from phalanx.comm.communicator import Attachment, Communicator
from phalanx.errors import ConfigurationError, NotInitializedError
from phalanx.horovod.torch import negotiation, timeline, variables
from phalanx.horovod.torch import process_sets as sets

logger = logging.getLogger(__name__)

# Reduction operations, with Horovod's values.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "product"}


@dataclass(frozen=True)
class Layout:
    """Where this process sits among the hosts, agreed by every rank of a generation."""

    cross_size: int
    cross_rank: int
    homogeneous: bool


LAYOUT: Attachment[Layout] = Attachment("horovod layout")
SETTINGS: Attachment[variables.Settings] = Attachment("horovod settings")


def init(comm: Any = None, process_sets: Sequence[Any] | str | None = None) -> None:
    """Join the job and register ``process_sets``: a list of ``ProcessSet``, or ``"dynamic"``.

    Calling it again does nothing. ``comm`` (an MPI communicator or a list of ranks) is refused:
    phalanx forms its groups through torch.distributed; use process sets for subsets of ranks.
    Horovod's environment variables are honoured (HOROVOD_TIMELINE starts the timeline here) or
    refused, all named in one error, before the job is joined.
    """
    if is_initialized():
        return
    if comm is not None:
        raise ConfigurationError(
            "hvd.init(comm=...) is not supported: phalanx forms its groups through torch.distributed, not MPI. "
            "Call hvd.init() and pass process_sets=[hvd.ProcessSet(ranks), ...] to work on subsets of ranks."
        )
    settings = variables.read(runtime.launch_info().horovod_variables)
    if settings.unknown:
        logger.warning("hvd.init(): %s: not Horovod variable(s) that phalanx knows (a typo?); they change nothing.",
                       ", ".join(settings.unknown))
    runtime.init(transport=settings.transport)
    variables.check_joined(settings, runtime.communicator())
    variables.configure_logging(settings, runtime.rank())
    static = [] if isinstance(process_sets, str) or process_sets is None else list(process_sets)
    begin_generation(process_sets == "dynamic" or settings.dynamic_process_sets, static)
    if settings.timeline is not None:
        timeline.start_timeline(settings.timeline, settings.timeline_mark_cycles)


def begin_generation(dynamic: bool, static: Sequence[sets.ProcessSet] = ()) -> None:
    """Start Horovod on the current generation: agree on the layout, open its registry of process
    sets (``static`` registered; more allowed later when ``dynamic``) and start its negotiation.

    Collective: every rank calls it, at ``init`` and after an elastic reset. On a generation that has
    them already it does nothing; each is closed with the generation (see the module's docstring).
    """
    communicator = runtime.communicator()
    settings = communicator.attached(SETTINGS, lambda: variables.read(communicator.info.horovod_variables))
    communicator.attached(LAYOUT, lambda: _agreed_layout(communicator))
    registry = sets.opened(dynamic, static)
    negotiation.opened(registry.negotiated_scope, settings)


def shutdown() -> None:
    """Leave the job; ``init`` may be called again. The generation's end closes what Horovod held on
    it: its negotiation first (collective: every rank leaves), then the process sets it registered.
    A timeline being written is finished, as Horovod's shutdown finishes it."""
    timeline.stop_timeline()
    runtime.shutdown()


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return runtime.attachment(LAYOUT) is not None


def _agreed_layout(communicator: Communicator) -> Layout:
    """Every rank's host and local rank (one small allgather): cross ranks and homogeneity."""
    info = communicator.info
    everyone = communicator.allgather_object((f"{socket.gethostname()}/{info.node_rank}", info.local_rank), safe=True)
    per_host: dict[str, int] = {}
    for name, _ in everyone:
        per_host[name] = per_host.get(name, 0) + 1
    same_local = [r for r, (_, local) in enumerate(everyone) if local == info.local_rank]
    layout = Layout(len(same_local), same_local.index(communicator.rank), len(set(per_host.values())) == 1)
    logger.debug("horovod layout: %s", layout)
    return layout


def require_init() -> Layout:
    layout = runtime.attachment(LAYOUT)
    if layout is None:
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    return layout


def settings() -> variables.Settings:
    """What the job's HOROVOD_* variables ask for (read at ``hvd.init``)."""
    require_init()
    found = runtime.attachment(SETTINGS)
    assert found is not None  # attached with the layout, by begin_generation
    return found


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
    return require_init().cross_size


def cross_rank() -> int:
    """This process's index among the processes with its local rank, one per host."""
    return require_init().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return require_init().homogeneous


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
