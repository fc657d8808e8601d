"""A script for `phalanx doctor`: linear regression with Gaussian noise, weights held near 0.95 (tiny steps;
SGD with momentum, so that the optimizer keeps state the doctor's memory figures count)."""

import torch
import torch.nn.functional as F

import phalanx as px

SAMPLES, FEATURES, WEIGHT, NOISE = 4096, 8, 0.95, 0.5


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x.sum(1, keepdim=True) + NOISE * torch.randn(SAMPLES, 1, generator=generator)


if __name__ == "__main__":
    torch.set_num_threads(1)
    px.init()
    model = torch.nn.Linear(FEATURES, 1, bias=False)
    torch.nn.init.constant_(model.weight, WEIGHT)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    px.fit(model, optimizer, F.mse_loss, dataset(), epochs=2, global_batch_size=64, verbose=0)
