"""GradientFlow compression layer: compressors (one per file) + error-feedback memory; no communication.

A compressor turns one flat float32 gradient buffer and its layout into a StageGen (see
gradientflow.engine.stages); `make_compressor(config, world_size)` builds the one a
`CompressionConfig` names, through a name -> class registry.
"""
from .config import CompressionConfig, DGC_WARMUP, METHODS, WIRE_DTYPES
from .layout import Layout
from .memory import ResidualMemory
from .stats import CompressionStats
from .base import Compressor
from .registry import available, compressor_class, make_compressor, register_compressor
from . import none as _none, half as _half, csc as _csc  # noqa: F401  (they register themselves)
from .none import NoCompression
from .half import HalfCompressor
from .csc import CSCCompressor
from .checkpoint import RESIZE_POLICIES, gather_shards, shard_for_rank

if set(available()) != set(METHODS):  # the config validates against METHODS without importing us
    raise ImportError(f"gradientflow.compression: registry {available()} and config METHODS {METHODS} disagree")

__all__ = [
    "CompressionConfig", "DGC_WARMUP", "METHODS", "WIRE_DTYPES", "Layout", "ResidualMemory",
    "CompressionStats", "Compressor", "NoCompression", "HalfCompressor", "CSCCompressor",
    "available", "compressor_class", "make_compressor", "register_compressor",
    "RESIZE_POLICIES", "gather_shards", "shard_for_rank",
]
