"""GradientFlow compression layer: compressors (one per file) + error-feedback memory; no
communication.

A compressor turns one flat float32 gradient buffer and its layout into a StageGen (see
gradientflow.engine.stages); `make_compressor(config, world_size)` builds the one a
`CompressionConfig` names, through the one table of methods (registry.py). A method is one
file (its Compressor and its Options, registered together) plus its module's name in
registry.BUILTIN, which is imported here.
"""
import importlib as _importlib

from .config import WIRE_DTYPES, CompressionConfig, queue_name
from .layout import Layout
from .memory import ResidualMemory
from .stats import CompressionStats
from .base import Compressor, QueuedBuffer, reduce_queued
from .registry import (BUILTIN as _BUILTIN, Method, Options, attach_hook, available,
                       compressor_class, lookup, make_compressor, register_compressor)

for _module in _BUILTIN:
    _importlib.import_module(f"{__name__}.{_module}")  # each registers its method

from .none import NoCompression  # noqa: E402
from .half import HalfCompressor  # noqa: E402
from .csc import CSCCompressor  # noqa: E402
from .csc_options import DEFAULT_MOMENTUM, DENSE_FIRST_WARMUP, DGC_WARMUP, CSCOptions  # noqa: E402
from .checkpoint import RESIZE_POLICIES, gather_shards, shard_for_rank  # noqa: E402
from .selection import QUOTAS, select_pool  # noqa: E402

__all__ = [
    "CompressionConfig",
    "Options",
    "CSCOptions",
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
