"""Batches onto the accelerator (``DistributedLoader(device=...)``), tested on the CPU: the size
decision with a faked free memory, the copy-one-ahead order with a recording transfer, and the
batches of both ways equal to a plain loader's. tests/test_cuda.py runs them on a GPU."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from phalanx.data import DistributedLoader
from phalanx.data import _device
from phalanx.data._batch import MapData, TensorData
from phalanx.data._prefetch import THREAD_NAME
from phalanx.errors import ConfigurationError

torch.set_num_threads(1)

X, Y = torch.randn(100, 3), torch.arange(100)


class Pairs(Dataset):
    """A map-style dataset read sample by sample."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return X[index], Y[index]


def batches(loader: DistributedLoader) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(part.clone() for part in batch) for batch in loader]


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend the ``meta`` device (tensors with shapes and no data) reports ``bytes`` free."""
    def pretend(nbytes: int | None) -> None:
        monkeypatch.setattr(_device, "free_bytes", lambda device: nbytes)
    return pretend


def test_a_dataset_that_fits_is_kept_on_the_device_and_one_that_does_not_is_copied(free_memory: Any) -> None:
    data = TensorData((X, Y), single=False)  # 100 x (3 x 4 + 8) bytes = 2000 bytes
    meta = torch.device("meta")
    free_memory(4000)
    kept = _device.place(data, meta, None)
    assert kept.resident is not None and all(t.device == meta for t in kept.resident.tensors)
    assert "kept on meta" in kept.reason and "data_on_device=False" in kept.reason
    free_memory(3999)
    copied = _device.place(data, meta, None)
    assert copied.resident is None and "more than 50%" in copied.reason and "data_on_device=True" in copied.reason
    assert _device.place(data, meta, True).resident is not None  # asked for: whatever the size
    free_memory(10**9)
    assert _device.place(data, meta, False).resident is None
    free_memory(None)
    assert _device.place(data, meta, None).resident is None  # a device that does not say what is free


def test_only_tensors_can_be_kept_and_data_already_there_is_used_where_it_is(free_memory: Any) -> None:
    free_memory(10**9)
    with pytest.raises(ConfigurationError, match="read sample by sample"):
        _device.place(MapData(Pairs(), lambda samples: samples), torch.device("meta"), True)
    here = TensorData((X, Y), single=False)
    assert _device.place(here, torch.device("cpu"), None).resident is here


def test_the_next_batch_is_copied_before_the_current_one_is_handed_over() -> None:
    events: list[tuple[str, int]] = []

    class Recording:
        def start(self, batch: int) -> int:
            events.append(("start", batch))
            return batch

        def finish(self, ticket: int) -> int:
            events.append(("finish", ticket))
            return ticket * 10

    handed = []
    for item in _device.copy_ahead(iter(range(4)), Recording(), lambda k: k, lambda k, batch: batch):
        events.append(("use", item // 10))
        handed.append(item)
    assert handed == [0, 10, 20, 30]
    for k in range(3):  # batch k+1's copy is under way while batch k is used, and k waits for its own copy only
        assert events.index(("start", k + 1)) < events.index(("use", k))
        assert events.index(("start", k + 1)) < events.index(("finish", k)) < events.index(("use", k))


@pytest.mark.parametrize("world_size, micro", [(1, None), (3, None), (2, 5)])
def test_batches_gathered_from_the_kept_data_equal_a_plain_loaders(world_size: int, micro: int | None) -> None:
    options = dict(global_batch_size=20, world_size=world_size, micro_batch_size=micro, seed=3, prefetch=0)
    for rank in range(world_size):
        plain = DistributedLoader((X, Y), rank=rank, **options)
        kept = DistributedLoader((X, Y), rank=rank, device="cpu", **options)
        assert kept.placement is not None and kept.placement.resident is not None
        for epoch in range(2):
            assert [list(map(torch.equal, a, b)) for a, b in zip(batches(plain), batches(kept), strict=True)] \
                == [[True, True]] * len(plain), (rank, epoch)
            assert kept.state_dict() == plain.state_dict()


def test_a_resumed_kept_loader_continues_where_the_position_says() -> None:
    plain = DistributedLoader((X, Y), 20, rank=1, world_size=2, prefetch=0)
    expected = batches(plain)
    kept = DistributedLoader((X, Y), 20, rank=1, world_size=2, device="cpu")
    kept.load_state_dict({**plain.state_dict(), "epoch": 0, "consumed": 60})
    assert [torch.equal(a[0], b[0]) for a, b in zip(batches(kept), expected[3:], strict=True)] == [True, True]


def test_batches_copied_one_ahead_equal_a_plain_loaders_and_the_log_says_how(
        caplog: pytest.LogCaptureFixture) -> None:
    plain = DistributedLoader(Pairs(), 16, rank=0, world_size=2, seed=1)
    with caplog.at_level(logging.INFO, logger="phalanx.data"):
        copied = DistributedLoader(Pairs(), 16, rank=0, world_size=2, seed=1, device="cpu")
    assert copied.placement is not None and copied.placement.resident is None
    assert "one step ahead (the data is read sample by sample)" in copied.placement.reason
    assert copied.placement.reason in caplog.text
    got, want = batches(copied), batches(plain)
    assert len(got) == len(want) == 7 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                               for a, b in zip(got, want))


def test_leaving_a_copied_epoch_early_stops_its_prefetch_thread() -> None:
    copied = DistributedLoader(Pairs(), 16, device="cpu")
    for _ in zip(range(2), copied):
        pass
    copied.close()
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def test_a_tensor_dataset_takes_the_fast_path() -> None:
    loader = DistributedLoader(TensorDataset(X, Y), 20, shuffle=False)
    assert isinstance(loader._data, TensorData)
    first = next(iter(loader))
    assert torch.equal(first[0], X[:20]) and torch.equal(first[1], Y[:20])
