"""Run a training function on Spark, Horovod-on-Spark style, over the gradientflow backend.

    import gradientflow.horovod as hvd
    import gradientflow.spark

    def train(lr):
        hvd.init()
        ...
        return model.state_dict()

    results = gradientflow.spark.run(train, args=(0.1,), num_proc=2)   # one result per rank

Built on pyspark's own TorchDistributor (pyspark.ml.torch, pyspark >= 3.4): with
`local_mode=False` (the default, as horovod.spark.run) the ranks run in a barrier stage on
Spark's executors, each task starting torchrun; with `local_mode=True` they run on the driver.
Every rank joins one torch.distributed group with backend "gradientflow" before `fn` runs, so
`hvd.init()` inside it only adopts that group. Needs the `spark` extra: pip install pyspark.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

__all__ = ["run"]


def _rank_main(fn: Callable, args: Sequence, kwargs: dict, env: Optional[dict]) -> list:
    """One rank (run by torchrun under Spark): join the job, run fn, gather every result."""
    import os

    import torch.distributed as dist

    if env:
        # Horovod's `env`: the ranks' environment, set before the group reads its config.
        os.environ.update({str(k): str(v) for k, v in env.items()})
    import gradientflow  # noqa: F401  (registers the backend)

    dist.init_process_group(backend="gradientflow")
    try:
        result = fn(*args, **kwargs)
        import gradientflow.horovod as hvd

        hvd.shutdown()  # fn's hvd.init() adopted our group: forget it, keep the group
        results: list = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        return results
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable, args: Sequence = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, env: Optional[dict] = None,
        local_mode: bool = False, use_gpu: Optional[bool] = None,
        verbose: int = 1) -> list:
    """Run `fn(*args, **kwargs)` on `num_proc` ranks; return the list of results by rank.

    Args:
        fn: the training function; it may call hvd.init() and any gradientflow.horovod API.
        args, kwargs: its arguments (pickled to the ranks with cloudpickle).
        num_proc: number of ranks (default: the Spark context's default parallelism).
        env: environment variables for the ranks (e.g. GRADIENTFLOW_* settings).
        local_mode: False runs the ranks as Spark tasks on the executors (a barrier stage);
            True runs them on the driver (TorchDistributor's local mode).
        use_gpu: one GPU per rank (default: whether this driver sees CUDA).
        verbose: 0 keeps pyspark's TorchDistributor logs at WARNING.

    Example::

        >>> gradientflow.spark.run(train, num_proc=2)
    """
    try:
        from pyspark.ml.torch.distributor import TorchDistributor
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError("gradientflow.spark needs pyspark >= 3.4 (TorchDistributor): "
                          "pip install 'gradientflow[spark]'") from exc
    import logging

    import torch

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise RuntimeError("gradientflow.spark.run: no active SparkSession; start one first, "
                           "e.g. SparkSession.builder.master('local[2]').getOrCreate()")
    if num_proc is None:
        num_proc = spark.sparkContext.defaultParallelism
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"gradientflow.spark.run: num_proc={num_proc!r} must be an integer "
                         ">= 1")
    if use_gpu is None:
        use_gpu = torch.cuda.is_available()
    if not verbose:
        logging.getLogger("TorchDistributor").setLevel(logging.WARNING)
    distributor = TorchDistributor(num_processes=num_proc, local_mode=local_mode,
                                   use_gpu=use_gpu)
    return distributor.run(_rank_main, fn, tuple(args), dict(kwargs or {}), env)
