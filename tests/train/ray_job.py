"""A Ray Train job as a user writes it, for tests/train/test_ray.py: px.fit in a TorchTrainer.

    python ray_job.py STORAGE NAME [--kill-at-epoch E]    # on the cluster at $RAY_ADDRESS
    python ray_job.py --reference DIR                      # the same training without Ray, one process

With ``--kill-at-epoch E`` rank 1 SIGKILLs itself in the middle of epoch E, on the first attempt
only; Ray restarts the group (``max_failures=1``). Prints ``RESULT`` and one JSON object: the
result's metrics and checkpoint folder, and each rank's layout and the epochs its last attempt
started at.
"""

import argparse
import json
import logging
import os
import signal
from pathlib import Path

EPOCHS = 4


def train(config: dict) -> None:
    """Every worker: reproducible px.fit of a small MLP; a trace line per rank when it ends."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx as px

    torch.set_num_threads(1)
    if config.get("log"):  # what px.fit says about resuming, where the test can read it
        handler = logging.FileHandler(config["log"])
        logging.getLogger("phalanx.train.loop").addHandler(handler)
        logging.getLogger("phalanx.train.loop").setLevel(logging.INFO)
    px.init()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    targets = (inputs.sum(dim=1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    starts = EpochStarts()
    kill = [KillOnce(config["kill_at_epoch"], Path(config["marker"]))] if config.get("kill_at_epoch") else []
    px.fit(model, optimizer, F.cross_entropy, (inputs, targets), val_data=(inputs[:64], targets[:64]),
           epochs=EPOCHS, global_batch_size=32, metrics=["accuracy"], seed=3, reproducible=True, micro_batch_size=8,
           lr_schedule=torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5),
           checkpoint_dir=config.get("checkpoint_dir"), verbose=0, callbacks=[starts, *kill])
    if config.get("trace"):
        import ray.train

        context = ray.train.get_context()
        layout = {"px": [px.rank(), px.size(), px.local_rank(), px.node_rank()],
                  "ray": [context.get_world_rank(), context.get_world_size(), context.get_local_rank(),
                          context.get_node_rank()]}
        with open(config["trace"], "a") as trace:
            trace.write(json.dumps({"layout": layout, "started": starts.started}) + "\n")


class EpochStarts:
    def __init__(self) -> None:
        self.started: list[list[int]] = []  # [epoch, step] where each epoch of this attempt began

    def on_epoch_begin(self, epoch: int, state) -> None:
        self.started.append([epoch, state.step])


class KillOnce:
    """Rank 1 dies by SIGKILL at the third step of epoch ``epoch`` (counted from 1), once."""

    def __init__(self, epoch: int, marker: Path):
        self.epoch, self.marker = epoch, marker

    def on_step_end(self, step: int, logs: dict, state) -> None:
        import phalanx as px

        if px.rank() == 1 and state.epoch + 1 == self.epoch and step == 2 and not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage", nargs="?")
    parser.add_argument("name", nargs="?")
    parser.add_argument("--kill-at-epoch", type=int, default=0)
    parser.add_argument("--reference", metavar="DIR")
    args = parser.parse_args()
    if args.reference:
        train({"checkpoint_dir": args.reference})
        return

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(log_to_driver=False)
    files = Path(args.storage) / f"{args.name}-files"
    files.mkdir(parents=True, exist_ok=True)
    config = {"kill_at_epoch": args.kill_at_epoch, "marker": str(files / "killed"), "trace": str(files / "trace"),
              "log": str(files / "log")}
    result = TorchTrainer(train, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name=args.name, storage_path=args.storage,
                                               failure_config=FailureConfig(max_failures=1))).fit()
    traces = [json.loads(line) for line in (files / "trace").read_text().splitlines()]
    print("RESULT " + json.dumps({"metrics": result.metrics, "checkpoint": result.checkpoint.path,
                                  "killed": (files / "killed").exists(), "traces": traces,
                                  "log": (files / "log").read_text().splitlines()}), flush=True)


if __name__ == "__main__":
    main()
