"""The digits CNN again, with a hand-written loop instead of px.fit.

    phalanx run -n 2 examples/custom_loop.py
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import phalanx as px

torch.set_num_threads(1)
px.init()  # joins the job `phalanx run` started (or a world of one)

digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
train, val = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).split([1437, 360])

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(32 * 4 * 4, 10))
model = px.DataParallel(model)  # broadcasts rank 0's weights; averages gradients in backward
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

# The global batch is 64 on any number of workers; each worker gets its share of every batch.
loader = px.data.DistributedLoader((x[train], y[train]), global_batch_size=64, shuffle=True, seed=0)

for epoch in range(15):
    loader.set_epoch(epoch)  # the same shuffle on every worker, a new one each epoch
    for inputs, targets in loader:
        optimizer.zero_grad()
        if len(targets) == 0:  # the last batch may leave a worker without samples
            model.reduce_without_data()
        else:
            F.cross_entropy(model(inputs), targets).backward()  # .grad now holds the global average
        optimizer.step()

# Each worker scores its share of the validation set; sums and counts are added over workers.
model.eval()
with torch.no_grad():
    start, stop = px.data.share_bounds(len(val), px.size(), px.rank())
    mine = val[start:stop]
    correct = (model(x[mine]).argmax(1) == y[mine]).sum()
totals = px.allreduce(torch.stack([correct, torch.tensor(len(mine))]), op="sum")
if px.is_master():
    print(f"validation accuracy on {px.size()} workers: {totals[0] / totals[1]:.2%}")
