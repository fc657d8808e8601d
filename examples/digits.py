"""Train a small CNN on scikit-learn's handwritten digits with px.fit.

    phalanx run -n 2 examples/digits.py        # two workers
    python examples/digits.py                  # one worker: the same result
    phalanx run -n 2 examples/digits.py --checkpoint-dir runs/demo   # what `make demo` runs: resumable

The global batch is 64 whatever the number of workers; each worker takes its share of every
batch, and gradients are averaged during backward. Under `phalanx tune` the batch size, the
learning rate and its rule come from the trial (see examples/batch_size_study.py).
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import phalanx as px

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=2e-3, help="learning rate for a batch of 64")
parser.add_argument("--lr-rule", choices=("linear", "constant"), default="linear",
                    help="scale the learning rate with the batch size (linear), or keep it (constant)")
parser.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint every epoch into this folder, and resume from its latest checkpoint")
args = parser.parse_args()

torch.set_num_threads(1)
px.init()

# 1797 8x8 greyscale digits, bundled with scikit-learn: no download.
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
train, val = order[:1437], order[1437:]

torch.manual_seed(0)  # every rank builds the same model; px.DataParallel also broadcasts rank 0's
model = nn.Sequential(
    nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
)
hp = px.tune.params(global_batch_size=args.global_batch_size, lr=args.lr, lr_rule=args.lr_rule)
lr = px.scale_lr(hp["lr"], hp["global_batch_size"], base_batch_size=64) if hp["lr_rule"] == "linear" else hp["lr"]
optimizer = torch.optim.Adam(model.parameters(), lr=lr)

history = px.fit(
    model, optimizer, F.cross_entropy, (images[train], labels[train]),
    val_data=(images[val], labels[val]),
    epochs=args.epochs,
    global_batch_size=hp["global_batch_size"],
    metrics=["accuracy"],
    lr_schedule=px.lr.warmup(px.lr.cosine(lr, args.epochs), epochs=1),
    checkpoint_dir=args.checkpoint_dir,
)

if px.is_master():
    print(f"validation accuracy after {len(history.epochs)} epochs on {px.size()} workers: "  # fewer if pruned
          f"{history['val_accuracy'][-1]:.2%}")
    if args.checkpoint_dir:
        print(f"checkpoints in {args.checkpoint_dir}/: run again to resume (or to be told training is complete, "
              f"or with --epochs N to train longer), rm -r {args.checkpoint_dir} to start afresh")
