"""Every level of px.Sharded and px.DataParallel, trained one after the other in one job, for the
tests across hosts: ``phalanx run ... sharded_hosts.py OUT CHECKPOINTS``. Each run starts from the
same weights; rank 0 saves ``{(level, shared_memory): state dict}`` to OUT, and each rank says how
each run reduced and whether it gathered. Levels 1-2 with ``shared_memory=False`` shard across the
hosts; by default (``"auto"``) they keep one copy per host (Adam at 2 hosts of 2 workers holds no
more so), level 3 shards across the hosts unless ``shared_memory=True``. Level 2's default trains
one epoch into CHECKPOINTS, then resumes there for the second. Level 2 in reproducible mode trains
one epoch both ways (keyed ``(2, shared_memory, "reproducible")``): the same bits.

62 samples in global batches of 30 at 4 workers end on a step of 2 samples, which leaves two workers
without any (level 3 then gathers on a batch of no rows).
"""

import sys

import torch
import torch.nn.functional as F

import phalanx as px


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """62 samples of 10 features, 3 classes."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(62, 10, generator=generator)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def train(level: int, shared_memory: bool | str, epochs: int, checkpoints: str | None,
          reproducible: bool = False, seed: int = 0) -> tuple[torch.nn.Module, px.Sharded | None]:
    """The model trained from the start ``seed`` makes at ``level`` (0: px.DataParallel), and its strategy."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=shared_memory) if level else None
    px.fit(model, optimizer, F.cross_entropy, data(), epochs=epochs, global_batch_size=30, clip_grad_norm=0.05,
           verbose=0, strategy=strategy, checkpoint_dir=checkpoints, reproducible=reproducible,
           micro_batch_size=5 if reproducible else None)
    return model, strategy


def main(out: str, checkpoints: str) -> None:
    torch.set_num_threads(1)
    px.init()
    weights = {}
    runs = [(0, "auto", 2, None), (1, False, 2, None), (2, False, 2, None), (3, "auto", 2, None),
            (1, "auto", 2, None), (2, "auto", 1, checkpoints), (2, "auto", 2, checkpoints), (3, True, 2, None)]
    reproducibly = [(2, False), (2, "auto")]
    for level, shared_memory, epochs, folder, reproducible in [(*run, False) for run in runs] + \
            [(level, shared_memory, 1, None, True) for level, shared_memory in reproducibly]:
        model, strategy = train(level, shared_memory, epochs, folder, reproducible)
        if strategy is not None:
            print(f"rank {px.rank()} level {level} shared_memory={shared_memory}: {strategy.reduction.name}, "
                  f"{strategy.layout}", flush=True)
        key = (level, shared_memory, "reproducible") if reproducible else (level, shared_memory)
        weights[key] = {name: value.detach().clone() for name, value in model.state_dict().items()}
    if px.rank() == 0:
        torch.save(weights, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
