import torch, torch.nn.functional as F
from sklearn.datasets import load_digits                # 1,797 handwritten digits, bundled: no download
import phalanx as px

px.init()                                                # joins the job `phalanx run` started
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
train, val = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).split([1500, 297])
torch.manual_seed(0)                                     # the same initial weights on every run
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=px.scale_lr(1e-3, 128, base_batch_size=32))
history = px.fit(model, optimizer, F.cross_entropy, (x[train], y[train]), val_data=(x[val], y[val]),
                 epochs=10, global_batch_size=128, metrics=["accuracy"], checkpoint_dir="runs/quickstart")
if px.is_master():
    print(f"validation accuracy: {history['val_accuracy'][-1]:.1%} (a guess scores 10%)")
