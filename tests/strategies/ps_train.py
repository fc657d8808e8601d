"""Training under a strategy, for the tests: ``python ps_train.py MODE OUT [options]``.

MODE is ``dp`` (px.DataParallel), ``sync``/``async`` (px.ParameterServer) or ``cs``
(px.CentralStorage). ``--loop custom`` trains 30 steps of an MLP with Adam by hand (the
documented custom-loop API); ``--loop fit`` uses px.fit (with ``--clip-norm``, ``--clip-value`` and ``--step-lr``, its clipping
and a torch scheduler). Rank 0 saves the state dict to OUT.
"""

import argparse
import faulthandler
import os
import signal
import threading
import time

import torch
import torch.nn.functional as F

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("out")
parser.add_argument("--loop", default="custom")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--verbose", type=int, default=0)
parser.add_argument("--accumulate-steps", type=int, default=1)
parser.add_argument("--kill-rank-at-step", type=int, nargs=2, default=None, metavar=("RANK", "STEP"))
parser.add_argument("--kill-server-after", type=float, default=None)
parser.add_argument("--clip-norm", type=float, default=None)
parser.add_argument("--clip-value", type=float, default=None)
parser.add_argument("--step-lr", type=int, default=None, help="a torch StepLR scheduler of this step_size")
parser.add_argument("--start-after", default=None, metavar="FILE", help="every process waits for FILE after px.init()")
args = parser.parse_args()

torch.set_num_threads(1)
px.init()
deadline = time.monotonic() + 60
while args.start_after and not os.path.exists(args.start_after) and time.monotonic() < deadline:
    time.sleep(0.02)
torch.manual_seed(0)
x = torch.randn(480, 20)
y = (x[:, :3].sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
strategy = {"dp": None, "sync": px.ParameterServer("sync"), "async": px.ParameterServer("async"),
            "cs": px.CentralStorage()}[args.mode]

if args.kill_server_after is not None and px.role() == "server":
    threading.Timer(args.kill_server_after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
elif args.kill_server_after is not None:  # a worker the launcher has to stop says where it waited
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)



class KillAtStep(px.callbacks.Callback):
    """Worker RANK dies (SIGKILL) after its STEP-th step."""

    def on_step_end(self, step, logs, state):
        if args.kill_rank_at_step and px.rank() == args.kill_rank_at_step[0] \
                and state.global_step == args.kill_rank_at_step[1]:
            os.kill(os.getpid(), signal.SIGKILL)


if args.loop == "fit":
    history = px.fit(model, optimizer, F.cross_entropy, (x, y), epochs=args.epochs, global_batch_size=32,
                     strategy=strategy, verbose=args.verbose, metrics=["accuracy"], checkpoint_dir=args.checkpoint_dir,
                     callbacks=[KillAtStep()], accumulate_steps=args.accumulate_steps, clip_grad_norm=args.clip_norm,
                     clip_grad_value=args.clip_value,
                     lr_schedule=None if args.step_lr is None else torch.optim.lr_scheduler.StepLR(
                         optimizer, step_size=args.step_lr, gamma=0.5))
    print(f"{px.role()} history {history.state_dict()}", flush=True)
elif px.role() == "server":
    strategy.serve(model, optimizer)
else:
    if strategy is None:
        model = px.DataParallel(model)
    else:
        model, optimizer = strategy.setup(model, optimizer)
    loader = px.data.DistributedLoader((x, y), global_batch_size=32, seed=1)
    step = 0
    while step < args.steps:
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            step += 1
            if args.kill_server_after is not None:
                time.sleep(0.05)
            if step == args.steps:
                break
    if strategy is not None:
        strategy.finish()
if args.mode == "cs":
    print(f"rank {px.rank()} optimizer state entries {len(optimizer.state)}", flush=True)
if px.rank() == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
