"""A Horovod elastic training script for the tests, run by ``phalanx run -np 3 --min-workers 2``.

It trains an MLP with ``hvd.elastic.TorchState``, ``hvd.elastic.ElasticSampler``,
``hvd.DistributedOptimizer`` and ``@hvd.elastic.run``, committing after every step. It writes its
pid to ``--pids`` and rank 0's committed step to ``--progress``; at the end rank 0 saves the
weights, the size, what the reset callbacks saw (the size, and whether Horovod's negotiation and
process sets were new, the old ones closed, the user's set forgotten) and how many samples each
epoch processed. With
``--hold-at`` the job waits after that step for ``--hold-file``, which a worker started later
creates just before it asks to join.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)
SAMPLES, FEATURES, BATCH, EPOCHS = 240, 8, 4, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    for option in ("--out", "--pids", "--progress"):
        parser.add_argument(option, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--hold-file", default=None)
    args = parser.parse_args()
    with open(os.path.join(args.pids, f"{os.environ['PHALANX_RANK']}.pid"), "w") as handle:
        handle.write(str(os.getpid()))

    import phalanx.horovod.torch as hvd
    from phalanx.horovod.torch import negotiation, process_sets

    hvd.init(process_sets="dynamic")
    first = (negotiation.current(), process_sets.registry())
    pair = hvd.add_process_set([0, 1]) if hvd.size() > 1 else None  # a worker started later is alone here
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    dataset = torch.utils.data.TensorDataset(x, x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, step=0,
                                   processed=[0] * EPOCHS)
    resets: list[int] = []
    fresh: list[dict[str, bool]] = []

    def reset() -> None:
        resets.append(hvd.size())
        negotiator, registry = negotiation.current(), process_sets.registry()
        fresh.append({"negotiator": negotiator is not first[0] and first[0].closed,
                      "sets": registry is not first[1] and list(registry.sets) == [0] and registry.dynamic,
                      "pair": pair is None or pair.process_set_id is None})

    state.register_reset_callbacks([reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        for state.epoch in range(state.epoch, EPOCHS):
            if state.batch == 0:
                sampler.set_epoch(state.epoch)
            for batch_idx, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                F.mse_loss(model(data), target).backward()
                optimizer.step()
                sampler.record_batch(batch_idx, BATCH)
                state.batch += 1
                state.step += 1
                state.processed[state.epoch] = len(sampler.processed_indices)
                time.sleep(args.step_sleep)
                state.check_host_updates()
                state.commit()
                if state.step == args.hold_at:  # wait for the joiner, so that it joins before the end
                    deadline = time.monotonic() + 60
                    while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
                        time.sleep(0.02)
                    time.sleep(1.0)  # its request reaches the coordinator meanwhile
                if hvd.rank() == 0:
                    with open(args.progress + ".tmp", "w") as handle:
                        handle.write(str(state.step))
                    os.replace(args.progress + ".tmp", args.progress)
            state.batch = 0
        return state.step

    from phalanx import elastic

    if args.hold_file and elastic.membership() is None:  # started after the job did: about to ask to join
        open(args.hold_file, "w").close()
    steps = train(state)
    sums = hvd.allgather_object(float(sum(p.detach().double().sum() for p in model.parameters())))
    if hvd.rank() == 0:
        loss = F.mse_loss(model(x), dataset.tensors[1]).item()
        torch.save({"size": hvd.size(), "steps": steps, "resets": resets, "fresh": fresh, "sums": sums,
                    "loss": loss, "processed": list(state.processed)}, args.out)
    hvd.shutdown()


if __name__ == "__main__":
    main()
