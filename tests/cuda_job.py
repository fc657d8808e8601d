"""The GPU checks of tests/test_cuda.py, one per mode: ``phalanx run -n N --device cuda cuda_job.py CHECKS OUT``
(CHECKS: names separated by commas).

Every check but ``precision`` (whose reference loop is CUDA's) also runs with ``--device cpu``, which
tests/test_cuda.py does to keep the script itself working where no GPU is.

Each check trains or reduces on this worker's GPU and returns figures; rank 0 writes them to OUT
as JSON, by check name (a parameter server's process writes nothing). A small classification problem stands in
for a model: 2,048 samples of 32 features, 4 classes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.data import epoch_plan
from phalanx.train.loop import loader_for

SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH, EPOCHS = 2048, 32, 4, 128, 3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES)
    return x, x[:, :CLASSES].argmax(1)


def model(batchnorm: bool = False) -> nn.Sequential:
    torch.manual_seed(1)
    middle = [nn.BatchNorm1d(64)] if batchnorm else []
    return nn.Sequential(nn.Linear(FEATURES, 64), *middle, nn.ReLU(), nn.Linear(64, CLASSES))


def fit(net: nn.Module, **options: Any) -> dict[str, Any]:
    """``px.fit`` for EPOCHS epochs with SGD and momentum; the last accuracy and where things lived."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    history = px.fit(net, optimizer, F.cross_entropy, data(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
                     metrics=["accuracy"], verbose=0, **options)
    return {"accuracy": history["accuracy"][-1], "device": str(px.device()),
            "parameters_on": sorted({str(p.device) for p in net.parameters()})}


def weights_digest(net: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(net.state_dict().items()):
        digest.update(name.encode() + value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_fit() -> dict[str, Any]:
    """px.fit with the data kept on the GPU (the default for data this small) and copied one step
    ahead (``data_on_device=False``); both loaders' batches against a host loader's."""
    figures = fit(model())
    figures["copied_accuracy"] = fit(model(), data_on_device=False)["accuracy"]
    device = px.device() if px.device().type == "cuda" else None
    host, kept, copied = (loader_for(data(), GLOBAL_BATCH, 0, shuffle=True, device=where, data_on_device=keep)
                          for where, keep in ((None, None), (device, None), (device, False)))
    figures["kept"] = kept.placement is not None and kept.placement.resident is not None
    figures["pinned"] = copied.pin_memory
    expected = [[part.clone() for part in batch] for batch in host]
    for name, loader in (("kept", kept), ("copied", copied)):
        got = [[part.clone() for part in batch] for batch in loader]
        figures[f"{name}_batches_on"] = sorted({str(part.device) for batch in got for part in batch})
        figures[f"{name}_batches_equal"] = len(got) == len(expected) and all(
            torch.equal(a.cpu(), b) for mine, theirs in zip(got, expected) for a, b in zip(mine, theirs))
    nan = torch.tensor([1.0, float("nan"), -3.0], device=px.device())
    figures["fused_max_carries_nan"] = bool(torch._foreach_norm([nan], float("inf"))[0].isnan())
    return figures


def check_allreduce() -> dict[str, Any]:
    summed = px.allreduce(torch.full((4,), float(px.rank() + 1), device=px.device()), "sum")
    return {"is_cuda": summed.is_cuda, "value": summed.tolist()}


def check_reproducible() -> dict[str, Any]:
    net = model()
    figures = fit(net, reproducible=True, micro_batch_size=16)
    return {**figures, "digest": weights_digest(net)}


def check_precision() -> dict[str, Any]:
    """bf16 and float16 with clipping, each against the hand-written loop on this GPU (1 worker)."""
    figures = {}
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        net = model()
        fit(net, precision=precision, clip_grad_norm=0.5)
        reference = _hand_written(dtype)
        figures[precision] = max(float((a.detach() - b.detach()).abs().max())
                                 for a, b in zip(net.state_dict().values(), reference.state_dict().values()))
    return figures


def _hand_written(dtype: torch.dtype) -> nn.Module:
    net = model().cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    x, y = (t.cuda() for t in data())
    for epoch in range(EPOCHS):
        for indices in epoch_plan(SAMPLES, GLOBAL_BATCH, seed=0, epoch=epoch, shuffle=True):
            indices = torch.as_tensor(indices, device="cuda")
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=dtype):
                loss = F.cross_entropy(net(x[indices]), y[indices])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
    return net


def check_compression() -> dict[str, Any]:
    return fit(px.DataParallel(model().to(px.device()), compression="bf16"))


def check_syncbn() -> dict[str, Any]:
    return fit(px.DataParallel(model(batchnorm=True).to(px.device()), sync_batchnorm=True))


def check_central_storage() -> dict[str, Any]:
    return fit(model(), strategy=px.CentralStorage())


def check_sharded() -> dict[str, Any]:
    """px.Sharded at each level against unsharded px.fit: accuracy, where the parameters end up, and
    the largest weight difference (NCCL's reduce-scatter and all-gather with several GPUs)."""
    reference = model()
    fit(reference)
    figures: dict[str, Any] = {}
    for level in (1, 2, 3):
        net = model()
        figures[f"level {level}"] = {**fit(net, strategy=px.Sharded(level=level, fusion_threshold_mb=0.002)),
                                     "difference": max(float((a - b).abs().max()) for a, b in
                                                       zip(net.state_dict().values(), reference.state_dict().values()))}
    return figures


def check_parameter_server() -> dict[str, Any]:
    return fit(model(), strategy=px.ParameterServer())


def check_horovod() -> dict[str, Any]:
    import phalanx.horovod.torch as hvd

    hvd.init()
    net = model().to(px.device())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    x, y = (t.to(px.device()) for t in data())
    losses = []
    for step in range(30):
        rows = slice(step * 64 % SAMPLES, step * 64 % SAMPLES + 64)
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return {"first_loss": losses[0], "last_loss": losses[-1], "device": str(next(net.parameters()).device)}


def check_compile() -> dict[str, Any]:
    """``torch.compile`` over px.DataParallel: the same gradients as without, and it trains."""
    x, y = (t[:256].to(px.device()) for t in data())
    eager, compiled_net = px.DataParallel(model().to(px.device())), px.DataParallel(model().to(px.device()))
    compiled = torch.compile(compiled_net)
    F.cross_entropy(eager(x), y).backward()
    F.cross_entropy(compiled(x), y).backward()
    difference = max(float((a.grad - b.grad).abs().max())
                     for a, b in zip(eager.parameters(), compiled_net.parameters()))
    return {"gradient_difference": difference, **fit(compiled_net)}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    name[len("check_"):]: function for name, function in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    torch.set_num_threads(1)
    checks, out = sys.argv[1].split(","), sys.argv[2]
    px.init()
    figures = {check: CHECKS[check]() for check in checks}
    if px.role() == "worker" and px.rank() == 0:
        with open(out, "w") as file:
            json.dump(figures, file)
