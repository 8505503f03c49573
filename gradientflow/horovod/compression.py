"""hvd.Compression: what a gradient looks like on the wire (Horovod's compressor contract).

`compress(tensor) -> (payload, ctx)` and `decompress(payload, ctx) -> tensor`, static methods:
only the payload travels. Compression.none and Compression.fp16 act per tensor, in any
collective. Compression.csc is GradientFlow's coarse-grained sparse communication: it picks
the same chunks on every rank and keeps the rest in a residual across steps, so it works on
gradients only, inside hvd.DistributedOptimizer (a per-tensor allreduce refuses it).
"""
from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "CSCCompressor", "Compression"]


class Compressor:
    """Interface: compress a tensor for the wire, decompress what arrives."""

    tensor_level = True  # usable in a single collective (False: a gradient protocol)

    @staticmethod
    def compress(tensor):
        """Return (payload, ctx): the payload travels, ctx stays here for decompress."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor `compress` was given, from the payload that arrived and ctx."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor as it is (the default)."""

    @staticmethod
    def compress(tensor):
        """Return the tensor unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        """Cast a floating-point tensor to float16 (others pass unchanged)."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Cast back to the dtype the tensor had before compress."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class CSCCompressor(Compressor):
    """GradientFlow's coarse-grained sparse communication, for hvd.DistributedOptimizer.

    `Compression.csc` uses gradientflow.compression's defaults; `Compression.csc.configure(
    density=0.05, chunk_size=512)` returns one with other CompressionConfig fields.
    """

    tensor_level = False
    options: dict = {}

    @classmethod
    def configure(cls, **options) -> type:
        """Return a CSC compressor class whose optimizer uses these CompressionConfig fields."""
        from gradientflow.compression import CompressionConfig

        CompressionConfig(method="csc", **options)  # validate now, at the call that is wrong
        return type(cls.__name__, (cls,), {"options": dict(options)})

    @classmethod
    def config(cls):
        """The gradientflow CompressionConfig this compressor stands for."""
        from gradientflow.compression import CompressionConfig

        return CompressionConfig(method="csc", **cls.options)

    @staticmethod
    def compress(tensor):
        """Refuse: CSC needs every rank's chunk norms and a residual, see the class docs."""
        raise ValueError("Compression.csc compresses gradients only: pass it to "
                         "hvd.DistributedOptimizer(compression=hvd.Compression.csc)")

    @staticmethod
    def decompress(tensor, ctx):
        """Refuse, as compress does."""
        return CSCCompressor.compress(tensor)


class Compression:
    """The compressors by name: Compression.none (default), .fp16, and GradientFlow's .csc."""

    none = NoneCompressor
    fp16 = FP16Compressor
    csc = CSCCompressor
