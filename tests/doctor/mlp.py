"""A script for `phalanx doctor`'s prediction tests: an MLP trained by px.fit, steps of ~20 ms of
compute (steady enough that two runs of one configuration agree within a few percent here)."""

import torch
import torch.nn.functional as F

import phalanx as px

SAMPLES, FEATURES, HIDDEN, CLASSES, BATCH = 4096, 256, 1024, 10, 128


if __name__ == "__main__":
    torch.set_num_threads(1)
    px.init()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES] * 3).argmax(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), F.cross_entropy, (x, y), epochs=1,
           global_batch_size=BATCH, verbose=0)
