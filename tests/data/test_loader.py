"""DistributedLoader: ranks simulated in one process with explicit rank=/world_size=."""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from phalanx.data import DistributedLoader, epoch_permutation
from phalanx.data._batch import empty_like_batch
from phalanx.data._prefetch import THREAD_NAME
from phalanx.errors import ConfigurationError

torch.set_num_threads(1)


def make_loaders(dataset: Any, global_batch_size: int, world_size: int, **kwargs: Any) -> list[DistributedLoader]:
    return [DistributedLoader(dataset, global_batch_size, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def global_batches(loaders: list[DistributedLoader]) -> list[torch.Tensor]:
    """Iterate all ranks in lockstep and concatenate their shares in rank order."""
    steps = zip(*[list(loader) for loader in loaders], strict=True)
    return [torch.cat(shares) for shares in steps]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


class DictDataset(Dataset):
    """Samples are dicts: a float feature row, an int label and a name."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(i)), "y": i, "name": f"s{i}"}


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


class Boom(RuntimeError):
    pass


class FailingDataset(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 7:
            raise Boom("sample 7 is corrupt")
        return torch.tensor(i)


class RandomAugment(Dataset):
    """Each sample is its index plus worker-local randomness (as augmentation would add)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n,global_batch_size", [(103, 30), (50, 7), (12, 12), (9, 4)])
def test_every_sample_once_per_epoch_in_contiguous_rank_order(n: int, global_batch_size: int, world_size: int) -> None:
    if global_batch_size < world_size:
        pytest.skip("covered by the configuration error test")
    loaders = make_loaders(torch.arange(n), global_batch_size, world_size, seed=11)
    assert len({len(loader) for loader in loaders}) == 1
    batches = global_batches(loaders)
    assert len(batches) == len(loaders[0]) == -(-n // global_batch_size)
    assert torch.equal(torch.cat(batches), epoch_permutation(n, 11, 0))
    sizes = [loader.last_local_batch_size for loader in loaders]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == loaders[0].last_global_batch_size


def test_uneven_global_batch_30_on_4_ranks_gives_8_8_7_7() -> None:
    loaders = make_loaders(torch.arange(60), 30, 4, shuffle=False)
    first = [next(iter(loader)) for loader in loaders]
    assert [len(b) for b in first] == [8, 8, 7, 7]
    assert [loader.last_local_batch_size for loader in loaders] == [8, 8, 7, 7]
    assert all(loader.last_global_batch_size == 30 for loader in loaders)


def test_order_depends_on_seed_and_epoch() -> None:
    def epoch_order(seed: int, epoch: int) -> list[int]:
        loader = DistributedLoader(torch.arange(40), 8, seed=seed, rank=0, world_size=1)
        loader.set_epoch(epoch)
        return torch.cat(list(loader)).tolist()

    assert epoch_order(1, 0) == epoch_order(1, 0)
    assert epoch_order(1, 0) != epoch_order(2, 0)
    assert epoch_order(1, 0) != epoch_order(1, 1)
    assert sorted(epoch_order(1, 3)) == list(range(40))


def test_finishing_an_epoch_moves_to_the_next_one() -> None:
    loader = DistributedLoader(torch.arange(10), 4, seed=5, rank=0, world_size=1)
    first = torch.cat(list(loader))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0
    second = torch.cat(list(loader))
    assert torch.equal(second, epoch_permutation(10, 5, 1)) and not torch.equal(first, second)
    loader.set_epoch(1)  # the epoch just finished: set_epoch restarts it
    assert torch.equal(torch.cat(list(loader)), second)


def test_drop_last_drops_the_incomplete_batch() -> None:
    loaders = make_loaders(torch.arange(10), 4, 3, drop_last=True)
    batches = global_batches(loaders)
    assert len(batches) == len(loaders[0]) == 2
    assert all(len(b) == 4 for b in batches)


def test_empty_share_yields_zero_row_batch_with_right_shape_and_dtype() -> None:
    x = torch.arange(27, dtype=torch.float64).reshape(9, 3)
    y = torch.arange(9, dtype=torch.int32)
    loaders = make_loaders((x, y), 4, 4, shuffle=False)
    last = [list(loader)[-1] for loader in loaders]
    assert [len(bx) for bx, _ in last] == [1, 0, 0, 0]
    empty_x, empty_y = last[3]
    assert empty_x.shape == (0, 3) and empty_x.dtype == torch.float64
    assert empty_y.shape == (0,) and empty_y.dtype == torch.int32
    assert (loaders[3].last_local_batch_size, loaders[3].last_global_batch_size) == (0, 1)


def test_map_style_dataset_with_default_collate_and_empty_share() -> None:
    loaders = make_loaders(DictDataset(5), 4, 4, shuffle=False, prefetch=0)
    rank0, rank3 = list(loaders[0]), list(loaders[3])
    assert rank0[0]["x"].shape == (1, 3) and rank0[0]["y"].tolist() == [0] and rank0[0]["name"] == ["s0"]
    assert len(rank0) == len(rank3) == 2
    empty = rank3[-1]
    assert empty["x"].shape == (0, 3) and empty["x"].dtype == torch.float32
    assert empty["y"].shape == (0,) and empty["y"].dtype == torch.int64 and empty["name"] == []


def test_empty_like_batch_keeps_structure() -> None:
    batch = ([torch.ones(2, 3), np.zeros((2, 4))], {"a": torch.ones(2)}, ["x", "y"])
    lists, mapping, names = empty_like_batch(batch)
    assert lists[0].shape == (0, 3) and lists[1].shape == (0, 4) and mapping["a"].shape == (0,) and names == []


def test_numpy_arrays_are_loaded_as_tensors() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int64)
    loader = DistributedLoader((x, y), 5, shuffle=False, rank=1, world_size=2)
    bx, by = next(iter(loader))
    assert bx.dtype == torch.float32 and by.dtype == torch.int64
    assert by.tolist() == [3, 4] and torch.equal(bx, torch.from_numpy(x[3:5]))
    single = DistributedLoader(y, 5, shuffle=False, rank=0, world_size=1)
    assert isinstance(next(iter(single)), torch.Tensor)


def test_tensor_data_with_collate_fn_collates_samples() -> None:
    loader = DistributedLoader(torch.arange(6), 3, shuffle=False, rank=0, world_size=1, collate_fn=lambda s: [int(v) for v in s])
    assert list(loader) == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_iterable_dataset_ranks_share_each_chunk(shuffle: bool) -> None:
    loaders = make_loaders(Stream(23), 8, 3, shuffle=shuffle, seed=4)
    batches = global_batches(loaders)
    assert [len(b) for b in batches] == [8, 8, 7]
    order = torch.cat(batches).tolist()
    assert sorted(order) == list(range(23))
    assert (order == list(range(23))) != shuffle
    with pytest.raises(TypeError):
        len(loaders[0])
    assert len(DistributedLoader(SizedStream(23), 8, rank=0, world_size=3)) == 3


def test_iterable_dataset_resumes_mid_stream_at_another_world_size() -> None:
    full = torch.cat(global_batches(make_loaders(Stream(23), 6, 2, seed=4)))
    first = DistributedLoader(Stream(23), 6, seed=4, rank=0, world_size=2)
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    resumed = make_loaders(Stream(23), 6, 3)
    for loader in resumed:
        loader.load_state_dict(state)
    assert torch.equal(torch.cat(global_batches(resumed)), full[12:])


@pytest.mark.parametrize("new_world_size,new_batch", [(3, 12), (4, 12), (1, 12), (3, 9)])
def test_resume_mid_epoch_at_another_world_size_continues_exactly(new_world_size: int, new_batch: int) -> None:
    n, seed = 101, 7
    uninterrupted = epoch_permutation(n, seed, 2)
    old = make_loaders(torch.arange(n), 12, 2, seed=seed)
    iterators = []
    for loader in old:
        loader.set_epoch(2)
        iterators.append(iter(loader))
    for _ in range(3):
        [next(it) for it in iterators]
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["consumed"] == 36 and state["epoch"] == 2
    new = make_loaders(torch.arange(n), new_batch, new_world_size)
    for loader in new:
        loader.load_state_dict(state)
        loader.set_epoch(2)  # the usual call at the top of the epoch keeps the position
    assert new[0].steps_remaining == -(-(n - 36) // new_batch)
    assert torch.equal(torch.cat(global_batches(new)), uninterrupted[36:])
    assert new[0].state_dict()["epoch"] == 3


def test_position_counts_handed_batches_not_prefetched_ones() -> None:
    loader = DistributedLoader(torch.arange(40), 4, prefetch=3, rank=0, world_size=1)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["consumed"] == 4
    loader.close()


def test_load_state_rejects_another_dataset() -> None:
    state = DistributedLoader(torch.arange(10), 2, rank=0, world_size=1).state_dict()
    with pytest.raises(ConfigurationError, match="11"):
        DistributedLoader(torch.arange(11), 2, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="lacks"):
        DistributedLoader(torch.arange(10), 2, rank=0, world_size=1).load_state_dict({"epoch": 0})


def test_invalid_configuration_raises() -> None:
    with pytest.raises(ConfigurationError, match="global_batch_size >= 4"):
        DistributedLoader(torch.arange(10), 3, rank=0, world_size=4)
    with pytest.raises(ConfigurationError):
        DistributedLoader(torch.arange(10), 0, rank=0, world_size=1)
    with pytest.raises(ConfigurationError):
        DistributedLoader(torch.arange(10), 4, rank=2, world_size=2)
    with pytest.raises(ConfigurationError):
        DistributedLoader((torch.arange(10), torch.arange(9)), 4, rank=0, world_size=1)
    with pytest.raises(ConfigurationError):
        DistributedLoader(Stream(4), 4, num_workers=1, rank=0, world_size=1)
    with pytest.raises(ConfigurationError):
        DistributedLoader(torch.arange(10), 4, prefetch=-1)


def test_defaults_to_rank_0_of_1_without_runtime() -> None:
    loader = DistributedLoader(torch.arange(10), 4)
    assert (loader.rank, loader.world_size, len(loader)) == (0, 1, 3)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_errors_while_loading_reach_the_consumer(prefetch: int) -> None:
    loader = DistributedLoader(FailingDataset(), 4, shuffle=False, prefetch=prefetch, rank=0, world_size=1)
    seen = []
    with pytest.raises(Boom, match="corrupt"):
        for batch in loader:
            seen.append(batch)
    assert len(seen) == 1
    assert not prefetch_threads()


def test_breaking_early_leaves_no_thread() -> None:
    loader = DistributedLoader(torch.arange(100), 2, prefetch=2, rank=0, world_size=1)
    for _ in loader:
        break
    assert not prefetch_threads()
    iterator = iter(loader)
    next(iterator)
    assert prefetch_threads()
    loader.close()
    assert not prefetch_threads()
    iterator = iter(loader)
    next(iterator)
    del iterator
    gc.collect()
    assert not prefetch_threads()


def test_workers_match_in_process_loading_and_seed_augmentation() -> None:
    def run(num_workers: int) -> list[torch.Tensor]:
        loader = DistributedLoader(RandomAugment(), 4, seed=3, num_workers=num_workers, rank=1, world_size=2)
        return list(loader)

    with_workers, again, in_process = run(2), run(2), run(0)
    assert [b[:, 0].tolist() for b in with_workers] == [b[:, 0].tolist() for b in in_process]
    assert all(torch.equal(a, b) for a, b in zip(with_workers, again))
