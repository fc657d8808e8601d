"""The process's place in the job: initialisation, process groups, rank queries, timeouts.

``init()`` reads the launch environment (see :mod:`phalanx.comm.environment`), connects to the
rendezvous store and creates the default ``torch.distributed`` process group, so user code may
also call ``torch.distributed`` directly. A world of one creates no group and opens no socket.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.environment import LaunchInfo, detect
from phalanx.errors import CollectiveTimeoutError, ConfigurationError

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "PHALANX_TIMEOUT"


@dataclass
class _Runtime:
    """Everything ``init`` established; replaced as a whole, never patched field by field."""

    info: LaunchInfo
    timeout_s: float
    backend: str
    device: torch.device
    store: Any = None
    cpu_group: Any = None
    generation: int = 0


_runtime: _Runtime | None = None


def init(backend: str | None = None, timeout: float | None = None) -> None:
    """Join the job this process was launched into. Calling it again does nothing.

    ``backend`` defaults to NCCL when CUDA is available and Gloo otherwise. ``timeout`` (seconds,
    default ``$PHALANX_TIMEOUT`` or 300) bounds the rendezvous and every collective.
    """
    global _runtime
    if _runtime is not None:
        return
    info = detect()
    timeout_s = _resolve_timeout(timeout)
    backend = _resolve_backend(backend)
    device = _select_device(backend, info)
    if dist.is_initialized():
        _runtime = _adopt_existing_group(info, timeout_s, device)
    elif info.world_size == 1:
        _runtime = _Runtime(info, timeout_s, backend, device)
    else:
        _runtime = _create_group(info, timeout_s, backend, device)


def shutdown() -> None:
    """Leave the job: destroy the process groups phalanx created. ``init`` may be called again."""
    global _runtime
    if _runtime is not None and _runtime.store is not None and dist.is_initialized():
        dist.destroy_process_group()
    _runtime = None


def is_initialized() -> bool:
    """Whether ``init`` has run in this process (and ``shutdown`` has not)."""
    return _runtime is not None


def rank() -> int:
    """This worker's rank in ``[0, size())``; 0 before ``init``."""
    return _runtime.info.rank if _runtime else 0


def size() -> int:
    """The number of workers in the job; 1 before ``init``."""
    return _runtime.info.world_size if _runtime else 1


def local_rank() -> int:
    """This worker's index among the workers on its host (selects its GPU)."""
    return _runtime.info.local_rank if _runtime else 0


def local_size() -> int:
    """The number of workers on this host."""
    return _runtime.info.local_world_size if _runtime else 1


def node_rank() -> int:
    """The index of this host among the job's hosts."""
    return _runtime.info.node_rank if _runtime else 0


def is_master() -> bool:
    """True on rank 0, the worker that writes checkpoints and logs."""
    return rank() == 0


def timeout() -> float:
    """The timeout in seconds that bounds the rendezvous and every collective."""
    return _runtime.timeout_s if _runtime else _resolve_timeout(None)


def device() -> torch.device:
    """The device this worker computes on: its local GPU with NCCL, otherwise the CPU."""
    return _runtime.device if _runtime else torch.device("cpu")


def launch_info() -> LaunchInfo:
    """How and where this worker was launched."""
    return _runtime.info if _runtime else detect()


def group_for(tensor: torch.Tensor | None = None) -> Any:
    """The process group for a tensor: the default group for CUDA tensors, Gloo for CPU ones."""
    runtime = _require_runtime()
    if tensor is not None and tensor.is_cuda:
        return dist.group.WORLD
    return runtime.cpu_group


def store() -> Any:
    """The rendezvous key-value store shared by all workers (``None`` in a world of one)."""
    return _require_runtime().store


def _require_runtime() -> _Runtime:
    if _runtime is None:
        from phalanx.errors import NotInitializedError

        raise NotInitializedError("phalanx is not initialised: call `px.init()` first.")
    return _runtime


def _resolve_timeout(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ConfigurationError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
    if timeout <= 0:
        raise ConfigurationError(f"timeout must be positive seconds, got {timeout}.")
    return float(timeout)


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigurationError("backend='nccl' needs CUDA, which is not available here; use backend='gloo'.")
    return backend


def _select_device(backend: str, info: LaunchInfo) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    index = info.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _connect_store(info: LaunchInfo, timeout_s: float) -> Any:
    """Connect to the launcher's store, or host it on rank 0 when no launcher does."""
    is_host = info.rank == 0 and not info.store_hosted
    try:
        return dist.TCPStore(
            info.master_addr,
            info.master_port,
            world_size=None if info.store_hosted else info.world_size,
            is_master=is_host,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: could not reach the store at "
            f"{info.master_addr}:{info.master_port} within {timeout_s:.0f}s ({error}). Check that rank 0 "
            "is running and MASTER_ADDR/MASTER_PORT are the same on every worker."
        ) from error


def _create_group(info: LaunchInfo, timeout_s: float, backend: str, device: torch.device) -> _Runtime:
    if info.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = _connect_store(info, timeout_s)
    timeout_delta = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("phalanx/g0/", store),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout_delta,
            device_id=device if backend == "nccl" else None,
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout_delta) if backend == "nccl" else dist.group.WORLD
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: not all {info.world_size} workers joined within "
            f"{timeout_s:.0f}s ({error}). Check that every worker was started with the same world size."
        ) from error
    return _Runtime(info, timeout_s, backend, device, store=store, cpu_group=cpu_group)


def _adopt_existing_group(info: LaunchInfo, timeout_s: float, device: torch.device) -> _Runtime:
    """The user created the process group themselves: use it as it is."""
    adopted = LaunchInfo(
        source=f"{info.source}+existing-group",
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        master_addr=info.master_addr,
        master_port=info.master_port,
    )
    backend = dist.get_backend()
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return _Runtime(adopted, timeout_s, backend, device, store=None, cpu_group=cpu_group)
