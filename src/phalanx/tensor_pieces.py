"""Tensors written in pieces by the ranks that hold them, and read back whole or cut another way.

A sharded strategy's rank holds a contiguous piece of each parameter's flattened values and of its
optimizer state. Each such tensor is saved as torch's ``ShardedTensor`` of its flattened length,
with torch.distributed.checkpoint (DCP): every rank writes its own pieces (nothing travels to rank
0), and a later run reads into pieces cut for its own worker count, DCP fetching the overlapping
ranges. torch's own tools read the folder (``dcp_to_torch_save`` gives every tensor whole and
flat); :func:`read_whole` does so without a process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import torch


def piece(local: torch.Tensor, total: int, bounds: Sequence[tuple[int, int]], rank: int) -> Any:
    """The tensor of ``total`` flat elements of which rank ``r`` holds ``bounds[r]`` (start, stop) and
    this rank ``local``: the same layout on every rank, so no collective is needed to describe it.
    A rank alone holds the whole tensor, which is ``local`` itself (no process group needed)."""
    if len(bounds) == 1:
        return local
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = local.device.type if local.device.type == "cpu" else f"{local.device.type}:{local.device.index}"
    metadata = [ShardMetadata(shard_offsets=[start], shard_sizes=[stop - start], placement=f"rank:{r}/{device}")
                for r, (start, stop) in enumerate(bounds) if stop > start]
    whole = ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size([total]),
                                  tensor_properties=TensorProperties(dtype=local.dtype))
    start, stop = bounds[rank]
    mine = [Shard(local, ShardMetadata(shard_offsets=[start], shard_sizes=[stop - start],
                                       placement=f"rank:{rank}/{device}"))] if stop > start else []
    with warnings.catch_warnings():  # ShardedTensor is marked for DTensor's sake; DCP reads and writes it
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, whole)


def save(state: dict[str, Any], folder: Path) -> None:
    """Every rank writes its pieces of ``state`` into ``folder`` (collective)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=_alone())


def load(state: dict[str, Any], folder: Path) -> None:
    """Fill ``state``'s pieces (and whole tensors) from ``folder`` in place (collective)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=_alone())


def _alone() -> bool:
    """Whether this process has no group to save or load with (a world of one, an elastic job's included)."""
    return not torch.distributed.is_initialized()


def contents(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor ``folder`` holds, with its whole size and dtype."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return {key: (entry.size, entry.properties.dtype) for key, entry in metadata.state_dict_metadata.items()
            if hasattr(entry, "size")}


def read_whole(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder``, whole, in this process alone (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    whole = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in contents(folder).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(whole, checkpoint_id=str(folder), no_dist=True)
    return whole
