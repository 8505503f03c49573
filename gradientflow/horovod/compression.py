"""hvd.Compression: what a gradient looks like on the wire (Horovod's compressor contract).

`compress(tensor) -> (payload, ctx)` and `decompress(payload, ctx) -> tensor`, static methods:
only the payload travels. Compression.none and Compression.fp16 act per tensor, in any
collective. Every other registered gradientflow method is `Compression.<its name>`
(Compression.csc, Compression.powersgd, ...): such a method keeps state across steps (a
residual, its chosen chunks or factors) and agrees on it with the other ranks, so it works on
gradients only, inside hvd.DistributedOptimizer (a per-tensor allreduce refuses it).
"""
from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "MethodCompressor",
           "CSCCompressor", "Compression"]


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

    @classmethod
    def config(cls):
        """What hvd.DistributedOptimizer passes to gradientflow.optim: None, the dense average."""
        return None


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

    @classmethod
    def config(cls):
        """The gradientflow CompressionConfig hvd.DistributedOptimizer uses: method "fp16"."""
        from gradientflow.compression import CompressionConfig

        return CompressionConfig(method="fp16")


class MethodCompressor(Compressor):
    """A gradientflow compression method for hvd.DistributedOptimizer (`Compression.<method>`).

    `Compression.csc` uses the method's defaults; `Compression.csc.configure(density=0.05)`
    returns one with other CompressionConfig options (`Compression.powersgd.configure(rank=4)`).
    """

    tensor_level = False
    method: ClassVar[str] = "csc"
    options: ClassVar[dict] = {}

    @classmethod
    def configure(cls, **options) -> type:
        """Return a compressor class of this method whose optimizer uses these options."""
        from gradientflow.compression import CompressionConfig

        CompressionConfig(method=cls.method, **options)  # validate now, at the call that is wrong
        return type(cls.__name__, (cls,), {"options": dict(options)})

    @classmethod
    def config(cls):
        """The gradientflow CompressionConfig this compressor stands for."""
        from gradientflow.compression import CompressionConfig

        return CompressionConfig(method=cls.method, **cls.options)

    @classmethod
    def compress(cls, tensor):
        """Refuse: the method needs every rank's agreement and state kept across steps."""
        raise ValueError(f"Compression.{cls.method} compresses gradients only: pass it to "
                         f"hvd.DistributedOptimizer(compression=hvd.Compression.{cls.method})")

    @classmethod
    def decompress(cls, tensor, ctx):
        """Refuse, as compress does."""
        return cls.compress(tensor)


class CSCCompressor(MethodCompressor):
    """GradientFlow's coarse-grained sparse communication, for hvd.DistributedOptimizer."""

    method = "csc"


_BY_METHOD: dict[str, type] = {"csc": CSCCompressor}


class _ByName(type):
    """Compression.<name> for every registered method beyond the built-in attributes."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("_"):
            raise AttributeError(name)
        from gradientflow.compression import lookup

        try:
            method = lookup(name)
        except ValueError:
            raise AttributeError(f"hvd.Compression has no {name!r}: use none, fp16 or a "
                                 "registered gradientflow compression method") from None
        found = _BY_METHOD.get(method.name)
        if found is None:
            title = f"{method.name.title().replace('-', '').replace('_', '')}Compressor"
            found = _BY_METHOD[method.name] = type(title, (MethodCompressor,),
                                                   {"method": method.name})
        return found


class Compression(metaclass=_ByName):
    """The compressors by name: Compression.none (default), .fp16, and every gradientflow
    method (.csc, .powersgd, ...)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    csc = CSCCompressor
