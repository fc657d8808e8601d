"""Train the digits CNN with px.fit on a Ray cluster: Ray runs the workers, phalanx the training.

    pip install 'phalanx[ray]'
    python examples/ray_digits.py                     # a local Ray cluster, 2 CPU workers
    python examples/ray_digits.py --address auto      # a running cluster (`ray start --head`)

Inside Ray Train's workers px.init() adopts the process group Ray formed, and px.fit reports
every epoch's global metrics to Ray with phalanx's checkpoint attached; Ray keeps them under
--storage. If a worker dies, Ray restarts the group (up to --max-failures times) and px.fit
resumes from the last checkpoint Ray hands back. See docs/ray.md.
"""

import argparse
import os

import ray
import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_digits(config: dict) -> None:
    """Each Ray Train worker runs this: the same px.fit as under `phalanx run`."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch import nn

    import phalanx as px

    torch.set_num_threads(1)
    px.init()  # adopts Ray's process group: px.rank() is Ray's world rank
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, val = order[:1437], order[1437:]

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    px.fit(model, optimizer, F.cross_entropy, (images[train], labels[train]),
           val_data=(images[val], labels[val]), epochs=config["epochs"], global_batch_size=64,
           metrics=["accuracy"], lr_schedule=px.lr.warmup(px.lr.cosine(config["lr"], config["epochs"]), epochs=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="a Ray cluster's address (default: start a local one)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--storage", default=os.path.abspath("runs/ray"),
                        help="where Ray keeps checkpoints and results (a folder every node sees)")
    parser.add_argument("--max-failures", type=int, default=2, help="restarts of the worker group Ray allows")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(
        train_digits,
        train_loop_config={"epochs": args.epochs, "lr": args.lr},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name="digits", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    print(f"validation accuracy after {result.metrics['epoch']} epochs on {args.workers} Ray workers: "
          f"{result.metrics['val_accuracy']:.2%}; checkpoint: {result.checkpoint.path}")


if __name__ == "__main__":
    main()
