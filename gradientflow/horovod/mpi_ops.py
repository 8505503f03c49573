"""Horovod's tensor collectives (hvd.allreduce and friends) on torch.distributed.

Each collective has Horovod's three forms where Horovod has them: `op(...)` returns a new tensor
and is differentiable, `op_async(...)` returns an integer handle for poll()/synchronize(), and
`op_(...)` / `op_async_(...)` write into the input (allreduce, grouped_allreduce, broadcast:
the other collectives change the shape, so Horovod has no in-place form of them either).

Collectives run on the process set's torch.distributed group; on a gradientflow group a small
async allreduce is fused with its neighbours (lazy allreduce) until a synchronize() needs it.
Unlike Horovod, which matches collectives across ranks by name, they match by call order, as in
torch.distributed: every rank must issue the same collectives in the same order. A gradientflow
group checks every call on every rank before its data moves, so ranks that differ in the
dtype, a dimension, the root or the op get an error (RuntimeError) and no wrong data. Names
are used as Horovod uses them on one rank: a name still in use by an unfinished operation is
refused (ValueError), and errors name the tensor.

The collectives live in gradientflow/horovod/ops/, one module per family; this module is the
name Horovod's users and the rest of gradientflow.horovod import them by.
"""
from __future__ import annotations

from gradientflow.horovod.ops.allreduce import (allreduce, allreduce_,
                                                allreduce_async, allreduce_async_,
                                                grouped_allreduce, grouped_allreduce_,
                                                grouped_allreduce_async,
                                                grouped_allreduce_async_)
from gradientflow.horovod.ops.control import barrier, join
from gradientflow.horovod.ops.gather import (allgather, allgather_async, alltoall,
                                             alltoall_async, broadcast, broadcast_,
                                             broadcast_async, broadcast_async_, grouped_allgather,
                                             grouped_allgather_async, sparse_allreduce_async)
from gradientflow.horovod.ops.handles import poll, synchronize
from gradientflow.horovod.ops.reduce_op import (Adasum, Average, Max, Min, Product,
                                                ReduceOp, Sum)
from gradientflow.horovod.ops.reducescatter import (grouped_reducescatter,
                                                    grouped_reducescatter_async, reducescatter,
                                                    reducescatter_async)

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
           "broadcast_async_", "alltoall", "alltoall_async", "sparse_allreduce_async",
           "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "poll", "synchronize", "join", "barrier"]

