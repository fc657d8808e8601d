"""Which device each worker computes on, and the layouts that cannot work, refused before any rendezvous.

With NCCL every worker needs a GPU of its own: NCCL refuses two ranks of one group on one GPU, and
a job started that way waits at its first collective until the timeout. A worker takes the GPU of
its local rank among those visible to it (``CUDA_VISIBLE_DEVICES``, as SLURM or the user set it,
numbers them from 0). ``phalanx run --device cpu`` (or ``px.init(backend="gloo")``) trains on the
CPU whatever the host has; ``--device cuda`` insists on GPUs.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING

from phalanx.comm.environment import DEVICES
from phalanx.errors import ConfigurationError

if TYPE_CHECKING:  # imported where used: the launcher checks a job's devices before it loads PyTorch
    import torch

GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA's driver, AMD's (ROCm), WSL2's


def visible_gpus() -> int:
    """The GPUs this process can train on with NCCL (0 without CUDA or NCCL); PyTorch is not even
    imported where no GPU can be (no driver on this Linux host, or ``CUDA_VISIBLE_DEVICES`` empty)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or (
            sys.platform.startswith("linux") and not any(os.path.exists(path) for path in GPU_DRIVER_FILES)
            and shutil.which("nvidia-smi") is None):
        return 0
    import torch
    import torch.distributed as dist

    return torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0


def resolve_backend(requested: str | None, device: str = "auto") -> str:
    """The backend ``px.init`` uses: the one asked for, else NCCL on GPUs and Gloo on the CPU."""
    if requested not in (None, "gloo", "nccl"):
        raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {requested!r}.")
    if device not in DEVICES:
        raise ConfigurationError(f"the device must be one of {list(DEVICES)}, got {device!r}.")
    if device == "cpu" and requested == "nccl":
        raise ConfigurationError("backend='nccl' on a job launched with --device cpu: NCCL needs GPUs; drop "
                                 "backend= or launch with --device cuda.")
    gpus = visible_gpus()
    if requested == "nccl" and gpus == 0:
        raise ConfigurationError("backend='nccl' needs CUDA and NCCL, which are not available here; use "
                                 "backend='gloo'.")
    if device == "cuda" and gpus == 0:
        raise ConfigurationError("the job was launched with --device cuda, but this process sees no GPU (is "
                                 f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} right?).")
    if requested is not None:
        return requested
    return "nccl" if device != "cpu" and gpus > 0 else "gloo"


def device_for(backend: str, local_rank: int, workers_on_host: int, gpus: int, where: str) -> "torch.device":
    """This worker's device: the CPU with Gloo; with NCCL the GPU of its local rank, after checking
    that the host has a GPU for every one of its workers (:func:`check_gpus`)."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    check_gpus(workers_on_host, gpus, where)
    return torch.device("cuda", local_rank)


def check_gpus(workers_on_host: int, gpus: int, where: str) -> None:
    """Refuse more NCCL workers on a host than GPUs visible there, naming both counts and the way out."""
    if workers_on_host <= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    raise ConfigurationError(
        f"{where}: {workers_on_host} workers on this host, but {gpus} GPU{'' if gpus == 1 else 's'} visible "
        f"here{seen}: with NCCL each worker needs a GPU of its own. Start at most {gpus} worker"
        f"{'' if gpus == 1 else 's'} per host (phalanx run -n {gpus}), or train on the CPU with "
        "`phalanx run --device cpu` (Gloo; px.init(backend='gloo') in your own launch).")
