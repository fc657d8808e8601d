"""Accuracy effect of gradient compression on a real task (scikit-learn digits, 2 workers).

    phalanx run -n 2 benchmarks/compression_accuracy.py [--epochs 12] [--seeds 3]

Trains the same MLP (64-64-10) with px.fit under each compression, global batch 64, Adam 3e-3,
and prints the validation accuracy (360 held-out digits) per seed and its mean.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import phalanx as px

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--seeds", type=int, default=3)
args = parser.parse_args()

torch.set_num_threads(1)
px.init()
digits = load_digits()
x, y = torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)
variants = {"none": None, "fp16": "fp16", "bf16": "bf16", "topk 10%": px.TopK(0.1), "topk 5%": px.TopK(0.05),
            "topk 1%": px.TopK(0.01), "topk 5% no feedback": px.TopK(0.05, error_feedback=False)}

for name, compression in variants.items():
    accuracies = []
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = px.DataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
                                compression=compression)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        history = px.fit(model, optimizer, F.cross_entropy, (x[:1400], y[:1400]), val_data=(x[1400:], y[1400:]),
                         epochs=args.epochs, global_batch_size=64, metrics=["accuracy"], verbose=0, seed=seed)
        accuracies.append(history["val_accuracy"][-1])
    if px.is_master():
        shown = " ".join(f"{a:.2%}" for a in accuracies)
        print(f"{name:22s} mean {statistics.mean(accuracies):.2%}   ({shown})", flush=True)
