"""``hvd.SyncBatchNorm``: batch norm over the global batch, phalanx's, which runs on Gloo as well as NCCL."""

from __future__ import annotations

from phalanx.parallel.batchnorm import SyncBatchNorm as _PhalanxSyncBatchNorm


class SyncBatchNorm(_PhalanxSyncBatchNorm):
    """``hvd.SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)``.

    Normalises with the mean and variance of every rank's samples (one small allreduce in forward,
    one in backward); in evaluation mode it uses the running statistics, like ``nn.BatchNorm*d``.
    """
