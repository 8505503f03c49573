"""hvd.SyncBatchNorm: batch norm whose batch statistics cover every rank's batch (CPU too)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from gradientflow.horovod import basics
from gradientflow.horovod.basics import global_process_set
from gradientflow.horovod.ops.allreduce import _Allreduce
from gradientflow.horovod.ops.reduce_op import Sum

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the union of every rank's batch (Horovod's hvd.SyncBatchNorm).

    Each rank's count, per-channel sum and sum of squares travel in one differentiable
    allreduce, so ranks may hold batches of different sizes and the gradient is exact.

    Example::

        >>> bn = hvd.SyncBatchNorm(64)          # in place of torch.nn.BatchNorm2d(64)
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize with the statistics of every rank's batch (training) or running ones."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or basics.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch, factor, self.eps)
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), float(input.numel() // c), dtype=x.dtype, device=x.device)
        local = torch.cat([count, x.sum(dims), (x * x).sum(dims)])
        total = _Allreduce.apply(local, Sum, 1.0, 1.0, self.process_set, None)
        n = total[0]
        mean = total[1:1 + c] / n
        var = (total[1 + c:] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if float(n) > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        shape = [1, c] + [1] * (input.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)
