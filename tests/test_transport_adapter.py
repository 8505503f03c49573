"""The transport adapter on a process group that returns no Work for a synchronous call.

NCCL does (asyncOp False): the adapter must hand that on as no Work, with a widened reduction
already narrowed back, not wrap it in a Work that waits on nothing (the GPU check found a
synchronous reduce_scatter failing so on an NCCL group).
"""
from __future__ import annotations

import torch
from torch._C._distributed_c10d import ReduceOp, ReduceScatterOptions

from gradientflow.backend.adapter import Transport


class SynchronousGroup:
    """One rank's group whose reductions complete in the call and return None."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def reduce_scatter(self, outputs, inputs, opts=None):
        self.dtypes.append(outputs[0].dtype)
        outputs[0].copy_(inputs[0][0])  # the sum over one rank
        return None

    def _reduce_scatter_base(self, output, input, opts=None):
        output.copy_(input)
        return None


def test_a_synchronous_reduction_without_work_stays_without_work():
    group = SynchronousGroup()
    tp = Transport(group)
    x = torch.arange(7, dtype=torch.float32)
    out = torch.empty_like(x)
    assert tp.reduce_scatter([out], [[x]], ReduceScatterOptions()) is None
    assert torch.equal(out, x)
    out2 = torch.empty_like(x)
    assert tp._reduce_scatter_base(out2, x, ReduceScatterOptions()) is None
    assert torch.equal(out2, x)
    assert tp.group is group


def test_a_widened_reduction_without_work_is_narrowed_at_once():
    group = SynchronousGroup()
    tp = Transport(group)
    x = torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16)
    out = torch.zeros_like(x)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    assert tp.reduce_scatter([out], [[x]], opts) is None
    assert group.dtypes == [torch.int32]  # reduced on a wider copy
    assert torch.equal(out, x)  # and written back before the call returned
