"""Name -> compressor class registry (a compressor registers itself; no if/elif factory)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .base import Compressor
    from .config import CompressionConfig

__all__ = ["register_compressor", "compressor_class", "available", "make_compressor"]

_REGISTRY: dict[str, type["Compressor"]] = {}


def register_compressor(name: str) -> Callable[[type["Compressor"]], type["Compressor"]]:
    """Register a Compressor subclass under `name` (used as a class decorator)."""
    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"register_compressor: {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def available() -> list[str]:
    """Return the registered method names."""
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type["Compressor"]:
    """Return the class registered under `name`, or raise ValueError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"compression method {name!r} is not registered; known: {available()}") from None


def make_compressor(config: "CompressionConfig", world_size: int, **kwargs) -> "Compressor":
    """Build the compressor `config.method` names for a group of `world_size` ranks."""
    return compressor_class(config.method)(config, world_size, **kwargs)
