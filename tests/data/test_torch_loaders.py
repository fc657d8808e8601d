"""A torch DataLoader in px.fit: its settings kept, its sampler replaced by phalanx's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import phalanx as px
from phalanx.data import DistributedLoader, from_dataloader
from tests.harness import run_workers


def _digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class _CountingCollate:
    """The default collate, counting the samples it saw (kept by phalanx, so it sees every sample)."""

    def __init__(self) -> None:
        self.samples = 0

    def __call__(self, items: list) -> list[torch.Tensor]:
        self.samples += len(items)
        return torch.utils.data.default_collate(items)


def _fit_digits_from_dataloaders() -> dict:
    train, val = _digits()
    collate = _CountingCollate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
    steps = []
    history = px.fit(model, optimizer, F.cross_entropy, DataLoader(train, batch_size=32, shuffle=True,
                                                                    collate_fn=collate),
                     val_data=DataLoader(val, batch_size=64), epochs=10, global_batch_size=64, metrics=["accuracy"],
                     verbose=0, callbacks=[_Steps(steps)])
    return {"accuracy": history["val_accuracy"][-1], "steps": steps, "collated": collate.samples}


class _Steps(px.callbacks.Callback):
    def __init__(self, into: list) -> None:
        self.into = into

    def on_epoch_end(self, epoch, logs, state) -> None:  # type: ignore[no-untyped-def]
        self.into.append(state.steps_per_epoch)


def test_digits_from_a_dataloader_at_two_workers() -> None:
    """1,400 digits, global batch 64 (the DataLoader's 32 is each worker's share): 22 steps an epoch."""
    results = run_workers(_fit_digits_from_dataloaders, 2, timeout=150)
    for result in results:
        assert result["steps"] == [22] * 10
        assert result["accuracy"] >= 0.95
        # its collate_fn built every batch of this worker's half (and the few samples the data check digests)
        assert 700 * 10 <= result["collated"] <= 700 * 10 + 16
    assert results[0]["accuracy"] == results[1]["accuracy"]


def _weights_after(data: object) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), F.cross_entropy, data, epochs=2,
           global_batch_size=8, verbose=0, seed=5)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_as_the_dataset() -> bool:
    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(30, 4, generator=generator), torch.randint(0, 3, (30,), generator=generator))
    from_loader = _weights_after(DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True))
    from_dataset = _weights_after(DistributedLoader(dataset, 8, shuffle=True, seed=5, drop_last=True))
    return all(torch.equal(from_loader[k], from_dataset[k]) for k in from_loader)


def test_the_sampler_is_phalanx_s_own_and_the_rest_is_kept() -> None:
    """The same steps as the dataset given directly (shuffled with phalanx's seed, drop_last kept)."""
    assert run_workers(_same_as_the_dataset, 2) == [True, True]


class _Pids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(os.getpid()), torch.tensor(index)


def _worker_pids(persistent: bool) -> list[set[int]]:
    initialised: list[int] = []
    loader = from_dataloader(DataLoader(_Pids(), batch_size=4, num_workers=2, persistent_workers=persistent,
                                        worker_init_fn=initialised.append), 4, rank=0, world_size=1)
    return [{int(pid) for pids, _ in loader for pid in pids} for _ in range(2)]


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers_are_kept_from_epoch_to_epoch(persistent: bool) -> None:
    first, second = _worker_pids(persistent)
    assert len(first) == 2 and os.getpid() not in first
    assert (first == second) is persistent


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(10))


def _stream_steps() -> list[list[float]]:
    loader = from_dataloader(DataLoader(_Stream(), batch_size=2), 4)
    return [batch[0].view(-1).tolist() for batch in loader]


def test_a_stream_is_split_by_rank_and_ends_together() -> None:
    first, second = run_workers(_stream_steps, 2)
    assert len(first) == len(second) == 3  # 10 items in global batches of 4: the last holds 2
    assert sorted(x for batch in first + second for x in batch) == [float(i) for i in range(10)]


@pytest.mark.parametrize("loader, message", [
    (DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=3), r"batch_size=3 disagrees with global_batch_size=4"),
    (DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=None), "batch_size=None"),
    (DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4,
                sampler=WeightedRandomSampler([1.0] * 8, 8)), "sampler is a WeightedRandomSampler"),
    (DataLoader(TensorDataset(torch.zeros(8, 1)), batch_sampler=[[0, 1, 2, 3], [4, 5, 6, 7]]), "batch_sampler"),
])
def test_what_a_dataloader_cannot_keep_is_refused(loader: DataLoader, message: str) -> None:
    with pytest.raises(px.ConfigurationError, match=message):
        from_dataloader(loader, 4, rank=0, world_size=1)
