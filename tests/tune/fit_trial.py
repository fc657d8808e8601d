"""A px.fit trial: an MLP on a separable task for 5 epochs; the study's third trial (id 2, or the
id given as the first argument) gets random labels, so its validation loss is bad from the start
and the pruner should stop it."""

import os
import sys

import torch
import torch.nn.functional as F

import phalanx as px

torch.set_num_threads(1)
params = px.tune.params(lr=0.01)
generator = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=generator)
y = (x[:, 0] > 0).long()
if os.environ.get("PHALANX_TUNE_TRIAL") == (sys.argv[1] if len(sys.argv) > 1 else "2"):
    y = torch.randint(0, 2, (256,), generator=generator)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
history = px.fit(model, torch.optim.Adam(model.parameters(), lr=params["lr"]), F.cross_entropy, (x[:192], y[:192]),
                 val_data=(x[192:], y[192:]), epochs=5, global_batch_size=32, verbose=0)
print("epochs trained", len(history["loss"]), flush=True)
