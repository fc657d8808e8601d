"""Horovod's PyTorch API on phalanx: ``import phalanx.horovod.torch as hvd``.

The names, signatures and defaults are Horovod's (0.28); collectives run on
:mod:`phalanx.comm.collectives`, ``DistributedOptimizer`` on phalanx's gradient engine, elastic
training on :mod:`phalanx.elastic`. Launch with ``phalanx run -np N script.py``. What differs
from Horovod is listed in docs/horovod.md.
"""

from phalanx.horovod.torch import elastic
from phalanx.horovod.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from phalanx.horovod.torch.basics import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from phalanx.horovod.torch.compression import Compression, Compressor
from phalanx.horovod.torch.exceptions import (
    HorovodInternalError,
    HorovodMismatchError,
    HorovodTimeoutError,
    HostsUpdatedInterrupt,
)
from phalanx.horovod.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from phalanx.horovod.torch.mpi_ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from phalanx.horovod.torch.optimizer import DistributedOptimizer
from phalanx.horovod.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from phalanx.horovod.torch.sync_batch_norm import SyncBatchNorm
from phalanx.horovod.torch.timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "HorovodInternalError",
    "HorovodMismatchError", "HorovodTimeoutError", "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product",
    "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
