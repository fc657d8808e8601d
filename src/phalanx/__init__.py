"""Phalanx: distributed data-parallel training for PyTorch.

``import phalanx as px``; ``px.init()``; then the collectives below, and the layers built on them.
"""

from typing import TYPE_CHECKING, Any, Sequence

from phalanx.comm.collectives import (
    Handle,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    reduce,
    reduce_,
    reduce_scatter,
)
from phalanx.comm.communicator import Communicator
from phalanx.comm.runtime import (
    communicator,
    device,
    init,
    is_initialized,
    is_master,
    local_rank,
    local_size,
    node_rank,
    num_servers,
    rank,
    role,
    shutdown,
    size,
    timeout,
)
from phalanx import data, elastic, tune
from phalanx.parallel.batchnorm import SyncBatchNorm
from phalanx.parallel.reductions import Reduction, TopK
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.exact import ExactGradients
from phalanx.strategies.central_storage import CentralStorage
from phalanx.strategies.parameter_server import ParameterServer
from phalanx.train import callbacks, lr, metrics
from phalanx.train.fit import evaluate, fit
from phalanx.train.loop import Loop
from phalanx.train.lr import scale_lr
from phalanx.train.state import History
from phalanx.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    AuthenticationError,
    ConfigurationError,
    DataMismatchError,
    GenerationClosedError,
    NonFiniteGradientError,
    NotInitializedError,
    PhalanxError,
    ServerFailedError,
    WorkerFailedError,
)

if TYPE_CHECKING:
    from phalanx.doctor.diagnosis import Diagnosis

__version__ = "0.1.0"


def diagnose(script: str, args: Sequence[str] = (), workers: int = 2, **options: Any) -> "Diagnosis":
    """``phalanx doctor`` from Python: run ``script`` on ``workers`` workers and one, and diagnose
    its steps (options as :func:`phalanx.cli.doctor.diagnose`; see docs/doctor.md)."""
    from phalanx.cli.doctor import diagnose as run  # the launcher loads only when asked for

    return run(script, args, workers, **options)

__all__ = [
    "diagnose", "CentralStorage", "Communicator", "communicator", "GenerationClosedError", "DataParallel", "ExactGradients", "ParameterServer", "ServerFailedError", "History", "Reduction", "SyncBatchNorm", "TopK", "callbacks", "data", "elastic", "tune", "evaluate", "fit", "Loop", "lr",
    "metrics", "scale_lr",
    "CheckpointError", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
    "AuthenticationError", "ConfigurationError", "DataMismatchError", "Handle", "NonFiniteGradientError", "NotInitializedError", "PhalanxError",
    "WorkerFailedError", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_object", "device", "init", "is_initialized", "is_master",
    "local_rank", "local_size", "node_rank", "num_servers", "rank", "role", "reduce", "reduce_", "reduce_scatter", "shutdown", "size",
    "timeout",
]
