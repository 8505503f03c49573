"""Horovod's tensor collectives, one module per family (gradientflow.horovod.mpi_ops re-exports
them under Horovod's names):

    reduce_op      hvd.Average, hvd.Sum, ... and the torch op each travels as
    handles        async handles (poll, synchronize), the name table, shared checks
    allreduce      allreduce and grouped_allreduce
    gather         allgather, broadcast, alltoall, sparse_allreduce_async
    reducescatter  reducescatter and grouped_reducescatter
    control        join and barrier
"""
