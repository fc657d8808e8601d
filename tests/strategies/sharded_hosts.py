"""Every level of px.Sharded and px.DataParallel, trained one after the other in one job, for the
tests across hosts: ``phalanx run ... sharded_hosts.py OUT CHECKPOINTS``. Each run starts from the
same weights; rank 0 saves ``{level: state dict}`` to OUT (``("replicas", level)``: each host its
own copy in shared memory, ``shared_memory=True``), and each rank says how its level 2 reduced and
how the replicas' runs reduced and gathered. The replicas' level 2 trains one epoch into
CHECKPOINTS, then resumes there for the second.

62 samples in global batches of 30 at 4 workers end on a step of 2 samples, which leaves two workers
without any (level 3 then gathers on a batch of no rows).
"""

import sys

import torch
import torch.nn.functional as F

import phalanx as px

torch.set_num_threads(1)
px.init()
generator = torch.Generator().manual_seed(7)
x = torch.randn(62, 10, generator=generator)
y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
weights = {}
runs = [(level, "auto", 2, None) for level in (0, 1, 2, 3)]
runs += [(1, True, 2, None), (2, True, 1, sys.argv[2]), (2, True, 2, sys.argv[2]), (3, True, 2, None)]
for level, shared_memory, epochs, checkpoints in runs:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    strategy = px.Sharded(level=level, fusion_threshold_mb=0.001, shared_memory=shared_memory) if level else None
    px.fit(model, optimizer, F.cross_entropy, (x, y), epochs=epochs, global_batch_size=30, clip_grad_norm=0.05,
           verbose=0, strategy=strategy, checkpoint_dir=checkpoints)
    if level == 2 and shared_memory == "auto":
        print(f"rank {px.rank()} level 2 reduced by {strategy.reduction.name}", flush=True)
    if shared_memory is True:
        print(f"rank {px.rank()} replicas at level {level}: {strategy.reduction.name}, "
              f"{'gathered' if strategy.gathering is not None else 'nothing gathered'}", flush=True)
    weights[level if shared_memory == "auto" else ("replicas", level)] = {
        name: value.detach().clone() for name, value in model.state_dict().items()}
if px.rank() == 0:
    torch.save(weights, sys.argv[1])
