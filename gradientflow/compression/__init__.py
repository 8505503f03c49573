"""GradientFlow compression layer: compressors (one per file) + error-feedback memory; no
communication.

A compressor turns one flat float32 gradient buffer and its layout into a StageGen (see
gradientflow.engine.stages); `make_compressor(config, world_size)` builds the one a
`CompressionConfig` names, through the one table of methods (registry.py).
"""
from .config import (DEFAULT_MOMENTUM, DENSE_FIRST_WARMUP, DGC_WARMUP, WIRE_DTYPES,
                     CompressionConfig, queue_name)
from .layout import Layout
from .memory import ResidualMemory
from .stats import CompressionStats
from .base import Compressor, QueuedBuffer, reduce_queued
from .registry import (Method, attach_hook, available, compressor_class, lookup, make_compressor,
                       register_compressor)
from . import none as _none, half as _half, csc as _csc  # noqa: F401  (they register themselves)
from .none import NoCompression
from .half import HalfCompressor
from .csc import CSCCompressor
from .checkpoint import RESIZE_POLICIES, gather_shards, shard_for_rank
from .selection import QUOTAS, select_pool

__all__ = [
    "CompressionConfig",
    "DEFAULT_MOMENTUM",
    "DENSE_FIRST_WARMUP",
    "DGC_WARMUP",
    "WIRE_DTYPES",
    "queue_name",
    "Layout",
    "ResidualMemory",
    "CompressionStats",
    "Compressor",
    "QueuedBuffer",
    "reduce_queued",
    "NoCompression",
    "HalfCompressor",
    "CSCCompressor",
    "Method",
    "attach_hook",
    "available",
    "compressor_class",
    "lookup",
    "make_compressor",
    "register_compressor",
    "RESIZE_POLICIES",
    "gather_shards",
    "shard_for_rank",
    "QUOTAS",
    "select_pool",
]
