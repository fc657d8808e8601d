"""Small models shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


def cnn_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 4))


class Branchy(nn.Module):
    """A model whose second branch is used only on odd-sized inputs, and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.left = nn.Linear(16, 4)
        self.right = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.trunk(x)))
        return self.right(h) if x.shape[0] % 2 else self.left(h)


MODELS = {"mlp": mlp, "cnn": cnn, "branchy": Branchy, "cnn_bn": cnn_bn}


def data(model: str, samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (samples, 1, 6, 6) if model.startswith("cnn") else (samples, 8)
    return torch.randn(shape, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
