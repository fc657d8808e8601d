"""A script for `phalanx doctor`'s test of a strategy that communicates every few steps: a small MLP
trained by px.fit with px.DiLoCo(period=4)."""

import torch
import torch.nn.functional as F

import phalanx as px

PERIOD = 4

if __name__ == "__main__":
    torch.set_num_threads(1)
    px.init()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=generator)
    y = x[:, :4].argmax(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.05), F.cross_entropy, (x, y), epochs=1,
           global_batch_size=16, strategy=px.DiLoCo(period=PERIOD), verbose=0)
