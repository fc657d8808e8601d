"""Adopting a ``torch.utils.data.DataLoader``: its dataset and loading settings, phalanx's sampler.

A DataLoader given to ``px.fit`` (or to :func:`from_dataloader`) keeps its dataset, ``collate_fn``,
``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ``worker_init_fn`` and
``drop_last``; its sampler gives way to the distributed, seeded, resumable one of
:class:`~phalanx.data.DistributedLoader`, which keeps only what the sampler meant: a
``RandomSampler`` shuffles (with phalanx's seed), a ``SequentialSampler`` does not, and an
``IterableDataset`` is read as a stream. A DDP script's ``DistributedSampler`` is replaced too: its
``shuffle`` and ``seed`` are kept (``seed=None``, the default, takes the sampler's); its ``num_replicas``,
``rank`` and ``drop_last`` split the dataset per replica, which phalanx's split of each global batch
replaces (it never pads nor drops samples to divide the data), so they are not used. The first such
sampler in a process is reported in one warning, saying so. Samplers that mean more (weighted, subset, a
``DistributedSampler`` subclass that draws its own indices, a batch sampler of one's own) cannot be
kept and are refused.

The batch: ``global_batch_size`` is the batch of one optimizer step over all workers. The
DataLoader's ``batch_size`` must agree with it, read either way: as the global batch, or as each
worker's share of it (torch's ``DistributedSampler`` convention, ``global_batch_size / world
size``); any other value is an error naming both, never silently one of them.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from phalanx.data.loader import DistributedLoader
from phalanx.errors import ConfigurationError

logger = logging.getLogger(__name__)
_said_sampler_replaced = False  # the DistributedSampler warning is given once per process


def from_dataloader(loader: DataLoader, global_batch_size: int, *, seed: int | None = None,
                    micro_batch_size: int | None = None, rank: int | None = None, world_size: int | None = None,
                    check_same_data: bool = True,
                    opt_out_hint: str = "pass check_same_data=False to from_dataloader(...)",
                    device: torch.device | str | None = None, data_on_device: bool | None = None) -> DistributedLoader:
    """The :class:`DistributedLoader` that loads ``loader``'s data as ``loader`` would, in global
    batches of ``global_batch_size`` shared among the workers (see the module's docstring).

    ``seed`` orders the epochs; ``None`` takes the seed of the loader's ``DistributedSampler``, if it
    has one, else 0. ``check_same_data``, ``opt_out_hint``, ``device`` and ``data_on_device`` are
    :class:`DistributedLoader`'s.
    """
    streaming = isinstance(loader.dataset, IterableDataset)
    shuffle = False if streaming else _shuffles(loader)
    sampler = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
    adopted = DistributedLoader(
        loader.dataset, global_batch_size, shuffle=shuffle, seed=_seed(seed, sampler), drop_last=loader.drop_last,
        num_workers=loader.num_workers, collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
        prefetch=loader.prefetch_factor or 2, rank=rank, world_size=world_size, micro_batch_size=micro_batch_size,
        check_same_data=check_same_data, opt_out_hint=opt_out_hint, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn, device=device,
        data_on_device=data_on_device)
    _check_batch_size(loader.batch_size, global_batch_size, adopted.world_size)
    if sampler is not None:
        _say_sampler_replaced(sampler, adopted, seed, loader.batch_size)
    return adopted


def _seed(seed: int | None, sampler: DistributedSampler | None) -> int:
    """The seed given, else the DistributedSampler's, else 0."""
    if seed is not None:
        return seed
    return sampler.seed if sampler is not None else 0


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
    if isinstance(sampler, DistributedSampler):
        _check_draws_as_torch(sampler)
        return bool(sampler.shuffle)
    raise ConfigurationError(
        f"the DataLoader's sampler is a {type(sampler).__name__}: phalanx replaces it with its distributed, "
        "seeded sampler, which keeps only shuffle=True or False. Weight or subset the dataset itself (e.g. "
        "torch.utils.data.Subset), or pass a DataLoader built with shuffle=.")


def _check_draws_as_torch(sampler: DistributedSampler) -> None:
    """Refuse a DistributedSampler subclass with an order of its own (``__iter__`` or ``__len__`` overridden):
    phalanx keeps only shuffle and seed, which would silently lose what the subclass does."""
    kind = type(sampler)
    if kind.__iter__ is not DistributedSampler.__iter__ or kind.__len__ is not DistributedSampler.__len__:
        raise ConfigurationError(
            f"the DataLoader's sampler is a {kind.__name__}, which draws its own indices (it overrides the "
            "DistributedSampler's __iter__ or __len__): phalanx replaces the sampler with its distributed, seeded "
            "one and can keep only a plain DistributedSampler's shuffle and seed. Pass a DataLoader with "
            "sampler=DistributedSampler(dataset, shuffle=..., seed=...) or shuffle=, and subset or weight the "
            "dataset itself.")


def _say_sampler_replaced(sampler: DistributedSampler, adopted: DistributedLoader, seed: int | None,
                          batch_size: int) -> None:
    """One warning per process: what phalanx keeps of a DistributedSampler and what it replaces."""
    global _said_sampler_replaced
    if _said_sampler_replaced:
        return
    _said_sampler_replaced = True
    whose = ("the sampler's" if seed is None else "the seed passed" if seed == sampler.seed
             else f"the seed passed, not the sampler's {sampler.seed}")
    share = ("the global batch" if batch_size == adopted.global_batch_size
             else f"each worker's share of global_batch_size={adopted.global_batch_size}")
    notes = [f"phalanx: the DataLoader's DistributedSampler is replaced by phalanx's split of each global batch "
             f"over the job's {adopted.world_size} worker(s), keeping shuffle={adopted.shuffle} and "
             f"seed={adopted.seed} ({whose}); batch_size={batch_size} is read as {share}."]
    if (sampler.num_replicas, sampler.rank) != (adopted.world_size, adopted.rank):
        notes.append(f"Its num_replicas={sampler.num_replicas}, rank={sampler.rank} are not this job's "
                     f"({adopted.world_size} worker(s), rank {adopted.rank}) and are not used.")
    if sampler.drop_last:
        notes.append("Its drop_last=True is not used: phalanx neither pads nor drops samples to split them.")
    logger.warning(" ".join(notes))


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
