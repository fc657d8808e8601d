"""Ranks holding different datasets are stopped at the first batch, on every rank, with the ranks named."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from phalanx.data import DistributedLoader
from phalanx.data._batch import MapData
from phalanx.data.fingerprint import content_digest, sample_digest
from tests.harness import run_workers


def test_digest_reads_content_not_identity() -> None:
    a = (torch.arange(6.0).view(2, 3), {"label": np.array([1, 2]), "name": "x"}, [1.5, None])
    b = (torch.arange(6.0).view(2, 3), {"label": np.array([1, 2]), "name": "x"}, [1.5, None])
    assert content_digest(a) == content_digest(b)
    assert content_digest(torch.arange(6.0)) != content_digest(torch.arange(6.0).view(2, 3))  # shape counts
    assert content_digest(torch.zeros(3)) != content_digest(torch.zeros(3, dtype=torch.float64))
    assert content_digest(torch.tensor([1.0, 2.0])) != content_digest(torch.tensor([1.0, 2.5]))
    assert content_digest(torch.ones(2, dtype=torch.bfloat16)) == content_digest(torch.ones(2, dtype=torch.bfloat16))
    assert content_digest(object()) == content_digest(object())  # unreadable objects: their type only


class Augmented(Dataset):
    """Random augmentation in __getitem__, as image datasets do."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3,), float(index)) + torch.rand(3) + random.random() + float(np.random.rand())


def test_random_augmentation_gives_the_same_digest_and_leaves_the_generators_alone() -> None:
    data = MapData(Augmented(), torch.utils.data.default_collate)
    torch.manual_seed(1)
    first = sample_digest(data)
    state = torch.get_rng_state()
    torch.manual_seed(2)
    assert sample_digest(data) == first
    assert sample_digest(MapData([torch.ones(3)] * 100, torch.utils.data.default_collate)) != first
    torch.manual_seed(1)
    sample_digest(data)
    assert torch.equal(torch.get_rng_state(), state)


def _iterate(kind: str, per_rank: bool, check: bool = True, seed_per_rank: bool = False) -> list[float]:
    import phalanx as px

    torch.manual_seed(100 + px.rank() if per_rank else 0)
    seed = px.rank() if seed_per_rank else 0
    if kind == "tensors":
        dataset = (torch.randn(64, 4), torch.randint(0, 3, (64,)))
    elif kind == "map":
        dataset = [torch.randn(4) for _ in range(64)]
    else:
        values = torch.randn(64).tolist()

        class Stream(IterableDataset):
            def __iter__(self):
                return iter(values)
        dataset = Stream()
    loader = DistributedLoader(dataset, global_batch_size=16, seed=seed, check_same_data=check)
    started = time.perf_counter()
    first = next(iter(loader))
    return [time.perf_counter() - started, float(first[0].sum() if kind == "tensors" else first.sum())]


@pytest.mark.parametrize("kind", ["tensors", "map", "stream"])
def test_different_data_raises_on_every_rank(kind: str) -> None:
    started = time.monotonic()
    errors = run_workers(_iterate, 3, kind, True, expect_failure=True)
    assert time.monotonic() - started < 30
    for error in errors:
        assert "DataMismatchError" in error and "the ranks do not hold the same data" in error, error
        assert "Ranks [1, 2] differ from rank 0" in error and "check_same_data=False" in error


def test_a_different_seed_is_named() -> None:
    errors = run_workers(_iterate, 2, "tensors", False, True, True, expect_failure=True)
    for error in errors:
        assert "seed differ" in error and "rank 0: seed=0; rank 1: seed=1" in error, error


@pytest.mark.parametrize("kind", ["tensors", "map", "stream"])
def test_the_same_data_passes_and_the_opt_out_skips_the_check(kind: str) -> None:
    same = run_workers(_iterate, 3, kind, False)
    assert all(seconds < 1.0 for seconds, _ in same)
    rank_local = run_workers(_iterate, 2, kind, True, False)
    assert len(rank_local) == 2


def _advice_followed(path: str) -> dict:
    """Rank-local data through ``path``; the mismatch message's advice, then the same call with it followed."""
    import phalanx as px
    import phalanx.data
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(100 + px.rank())
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    data = DataLoader(TensorDataset(x, y), batch_size=16) if path.endswith("dataloader") else (x, y)

    def run(train_data: object) -> None:
        if path.startswith("fit"):
            model = torch.nn.Linear(4, 3)
            px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy, train_data,
                   epochs=1, global_batch_size=16, verbose=0)
        else:
            list(train_data)

    try:
        run(phalanx.data.from_dataloader(data, 16) if path == "from_dataloader" else
            DistributedLoader(data, 16) if path == "loader" else data)
    except px.DataMismatchError as error:
        advice = str(error).split("If each rank's data is its own by design, ")[1]
    called = re.search(r"\b(DistributedLoader|from_dataloader)\(", advice)
    if called is None or "check_same_data=False" not in advice:
        return {"advice": advice, "followed": False}
    run(getattr(phalanx.data, called.group(1))(data, 16, check_same_data=False))
    return {"advice": advice, "followed": True}


@pytest.mark.parametrize("path", ["loader", "from_dataloader", "fit tensors", "fit dataloader"])
def test_the_advice_to_skip_the_check_works_in_the_call_the_user_ran(path: str) -> None:
    for result in run_workers(_advice_followed, 2, path):
        assert result["followed"], result["advice"]
