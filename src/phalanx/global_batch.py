"""Which samples each rank reads: pure index arithmetic for global-batch data parallelism.

Nothing here talks to other processes: every rank calls the same functions with the same
arguments and gets the same answer, which is what keeps ranks in step without communication.
It sits at the bottom beside ``errors.py``, so the loader (``data/``), reproducible mode's
micro-batch seeds (``parallel/``) and checkpoints (``train/``) share one arithmetic.

The model, in one paragraph: for epoch ``e`` every rank draws the same permutation of the
``n`` sample indices (seeded by ``(seed, e)``). Global batches are consecutive chunks of
``global_batch_size`` indices of that permutation. Rank ``r`` of ``W`` takes a contiguous,
sample-level share of each global batch (:func:`share_bounds`); shares differ in size by at
most one and are laid out in rank order, so concatenating the shares of ranks ``0..W-1``
gives back the global batch.
"""

from __future__ import annotations

import hashlib

import torch

from phalanx.errors import ConfigurationError

__all__ = [
    "mix_seed",
    "epoch_seed",
    "epoch_permutation",
    "num_steps",
    "epoch_plan",
    "share_bounds",
    "local_share",
    "validate_global_batch_size",
    "validate_rank",
]

_SEED_BITS = 63


def mix_seed(*values: int) -> int:
    """Hash integers into a non-negative 63-bit seed, identically in every process.

    Python's ``hash`` is salted per process for some types and weak for small integers;
    a cryptographic digest gives well-spread, reproducible seeds for ``(seed, epoch, ...)``.
    """
    data = b"".join(int(v).to_bytes(16, "little", signed=True) for v in values)
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch ``epoch``: a hash of ``(seed, epoch)``."""
    return mix_seed(seed, epoch)


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits the ``num_samples`` indices (int64 tensor).

    With ``shuffle=False`` the order is ``0..num_samples-1`` for every epoch.
    """
    _check_non_negative("num_samples", num_samples)
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.int64)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def num_steps(num_samples: int, global_batch_size: int, drop_last: bool = False, start: int = 0) -> int:
    """How many global batches cover ``num_samples`` indices from position ``start`` on.

    The last, incomplete batch counts unless ``drop_last``.
    """
    _check_positive("global_batch_size", global_batch_size)
    remaining = max(num_samples - start, 0)
    if drop_last:
        return remaining // global_batch_size
    return -(-remaining // global_batch_size)


def epoch_plan(
    num_samples: int,
    global_batch_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
    start: int = 0,
) -> list[torch.Tensor]:
    """The global index batches of one epoch, starting at sample position ``start``.

    ``start`` is the number of samples of the epoch's permutation already consumed (for
    resuming); chunking restarts there, so a resumed epoch continues with the next sample.
    Each entry is a view into the permutation; entry ``k`` is the global batch of step ``k``.
    """
    _check_positive("global_batch_size", global_batch_size)
    if not 0 <= start <= num_samples:
        raise ConfigurationError(
            f"start={start} is outside the epoch of {num_samples} samples; pass 0 <= start <= {num_samples}."
        )
    rest = epoch_permutation(num_samples, seed, epoch, shuffle)[start:]
    usable = num_steps(len(rest), global_batch_size, drop_last) * global_batch_size
    rest = rest[:usable]
    if len(rest) == 0:
        return []
    return list(rest.split(global_batch_size))


def share_bounds(batch_len: int, world_size: int, rank: int, granularity: int = 1) -> tuple[int, int]:
    """The ``[start, stop)`` slice of a global batch of ``batch_len`` samples that ``rank`` takes.

    The batch is cut into ``ceil(batch_len / granularity)`` units (samples by default, virtual
    micro-batches in reproducible mode; the last unit may be short). Rank ``r`` gets
    ``units // world_size`` of them, plus one if ``r < units % world_size``, as a contiguous range
    in rank order. Contiguity lets later layers cut each share into micro-batches in place.
    """
    _check_non_negative("batch_len", batch_len)
    _check_positive("granularity", granularity)
    validate_rank(world_size, rank)
    units = -(-batch_len // granularity)
    base, extra = divmod(units, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return min(start * granularity, batch_len), min(stop * granularity, batch_len)


def local_share(global_batch: torch.Tensor, world_size: int, rank: int, granularity: int = 1) -> torch.Tensor:
    """The indices of ``global_batch`` that ``rank`` processes (a contiguous view, maybe empty)."""
    start, stop = share_bounds(len(global_batch), world_size, rank, granularity)
    return global_batch[start:stop]


def validate_global_batch_size(global_batch_size: int, world_size: int) -> None:
    """Raise :class:`ConfigurationError` unless every rank gets a sample of each full batch."""
    _check_positive("global_batch_size", global_batch_size)
    _check_positive("world_size", world_size)
    if global_batch_size < world_size:
        raise ConfigurationError(
            f"global_batch_size={global_batch_size} is smaller than world_size={world_size}, so some ranks "
            f"would get no sample of a full global batch. Use global_batch_size >= {world_size} "
            f"(ideally a multiple of {world_size}) or run on fewer ranks."
        )


def validate_rank(world_size: int, rank: int) -> None:
    """Raise :class:`ConfigurationError` for a world size below one or a rank outside ``[0, world_size)``."""
    _check_positive("world_size", world_size)
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} is not in [0, {world_size}); pass 0 <= rank < world_size.")


def _check_positive(name: str, value: int) -> None:
    """Reject anything but an integer >= 1."""
    if not _is_int(value) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an integer >= 1.")


def _check_non_negative(name: str, value: int) -> None:
    """Reject anything but an integer >= 0."""
    if not _is_int(value) or value < 0:
        raise ConfigurationError(f"{name}={value!r} must be an integer >= 0.")


def _is_int(value: object) -> bool:
    """True for Python and NumPy integers, false for bools (a frequent argument mix-up)."""
    return not isinstance(value, bool) and hasattr(value, "__index__") and not isinstance(value, torch.Tensor)
