"""Horovod's PyTorch API on torch.distributed and the gradientflow backend.

A Horovod script ports by changing its import line::

    import gradientflow.horovod as hvd      # was: import horovod.torch as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Launch with `gradientflow-run -np 2 python train.py` (or torchrun, Spark, Ray). Every
difference from Horovod 0.28 is listed in docs/HOROVOD.md.
"""
from gradientflow.horovod.basics import (HorovodInternalError, ProcessSet, add_process_set,
                                         ccl_built, cross_rank, cross_size, cuda_built,
                                         ddl_built, global_process_set, gloo_built,
                                         gloo_enabled, init, is_homogeneous, is_initialized,
                                         local_rank, local_size, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, rank,
                                         remove_process_set, rocm_built, shutdown, size,
                                         start_timeline, stop_timeline)
from gradientflow.horovod.compression import Compression
from gradientflow.horovod.mpi_ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum,
                                          allgather, allgather_async, allreduce, allreduce_,
                                          allreduce_async, allreduce_async_, alltoall,
                                          alltoall_async, barrier, broadcast, broadcast_,
                                          broadcast_async, broadcast_async_, grouped_allgather,
                                          grouped_allgather_async, grouped_allreduce,
                                          grouped_allreduce_, grouped_allreduce_async,
                                          grouped_allreduce_async_, grouped_reducescatter,
                                          grouped_reducescatter_async, join, poll,
                                          reducescatter, reducescatter_async,
                                          sparse_allreduce_async, synchronize)
from gradientflow.horovod.functions import (allgather_object, broadcast_object,
                                            broadcast_optimizer_state, broadcast_parameters)
from gradientflow.horovod.optimizer import DistributedOptimizer
from gradientflow.horovod.sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "HorovodInternalError", "Compression",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "sparse_allreduce_async", "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join",
    "barrier", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "SyncBatchNorm", "start_timeline",
    "stop_timeline",
]
