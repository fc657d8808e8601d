"""Adopting a ``torch.utils.data.DataLoader``: its dataset and loading settings, phalanx's sampler.

A DataLoader given to ``px.fit`` (or to :func:`from_dataloader`) keeps its dataset, ``collate_fn``,
``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ``worker_init_fn`` and
``drop_last``; its sampler gives way to the distributed, seeded, resumable one of
:class:`~phalanx.data.DistributedLoader`, which keeps only what the sampler meant: a
``RandomSampler`` shuffles (with phalanx's seed), a ``SequentialSampler`` does not, and an
``IterableDataset`` is read as a stream. Samplers that mean more (weighted, subset, a batch sampler
of one's own) cannot be kept and are refused.

The batch: ``global_batch_size`` is the batch of one optimizer step over all workers. The
DataLoader's ``batch_size`` must agree with it, read either way: as the global batch, or as each
worker's share of it (torch's ``DistributedSampler`` convention, ``global_batch_size / world
size``); any other value is an error naming both, never silently one of them.
"""

from __future__ import annotations

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from phalanx.data.loader import DistributedLoader
from phalanx.errors import ConfigurationError


def from_dataloader(loader: DataLoader, global_batch_size: int, *, seed: int = 0,
                    micro_batch_size: int | None = None, rank: int | None = None,
                    world_size: int | None = None) -> DistributedLoader:
    """The :class:`DistributedLoader` that loads ``loader``'s data as ``loader`` would, in global
    batches of ``global_batch_size`` shared among the workers (see the module's docstring)."""
    streaming = isinstance(loader.dataset, IterableDataset)
    shuffle = False if streaming else _shuffles(loader)
    adopted = DistributedLoader(
        loader.dataset, global_batch_size, shuffle=shuffle, seed=seed, drop_last=loader.drop_last,
        num_workers=loader.num_workers, collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
        prefetch=loader.prefetch_factor or 2, rank=rank, world_size=world_size, micro_batch_size=micro_batch_size,
        pin_memory=loader.pin_memory, persistent_workers=loader.persistent_workers,
        worker_init_fn=loader.worker_init_fn)
    _check_batch_size(loader.batch_size, global_batch_size, adopted.world_size)
    return adopted


def _shuffles(loader: DataLoader) -> bool:
    """Whether the DataLoader's sampler shuffled; refuse samplers that mean more than that."""
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise ConfigurationError(
            f"the DataLoader has a batch_sampler of its own ({type(loader.batch_sampler).__name__}): phalanx forms "
            "the global batches itself (the same on every worker, resumable), so it cannot be kept. Pass a "
            "DataLoader with batch_size= (and shuffle=), or the dataset itself.")
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise ConfigurationError("the DataLoader's RandomSampler draws with replacement or a num_samples of its "
                                     "own, which phalanx's epochs (each sample once) cannot keep: use shuffle=True.")
        return True
    if type(sampler) is SequentialSampler:
        return False
    raise ConfigurationError(
        f"the DataLoader's sampler is a {type(sampler).__name__}: phalanx replaces it with its distributed, "
        "seeded sampler, which keeps only shuffle=True or False. Weight or subset the dataset itself (e.g. "
        "torch.utils.data.Subset), or pass a DataLoader built with shuffle=.")


def _check_batch_size(batch_size: int | None, global_batch_size: int, world_size: int) -> None:
    """The DataLoader's ``batch_size`` read as the global batch or as one worker's share; else an error."""
    if batch_size is None:
        raise ConfigurationError("the DataLoader has batch_size=None (each dataset item is already a batch): "
                                 "phalanx forms batches of samples; give the DataLoader a batch_size, or pass the "
                                 "dataset of samples.")
    if batch_size == global_batch_size or batch_size * world_size == global_batch_size:
        return
    raise ConfigurationError(
        f"the DataLoader's batch_size={batch_size} disagrees with global_batch_size={global_batch_size} at "
        f"{world_size} worker(s): it must be the global batch ({global_batch_size}) or each worker's share of it "
        f"({global_batch_size / world_size:g}). global_batch_size decides the step; give the DataLoader the same.")
