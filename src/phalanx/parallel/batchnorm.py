"""Batch norm under data parallelism: a warning for small local batches, and synchronised BN.

With local statistics every rank normalises by the mean and variance of its own share of the
batch. Below about 16 samples those estimates are noisy and training suffers (Wu & He, 2018).
:class:`SyncBatchNorm` instead normalises with the statistics of the whole global batch,
exchanging per-channel sums with one small allreduce in forward and one in backward. It runs on
Gloo (CPU) as well as NCCL, unlike ``torch.nn.SyncBatchNorm``, which needs an accelerator.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from phalanx.comm import collectives, runtime

SMALL_LOCAL_BATCH = 16


def warn_if_small_local_batch(module: nn.Module, local_batch: int) -> None:
    """Warn once when local batch-norm statistics will rest on fewer than 16 samples."""
    has_local_bn = any(isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm) for m in module.modules())
    if has_local_bn and 0 < local_batch < SMALL_LOCAL_BATCH:
        warnings.warn(
            f"phalanx: each worker normalises batch-norm layers over its local batch of {local_batch} samples "
            f"(under {SMALL_LOCAL_BATCH}), so the statistics will be noisy and accuracy may drop. Use "
            "px.DataParallel(..., sync_batchnorm=True) to normalise over the global batch, or a larger batch.",
            stacklevel=3,
        )


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch: statistics are summed over all ranks in forward."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats) or runtime.size() == 1:
            return super().forward(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = 0.0 if self.momentum is None else self.momentum
        return _GlobalBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                      self.eps, momentum, self.training and self.track_running_stats)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` replaced by a :class:`SyncBatchNorm` on the
        same device and in the same dtype (a model moved to its GPU before wrapping stays there)."""
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            like = module.weight if module.weight is not None else module.running_mean
            placement = {} if like is None else {"device": like.device, "dtype": like.dtype}
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, **placement)
            converted.load_state_dict(module.state_dict())
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child))
        return module


class _GlobalBatchNorm(torch.autograd.Function):
    """Normalisation by global statistics, with the matching global reduction in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, update_running: bool) -> torch.Tensor:
        dims = [0] + list(range(2, x.dim()))
        local_count = x.numel() // x.shape[1]
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([local_count])])
        stats = collectives.allreduce(stats, "sum", check=False)
        channels = x.shape[1]
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_min(0)
        if update_running and running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * count / max(float(count) - 1, 1.0), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        x_hat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(x_hat, weight, invstd, count)
        ctx.dims, ctx.shape = dims, shape
        out = x_hat if weight is None else x_hat * weight.view(shape)
        return out if bias is None else out + bias.view(shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x_hat, weight, invstd, count = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        grad_bias = grad_out.sum(dims)
        grad_weight = (grad_out * x_hat).sum(dims)
        # The weight and bias gradients stay local: the gradient engine averages them like any other.
        totals = collectives.allreduce(torch.cat([grad_bias, grad_weight]), "sum", check=False)
        channels = grad_bias.numel()
        mean_dy, mean_dy_xhat = totals[:channels] / count, totals[channels:] / count
        scale = invstd if weight is None else invstd * weight
        grad_x = (grad_out - mean_dy.view(shape) - x_hat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return (grad_x, None if weight is None else grad_weight, None if weight is None else grad_bias,
                None, None, None, None, None)
