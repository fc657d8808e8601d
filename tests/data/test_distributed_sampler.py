"""A DDP script's DataLoader (sampler=DistributedSampler) is adopted: its shuffle and seed kept, one log line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.elastic.utils.data import ElasticDistributedSampler
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx as px
from phalanx.data import DistributedLoader, from_dataloader, torch_loaders
from tests.harness import run_workers

LOGGER = "phalanx.data.torch_loaders"


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(30, 4, generator=generator), torch.randint(0, 3, (30,), generator=generator))


class _Lines(logging.Handler):
    """The messages logged by phalanx.data.torch_loaders, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger(LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _epochs(loader: DistributedLoader) -> list[list[torch.Tensor]]:
    batches = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches.append([x for x, _ in loader])
    return batches


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(map(torch.equal, x, y)) for x, y in zip(a, b))


def _iterate_ddp_loaders() -> dict:
    torch_loaders._said_sampler_replaced = False  # a fresh process, whatever the parent did
    lines, data = _Lines(), _data()
    ddp = from_dataloader(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=7)), 8)
    plain = from_dataloader(DataLoader(data, batch_size=4, shuffle=True), 8, seed=7)
    ddp_in_order = from_dataloader(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False)), 8)
    in_order = from_dataloader(DataLoader(data, batch_size=4), 8)
    return {"seed": ddp.seed, "shuffled alike": _same(_epochs(ddp), _epochs(plain)),
            "in order alike": _same(_epochs(ddp_in_order), _epochs(in_order)),
            "mine": [x for epoch in _epochs(ddp) for x in epoch], "lines": lines.messages}


def test_a_distributed_sampler_loader_gives_the_batches_of_shuffle_true_with_its_seed() -> None:
    results = run_workers(_iterate_ddp_loaders, 2)
    for result in results:
        assert result["seed"] == 7  # the sampler's seed, from_dataloader given none
        assert result["shuffled alike"] and result["in order alike"]
        assert len(result["lines"]) == 1, result["lines"]  # two DistributedSamplers adopted, one line
        assert "DistributedSampler" in result["lines"][0] and "seed=7 (the sampler's)" in result["lines"][0]
        assert "each worker's share" in result["lines"][0]  # batch_size=4 at 2 workers, global batch 8
    # phalanx's split, not the sampler's: the two workers' shares make every sample once per epoch
    seen = torch.cat(results[0]["mine"] + results[1]["mine"])
    assert len(seen) == 2 * 30 and len(torch.unique(seen, dim=0)) == 30


def _fit_weights(sampler_seed: int | None, fit_seed: int | None) -> dict:
    torch_loaders._said_sampler_replaced = False
    lines, data = _Lines(), _data()
    if sampler_seed is None:
        train, val = DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4)
    else:
        train = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=sampler_seed))
        val = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    seed = {} if fit_seed is None else {"seed": fit_seed}
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), F.cross_entropy, train, val_data=val, epochs=2,
           global_batch_size=8, verbose=0, **seed)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "lines": len(lines.messages)}


def test_px_fit_trains_a_ddp_loader_as_the_same_loader_with_shuffle_true() -> None:
    ddp = run_workers(_fit_weights, 2, 5, 5)
    plain = run_workers(_fit_weights, 2, None, 5)
    for rank in range(2):
        assert all(torch.equal(ddp[rank]["weights"][k], plain[rank]["weights"][k]) for k in plain[rank]["weights"])
        assert ddp[rank]["lines"] == 1  # train_data and val_data both had a DistributedSampler: one line
        assert plain[rank]["lines"] == 0


def test_px_fit_without_a_seed_takes_the_sampler_s() -> None:
    ddp = run_workers(_fit_weights, 2, 7, None)
    plain = run_workers(_fit_weights, 2, None, 7)
    assert all(torch.equal(ddp[0]["weights"][k], plain[0]["weights"][k]) for k in plain[0]["weights"])


def test_the_sampler_s_seed_is_taken_unless_one_is_given(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    data = _data()
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=7))
    monkeypatch.setattr(torch_loaders, "_said_sampler_replaced", False, raising=False)
    assert from_dataloader(loader, 8, rank=0, world_size=1).seed == 7
    assert from_dataloader(DataLoader(data, batch_size=8, shuffle=True), 8, rank=0, world_size=1).seed == 0
    monkeypatch.setattr(torch_loaders, "_said_sampler_replaced", False, raising=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        given = from_dataloader(loader, 8, seed=3, rank=0, world_size=1)
    assert given.seed == 3
    assert "seed=3 (the seed passed, not the sampler's 7)" in caplog.text


def test_drop_last_and_another_split_of_the_sampler_are_replaced(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    data = _data()
    sampler = DistributedSampler(data, num_replicas=4, rank=3, drop_last=True)  # 28 of 30 samples, 7 per replica
    monkeypatch.setattr(torch_loaders, "_said_sampler_replaced", False, raising=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        adopted = from_dataloader(DataLoader(data, batch_size=10, sampler=sampler), 10, rank=0, world_size=1)
    assert len(adopted) == 3 and sum(len(x) for x, _ in adopted) == 30  # every sample, nothing dropped or padded
    assert len(caplog.records) == 1
    assert "drop_last=True" in caplog.text and "num_replicas=4, rank=3" in caplog.text


class _Tagged(DistributedSampler):
    """A DistributedSampler subclass that draws the same indices (it only carries a name)."""

    name = "train"


def test_a_subclass_drawing_the_same_indices_is_adopted_others_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data()
    monkeypatch.setattr(torch_loaders, "_said_sampler_replaced", False, raising=False)
    tagged = DataLoader(data, batch_size=8, sampler=_Tagged(data, num_replicas=1, rank=0, shuffle=False))
    assert from_dataloader(tagged, 8, rank=0, world_size=1).shuffle is False
    elastic = DataLoader(data, batch_size=8, sampler=ElasticDistributedSampler(data, num_replicas=1, rank=0))
    with pytest.raises(px.ConfigurationError, match="ElasticDistributedSampler, which draws its own indices"):
        from_dataloader(elastic, 8, rank=0, world_size=1)
