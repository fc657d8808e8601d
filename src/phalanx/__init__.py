"""Phalanx: distributed data-parallel training for PyTorch.

``import phalanx as px``; ``px.init()``; then the collectives below, and the layers built on them.

Names load on first use (PEP 562): ``import phalanx`` costs nothing until ``px.init`` or another
name is touched, so the ``phalanx`` command starts a job's workers before it imports PyTorch itself.
"""

import importlib
from typing import TYPE_CHECKING, Any, Sequence

from phalanx.errors import (
    AuthenticationError,
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
    DataMismatchError,
    GenerationClosedError,
    NonFiniteGradientError,
    NonFiniteLossError,
    NotInitializedError,
    PhalanxError,
    ServerFailedError,
    WorkerFailedError,
)

if TYPE_CHECKING:
    from phalanx.doctor.diagnosis import Diagnosis

__version__ = "0.1.0"

_MODULES = {  # public module -> the names it gives px
    "phalanx.comm.collectives": ("Handle", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall",
                                 "barrier", "broadcast", "broadcast_", "broadcast_object", "reduce", "reduce_",
                                 "reduce_scatter"),
    "phalanx.comm.communicator": ("Communicator",),
    "phalanx.comm.runtime": ("communicator", "device", "init", "is_initialized", "is_master", "local_rank",
                             "local_size", "node_rank", "num_servers", "rank", "role", "shutdown", "size", "timeout"),
    "phalanx.parallel.batchnorm": ("SyncBatchNorm",),
    "phalanx.parallel.reductions": ("Reduction", "TopK"),
    "phalanx.parallel.data_parallel": ("DataParallel",),
    "phalanx.parallel.exact": ("ExactGradients",),
    "phalanx.strategies.central_storage": ("CentralStorage",),
    "phalanx.strategies.local_sgd": ("DiLoCo", "LocalSGD"),
    "phalanx.strategies.parameter_server": ("ParameterServer",),
    "phalanx.strategies.sharded": ("Sharded",),
    "phalanx.train.callbacks": ("Callback",),
    "phalanx.train.checkpoint": ("checkpoint_weights",),
    "phalanx.train.fit": ("estimated_stepping_batches", "evaluate", "fit", "steps_per_epoch"),
    "phalanx.train.loop": ("Loop",),
    "phalanx.train.lr": ("scale_lr",),
    "phalanx.train.state": ("History",),
}
_SUBMODULES = {"data": "phalanx.data", "elastic": "phalanx.elastic", "tune": "phalanx.tune",
               "callbacks": "phalanx.train.callbacks", "lr": "phalanx.train.lr", "metrics": "phalanx.train.metrics"}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import the module that owns ``name`` on first use, and keep the name here."""
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    globals()[name] = value
    return value


def import_everything() -> None:
    """Import every module behind ``px``'s names now, rather than at first use: what a fork server
    does once, so that no forked worker imports them again (their optional dependencies, such as
    Ray, still load only where used)."""
    for module in (*_MODULES, *_SUBMODULES.values()):
        importlib.import_module(module)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def diagnose(script: str, args: Sequence[str] = (), workers: int = 2, **options: Any) -> "Diagnosis":
    """``phalanx doctor`` from Python: run ``script`` on ``workers`` workers and one, and diagnose
    its steps (options as :func:`phalanx.cli.doctor.diagnose`; see docs/doctor.md)."""
    from phalanx.cli.doctor import diagnose as run  # the launcher loads only when asked for

    return run(script, args, workers, **options)


__all__ = sorted({"diagnose", *_HOME, *_SUBMODULES, "AuthenticationError", "CheckpointError", "CollectiveError",
                  "CollectiveMismatchError", "CollectiveTimeoutError", "ConfigurationError", "DataMismatchError",
                  "GenerationClosedError", "NonFiniteGradientError", "NonFiniteLossError", "NotInitializedError", "PhalanxError",
                  "ServerFailedError", "WorkerFailedError"})
