"""DistributedLoader: each rank's share of the same sequence of global batches.

Unlike ``DistributedSampler`` (which pads the dataset by repeating samples so every rank gets
the same count), every sample is seen exactly once per epoch across all ranks, and every rank
runs the same number of steps: a rank whose share of the last batch is empty gets a zero-row
batch. The training loop weights ranks with ``last_local_batch_size / last_global_batch_size``
so the gradient is exactly the mean over the global batch. See ``docs/data.md``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, default_collate

from phalanx import profile, rng
from phalanx.data._batch import MapData, TensorData, empty_like_batch, identity, map_tensors
from phalanx.data._device import copy_ahead, place, transfer_to
from phalanx.data._prefetch import Prefetcher
from phalanx.data._stream import chunked, mark_last, shuffle_buffer
from phalanx.data.fingerprint import check_same_data, content_digest, record_of, sample_digest
from phalanx.global_batch import (
    epoch_plan,
    epoch_seed,
    local_share,
    mix_seed,
    num_steps,
    share_bounds,
    validate_global_batch_size,
    validate_rank,
)
from phalanx.errors import ConfigurationError

__all__ = ["DistributedLoader"]

STATE_VERSION = 1
_SHUFFLE_BUFFER_BATCHES = 4


class _Step(NamedTuple):
    """One step as produced: this rank's batch and the sizes the training loop needs."""

    batch: Any
    global_size: int
    local_size: int
    last: bool
    digest: int = 0  # of the whole global batch, for streams (every rank reads all of it)


class DistributedLoader:
    """Iterate this rank's contiguous share of each global batch of ``dataset``.

    ``dataset`` may be a map-style dataset (anything with ``__getitem__`` and ``__len__``), a
    tensor or NumPy array, a tuple of equal-length tensors/arrays or a ``TensorDataset`` (fast path: one gather per
    tensor, no per-sample collate, unless ``collate_fn`` is given), or an ``IterableDataset``
    (every rank reads the whole stream and takes its share of each chunk of
    ``global_batch_size`` items; ``shuffle`` uses a seeded buffer of ``shuffle_buffer`` items,
    by default four global batches, identical on every rank).

    ``micro_batch_size`` makes shares whole virtual micro-batches of that many samples (the
    reproducible mode's unit of work), so how a global batch is cut never depends on the world size.

    ``num_workers`` loads shares in worker processes, seeded from (seed, epoch, rank, worker) each
    epoch; with ``persistent_workers`` they are started once and seeded once (from the epoch they
    started in), their random streams continuing from epoch to epoch as in torch. ``pin_memory``
    pins batches in page-locked memory when a GPU is there to copy them to; ``worker_init_fn`` runs
    in each worker after its seeding. :func:`phalanx.data.from_dataloader` adopts a torch DataLoader.

    ``device`` hands batches over on that device (``None``: where the data is). A dataset of tensors
    is then kept on the device when it takes at most half its free memory (``data_on_device=None``,
    decided once, here, and logged: ``placement.reason``), so every batch is gathered there; any
    other data (or ``data_on_device=False``) is copied batch by batch from pinned memory on a side
    stream, one batch ahead, so the copy overlaps the step (:mod:`phalanx.data._device`).

    ``rank``/``world_size`` default to the phalanx runtime's, or 0/1 when it is not running.
    Only one iteration of a loader may be active at a time: starting a new one stops the old.

    Every rank must hold the same dataset: when the first batch is handed out, the ranks compare
    the dataset's length, the loader's settings and a digest of a few samples chosen by a fixed seed
    (one small allgather, once), and raise :class:`~phalanx.errors.DataMismatchError` on every
    rank if they differ. ``check_same_data=False`` skips it, for data that is rank-local by design.
    The error's last sentence says how to skip it: ``opt_out_hint`` (an attribute too), which whoever
    builds the loader for the user sets to a fix in the call the user made, e.g. ``px.fit``'s arguments.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        prefetch: int = 2,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_buffer: int | None = None,
        micro_batch_size: int | None = None,
        check_same_data: bool = True,
        opt_out_hint: str = "pass check_same_data=False to DistributedLoader(...)",
        pin_memory: bool = False,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        device: torch.device | str | None = None,
        data_on_device: bool | None = None,
    ):
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        self.granularity = _granularity(micro_batch_size, global_batch_size, self.world_size)
        validate_global_batch_size(global_batch_size, self.world_size)
        _check_options(seed, num_workers, prefetch, collate_fn)
        self.dataset = dataset
        self.global_batch_size = int(global_batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.shuffle_buffer = _shuffle_buffer_size(shuffle_buffer, self.global_batch_size)
        self._data = _wrap_dataset(dataset, collate_fn)
        _check_workers(self._data, self.num_workers, persistent_workers)
        self.placement = None if device is None else place(self._data, torch.device(device), data_on_device)
        copies_to_gpu = self.placement is not None and self.placement.device.type == "cuda"
        # pinning needs a GPU to copy to; the side stream's copies need it to be asynchronous
        self.pin_memory = (bool(pin_memory) or copies_to_gpu) and torch.cuda.is_available()
        self.persistent_workers = bool(persistent_workers)
        self._workers: tuple[DataLoader, _Batches] | None = None  # kept across epochs when persistent
        self.worker_init_fn = worker_init_fn
        self.last_global_batch_size = 0
        self.last_local_batch_size = 0
        self._epoch = 0
        self._consumed = 0
        self._finished = False
        self._active: weakref.ref | None = None
        self._plan: tuple[int, list[torch.Tensor]] | None = None  # batch_at's epoch plan
        self._compares_data = bool(check_same_data)
        self.opt_out_hint = opt_out_hint
        self._data_check_pending = self._compares_data and _shards_the_job(self.rank, self.world_size)

    # ----------------------------------------------------------------- sizes and position

    @property
    def epoch(self) -> int:
        """The epoch being iterated (or just finished, until the next iteration starts)."""
        return self._epoch

    def __len__(self) -> int:
        """Steps in a full epoch: identical on every rank."""
        return num_steps(self._num_samples(), self.global_batch_size, self.drop_last)

    @property
    def num_samples(self) -> int | None:
        """The samples in an epoch, or ``None`` for a stream of unknown length."""
        return self._known_num_samples()

    @property
    def steps_remaining(self) -> int:
        """Steps the next iteration will yield: fewer than ``len(self)`` after a mid-epoch resume."""
        if self._finished:
            return len(self)
        return num_steps(self._num_samples(), self.global_batch_size, self.drop_last, self._consumed)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration draws its permutation for.

        Setting the epoch the loader is already in, part-way through, keeps the position, so
        ``load_state_dict`` followed by the usual ``set_epoch(epoch)`` resumes mid-epoch.
        Otherwise the epoch starts from its first sample.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigurationError(f"set_epoch({epoch!r}): the epoch must be an integer >= 0.")
        epoch = int(epoch)
        if epoch == self._epoch and not self._finished:
            return
        self.close()
        self._epoch, self._consumed, self._finished = epoch, 0, False

    def state_dict(self) -> dict[str, Any]:
        """The global position (identical on every rank): save it with rank 0's checkpoint.

        ``consumed`` counts samples of this epoch's permutation in batches already handed out
        (not prefetched ones). After the last batch of an epoch it points at the next epoch.
        """
        epoch, consumed = (self._epoch + 1, 0) if self._finished else (self._epoch, self._consumed)
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "consumed": consumed,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_samples": self._known_num_samples(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, also with a different world size or batch size.

        The saved seed replaces this loader's (it defines the epoch's order). The dataset
        length and ``shuffle`` must match, otherwise the saved position would mean other samples.
        """
        epoch, consumed, seed = _read_position(state)
        self._check_compatible(state, consumed)
        self.close()
        self.seed, self._epoch, self._consumed = seed, epoch, consumed
        self._finished = False

    def reshard(self, rank: int, world_size: int) -> None:
        """Take ``rank``'s share of each global batch in a group of ``world_size`` from now on.

        The position is global, so an elastic job calls this after its group changed and then
        loads the committed position: no sample is skipped or used twice.
        """
        validate_rank(world_size, rank)
        validate_global_batch_size(self.global_batch_size, world_size)
        _granularity(self.granularity if self.granularity > 1 else None, self.global_batch_size, world_size)
        self.close()
        self.rank, self.world_size = int(rank), int(world_size)
        # Checked again in the new group, by every member alike (some may have finished the old check).
        self._data_check_pending = self._compares_data and _shards_the_job(self.rank, self.world_size)

    # ------------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        """Yield this rank's batches for the rest of the current epoch (the next one if done)."""
        self.close()
        if self._at_epoch_end():
            self._epoch, self._consumed, self._finished = self._epoch + 1, 0, False
        return self._consume(self._produce(self._epoch, self._consumed))

    def batch_at(self, epoch: int, step: int, share: int, shares: int) -> Any:
        """Share ``share`` of ``shares`` of global batch ``step`` of ``epoch``, fetched on demand.

        For work dealt at run time (asynchronous parameter servers): the same permutation and
        contiguous shares as iteration, in any order. Map-style datasets and tensors only.
        """
        if self._data is None:
            raise ConfigurationError(
                "batches dealt on demand (asynchronous training) need a map-style dataset or tensors, not a stream.")
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, epoch_plan(len(self._data), self.global_batch_size, seed=self.seed, epoch=epoch,
                                            shuffle=self.shuffle, drop_last=self.drop_last))
        global_batch = self._plan[1][step]
        indices = local_share(global_batch, shares, share, self.granularity)
        self.last_global_batch_size, self.last_local_batch_size = len(global_batch), len(indices)
        return self._data.fetch(indices) if len(indices) else self._data.empty(int(global_batch[0]))

    def close(self) -> None:
        """Stop the active iteration's prefetch thread or workers, if any."""
        source = self._active() if self._active is not None else None
        self._active = None
        if source is not None:
            source.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _consume(self, steps: Iterator[_Step]) -> Iterator[Any]:
        """Hand batches to the user, advancing the position as each one is handed over."""
        source: Any = steps
        if self.prefetch > 0 and self.num_workers == 0 and not self._resident():
            source = Prefetcher(steps, self.prefetch)
        self._active = weakref.ref(source)
        if self.placement is not None and not self._resident():
            steps = copy_ahead(source, transfer_to(self.placement.device), lambda step: step.batch,
                               lambda step, batch: step._replace(batch=batch))
        else:
            steps = source
        try:
            for step in profile.timed(steps, "data"):
                if self._data_check_pending:
                    self._check_same_data(step)
                self._record(step)
                yield step.batch
        finally:
            source.close()

    def _check_same_data(self, first: _Step) -> None:
        """Compare this rank's dataset and settings with every other rank's (see the class docstring)."""
        self._data_check_pending = False
        content = first.digest if self._data is None else sample_digest(self._data)
        check_same_data(record_of(self._known_num_samples(), self.seed, self.global_batch_size, self.shuffle,
                                  self.drop_last, content), self.opt_out_hint)

    def _record(self, step: _Step) -> None:
        """Advance the position past ``step`` and expose its sizes."""
        self._consumed += step.global_size
        self._finished = step.last
        self.last_global_batch_size = step.global_size
        self.last_local_batch_size = step.local_size

    def _produce(self, epoch: int, consumed: int) -> Iterator[_Step]:
        """The steps of ``epoch`` from sample position ``consumed`` on (a lazy generator)."""
        if self._data is None:
            return self._stream_steps(epoch, consumed)
        plan = epoch_plan(
            len(self._data), self.global_batch_size, seed=self.seed, epoch=epoch,
            shuffle=self.shuffle, drop_last=self.drop_last, start=consumed,
        )
        if self._resident():
            return self._resident_steps(plan)
        if self.num_workers > 0:
            return self._worker_steps(plan, epoch)
        return self._local_steps(plan)

    def _resident(self) -> bool:
        """Whether batches are gathered from a copy of the dataset kept on the device."""
        return self.placement is not None and self.placement.resident is not None

    def _local_steps(self, plan: list[torch.Tensor]) -> Iterator[_Step]:
        """Fetch each share in this process."""
        for k, global_batch in enumerate(plan):
            share = local_share(global_batch, self.world_size, self.rank, self.granularity)
            batch = self._data.fetch(share) if len(share) else self._data.empty(int(global_batch[0]))
            yield _Step(map_tensors(batch, torch.Tensor.pin_memory) if self.pin_memory else batch,
                        len(global_batch), len(share), k == len(plan) - 1)

    def _resident_steps(self, plan: list[torch.Tensor]) -> Iterator[_Step]:
        """Gather each share from the dataset kept on the device; the epoch's indices moved there at once."""
        assert self.placement is not None and self.placement.resident is not None
        data = self.placement.resident
        shares = [local_share(global_batch, self.world_size, self.rank, self.granularity) for global_batch in plan]
        if not shares:
            return
        on_device = torch.cat(shares).to(self.placement.device).split([len(share) for share in shares])
        for k, (global_batch, share) in enumerate(zip(plan, on_device)):
            yield _Step(data.fetch(share), len(global_batch), len(share), k == len(plan) - 1)

    def _worker_steps(self, plan: list[torch.Tensor], epoch: int) -> Iterator[_Step]:
        """Fetch each non-empty share in DataLoader worker processes, in order."""
        shares = [local_share(global_batch, self.world_size, self.rank, self.granularity) for global_batch in plan]
        batches = iter(self._worker_loader([s for s in shares if len(s)], epoch))
        for k, (global_batch, share) in enumerate(zip(plan, shares)):
            batch = next(batches) if len(share) else self._data.empty(int(global_batch[0]))
            yield _Step(batch, len(global_batch), len(share), k == len(plan) - 1)

    def _worker_loader(self, shares: list[torch.Tensor], epoch: int) -> DataLoader:
        """A DataLoader over this rank's index batches, seeded from (seed, epoch, rank, worker); with
        persistent workers, the one made in the first epoch, given this epoch's index batches."""
        batches = shares if isinstance(self._data, TensorData) else [share.tolist() for share in shares]
        if self._workers is not None:
            loader, current = self._workers
            current.batches = batches
            return loader
        current = _Batches(batches)
        common = dict(
            num_workers=self.num_workers,
            prefetch_factor=max(self.prefetch, 1),
            worker_init_fn=_WorkerSeeder(self.seed, epoch, self.rank, self.worker_init_fn),
            generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch, self.rank)),
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )
        if isinstance(self._data, TensorData):
            loader = DataLoader(self._data, sampler=current, batch_size=None, collate_fn=identity, **common)
        else:
            loader = DataLoader(self._data.dataset, batch_sampler=current, collate_fn=self.collate_fn, **common)
        if self.persistent_workers:
            self._workers = (loader, current)
        return loader

    def _stream_steps(self, epoch: int, skip: int) -> Iterator[_Step]:
        """Read the whole stream, cut it into global batches and take this rank's share of each."""
        items: Iterator[Any] = iter(self.dataset)
        if self.shuffle:
            items = shuffle_buffer(items, self.shuffle_buffer, epoch_seed(self.seed, epoch))
        items = itertools.islice(items, skip, None)
        for chunk, last in mark_last(chunked(items, self.global_batch_size, self.drop_last)):
            start, stop = share_bounds(len(chunk), self.world_size, self.rank, self.granularity)
            if stop > start:
                batch = self.collate_fn(chunk[start:stop])
            else:
                batch = empty_like_batch(self.collate_fn(chunk[:1]))
            digest = content_digest(chunk) if self._data_check_pending else 0
            yield _Step(batch, len(chunk), stop - start, last, digest)

    # ------------------------------------------------------------------------- helpers

    def _at_epoch_end(self) -> bool:
        """True after the epoch's last batch, or at a loaded position with no full step left."""
        if self._finished:
            return True
        return self._data is not None and self._consumed > 0 and self.steps_remaining == 0

    def _known_num_samples(self) -> int | None:
        """The dataset length, or ``None`` for a stream without ``__len__``."""
        if self._data is not None:
            return len(self._data)
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _num_samples(self) -> int:
        """The dataset length; a TypeError (as ``len()`` expects) when it is unknown."""
        n = self._known_num_samples()
        if n is None:
            raise TypeError("this DistributedLoader reads an IterableDataset without __len__, so its length is unknown")
        return n

    def _check_compatible(self, state: dict[str, Any], consumed: int) -> None:
        """Reject a saved position that would mean other samples for this dataset."""
        saved_n, n = state.get("num_samples"), self._known_num_samples()
        if saved_n is not None and n is not None and saved_n != n:
            raise ConfigurationError(
                f"load_state_dict: the state was saved for {saved_n} samples but this dataset has {n}; "
                "resume with the same dataset (or start a fresh loader without loading the state)."
            )
        if "shuffle" in state and bool(state["shuffle"]) != self.shuffle:
            raise ConfigurationError(
                f"load_state_dict: the state was saved with shuffle={state['shuffle']} but this loader has "
                f"shuffle={self.shuffle}; construct the loader with the same shuffle setting."
            )
        if n is not None and consumed > n:
            raise ConfigurationError(f"load_state_dict: consumed={consumed} exceeds the dataset's {n} samples.")


def _read_position(state: dict[str, Any]) -> tuple[int, int, int]:
    """``(epoch, consumed, seed)`` from a state dict, validated."""
    missing = [key for key in ("epoch", "consumed", "seed") if key not in state]
    if missing:
        raise ConfigurationError(
            f"load_state_dict: the state lacks {missing}; pass a dict made by DistributedLoader.state_dict()."
        )
    if int(state.get("version", STATE_VERSION)) > STATE_VERSION:
        raise ConfigurationError(
            f"load_state_dict: state version {state['version']} is newer than this phalanx understands "
            f"({STATE_VERSION}); upgrade phalanx."
        )
    epoch, consumed, seed = int(state["epoch"]), int(state["consumed"]), int(state["seed"])
    if epoch < 0 or consumed < 0:
        raise ConfigurationError(f"load_state_dict: epoch={epoch} and consumed={consumed} must be >= 0.")
    return epoch, consumed, seed


class _WorkerSeeder:
    """``worker_init_fn`` seeding torch, ``random`` and NumPy from (seed, epoch, rank, worker id),
    then running the user's own ``worker_init_fn``, if any."""

    def __init__(self, seed: int, epoch: int, rank: int, then: Callable[[int], None] | None = None):
        self.seed, self.epoch, self.rank, self.then = seed, epoch, rank, then

    def __call__(self, worker_id: int) -> None:
        rng.seed_all(mix_seed(self.seed, self.epoch, self.rank, worker_id))
        if self.then is not None:
            self.then(worker_id)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Fill a missing rank or world size from the runtime, then validate the pair."""
    if rank is None or world_size is None:
        runtime_rank, runtime_size = _runtime_rank_and_size()
        rank = runtime_rank if rank is None else rank
        world_size = runtime_size if world_size is None else world_size
    validate_rank(world_size, rank)
    return int(rank), int(world_size)


def _shards_the_job(rank: int, world_size: int) -> bool:
    """Whether this loader splits batches over the running job's workers (then all must agree)."""
    return world_size > 1 and (rank, world_size) == _runtime_rank_and_size()


def _runtime_rank_and_size() -> tuple[int, int]:
    """The phalanx runtime's rank and size, or (0, 1) when it is absent or not initialized.

    Imported lazily so this module does not depend on the communication layer at import time.
    """
    try:
        from phalanx.comm import runtime
    except ImportError:
        return 0, 1
    if not runtime.is_initialized():
        return 0, 1
    if runtime.role() == "server":  # a parameter server builds the script's loaders but never iterates them
        return 0, runtime.size()
    return runtime.rank(), runtime.size()


def _check_options(seed: int, num_workers: int, prefetch: int, collate_fn: Any) -> None:
    """Validate the scalar arguments, naming the bad one."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigurationError(f"seed={seed!r} must be an integer.")
    for name, value in (("num_workers", num_workers), ("prefetch", prefetch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigurationError(f"{name}={value!r} must be an integer >= 0.")
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigurationError(f"collate_fn={collate_fn!r} is not callable; pass a function or None.")


def _shuffle_buffer_size(size: int | None, global_batch_size: int) -> int:
    """The stream shuffle buffer: ``size``, or a few global batches by default."""
    if size is None:
        return _SHUFFLE_BUFFER_BATCHES * global_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigurationError(f"shuffle_buffer={size!r} must be an integer >= 1 (or None for the default).")
    return size


def _granularity(micro_batch_size: int | None, global_batch_size: int, world_size: int) -> int:
    """Samples per unit of a share: 1, or the virtual micro-batch size."""
    if micro_batch_size is None:
        return 1
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigurationError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}.")
    if -(-global_batch_size // micro_batch_size) < world_size:
        raise ConfigurationError(
            f"global_batch_size={global_batch_size} holds {-(-global_batch_size // micro_batch_size)} micro-batches "
            f"of {micro_batch_size}, fewer than the {world_size} workers; use a smaller micro_batch_size "
            "or fewer workers."
        )
    return micro_batch_size


class _Batches:
    """The index batches of the current epoch, which a persistent DataLoader's workers are handed."""

    def __init__(self, batches: list[Any]):
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _check_workers(data: TensorData | MapData | None, num_workers: int, persistent: bool = False) -> None:
    """Worker processes are for map-style data: each would read a whole stream again."""
    if persistent and num_workers == 0:
        raise ConfigurationError("persistent_workers=True keeps worker processes between epochs, so it needs "
                                 "num_workers > 0.")
    if data is None and num_workers > 0:
        raise ConfigurationError(
            f"num_workers={num_workers} is not supported for an IterableDataset (every rank already reads "
            "the whole stream); use num_workers=0, or a map-style dataset to load with workers."
        )


def _wrap_dataset(dataset: Any, collate_fn: Callable[[list], Any] | None) -> TensorData | MapData | None:
    """Classify ``dataset``: tensor fast path, map-style with collate, or ``None`` for a stream."""
    if isinstance(dataset, IterableDataset):
        return None
    tensors = _as_tensors(dataset)
    if tensors is not None:
        data = TensorData(tensors, single=not isinstance(dataset, (tuple, TensorDataset)))
        return data if collate_fn is None else MapData(data, collate_fn)
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigurationError(
            f"cannot load a {type(dataset).__name__}: pass a map-style Dataset (with __getitem__ and __len__), "
            "an IterableDataset, a tensor or NumPy array, or a tuple of equal-length tensors/arrays."
        )
    return MapData(dataset, collate_fn if collate_fn is not None else default_collate)


def _as_tensors(dataset: Any) -> tuple[torch.Tensor, ...] | None:
    """The tensors of a tensor/array dataset or a tuple of them; ``None`` for anything else."""
    arrays = (torch.Tensor, np.ndarray)
    if isinstance(dataset, arrays):
        items: tuple = (dataset,)
    elif type(dataset) is TensorDataset:  # a subclass may change __getitem__; then it is read sample by sample
        items = tuple(dataset.tensors)
    elif isinstance(dataset, tuple) and any(isinstance(item, arrays) for item in dataset):
        items = dataset
    else:
        return None
    tensors = tuple(_to_tensor(item) for item in items)
    _check_lengths(tensors)
    return tensors


def _to_tensor(item: Any) -> torch.Tensor:
    """A tensor sharing memory with ``item`` where possible (read-only arrays are copied)."""
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, np.ndarray):
        return torch.from_numpy(item if item.flags.writeable else item.copy())
    raise ConfigurationError(
        f"a tuple dataset must hold only tensors or NumPy arrays, not {type(item).__name__}; "
        "convert it, or pass a map-style Dataset."
    )


def _check_lengths(tensors: tuple[torch.Tensor, ...]) -> None:
    """Require at least one dimension and the same first dimension everywhere."""
    if any(t.ndim == 0 for t in tensors):
        raise ConfigurationError("a tensor dataset needs a first (sample) dimension; got a 0-d tensor.")
    lengths = [len(t) for t in tensors]
    if len(set(lengths)) != 1:
        raise ConfigurationError(f"the tensors of a tuple dataset have different lengths {lengths}; they must be equal.")
