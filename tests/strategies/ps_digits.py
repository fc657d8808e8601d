"""Digits under a strategy, for the tests: ``python ps_digits.py MODE LR EPOCHS`` prints rank 0's
validation accuracy per epoch."""

import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import phalanx as px

torch.set_num_threads(1)
mode, lr, epochs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
d = load_digits(); X = torch.tensor(d.data, dtype=torch.float32)/16; Y = torch.tensor(d.target)
order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(0)); tr, va = order[:1437], order[1437:]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters(), lr=lr)
s = px.ParameterServer(mode) if mode != "dp" else None
h = px.fit(model, opt, F.cross_entropy, (X[tr], Y[tr]), val_data=(X[va], Y[va]), epochs=epochs, global_batch_size=48, metrics=["accuracy"], strategy=s, verbose=0)
if px.rank() == 0:
    print("val_accuracy", h["val_accuracy"], flush=True)
