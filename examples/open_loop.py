"""Your own step in px.fit: a DataLoader, two optimizers, bf16, clipping and OneCycleLR together.

The digits classifier's body trains with SGD and a one-cycle schedule, its head with Adam; the
step adds a penalty on the head's weights to the loss. phalanx still does the rest: each worker's
share of every global batch, autocast, the averaged gradient, its clipping, both steps, metrics.

    phalanx run -n 2 examples/open_loop.py        # or: python examples/open_loop.py
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px

EPOCHS, GLOBAL_BATCH = 12, 64

px.init()
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
train = DataLoader(TensorDataset(x[order[:1400]], y[order[:1400]]), batch_size=GLOBAL_BATCH, shuffle=True)
val = DataLoader(TensorDataset(x[order[1400:]], y[order[1400:]]), batch_size=GLOBAL_BATCH)

torch.manual_seed(0)
body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU())
head = torch.nn.Linear(256, 10)
model = torch.nn.Sequential(body, head)
body_optimizer = torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9)
head_optimizer = torch.optim.Adam(head.parameters(), lr=2e-3)
steps = px.estimated_stepping_batches(train, epochs=EPOCHS, global_batch_size=GLOBAL_BATCH)  # not len(train)
schedule = torch.optim.lr_scheduler.OneCycleLR(body_optimizer, max_lr=0.2, total_steps=steps)


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's mean loss with a penalty on the head's weights, and the outputs for accuracy."""
    inputs, targets = batch
    outputs = model(inputs)
    return F.cross_entropy(outputs, targets) + 1e-4 * head.weight.square().sum(), outputs


history = px.fit(model, [body_optimizer, head_optimizer], None, train, val_data=val, step_fn=step,
                 epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, metrics=["accuracy"], precision="bf16-mixed",
                 clip_grad_norm=1.0, lr_schedule=schedule, verbose=0)
if px.is_master():
    print(f"validation accuracy: {history['val_accuracy'][-1]:.1%}")
