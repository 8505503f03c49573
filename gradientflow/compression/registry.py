"""The one table of compression methods: per method its compressor, its hook state and its names.

A method is usable everywhere once it is registered here: `CompressionConfig(method=...)`
validates against this table, the DDP hooks build the state its entry names (the generic
`CompressionState` when none is attached), and the DistributedOptimizer accepts its names.
Leaf module: it imports nothing of gradientflow at run time, so the config can consult it
without importing any compressor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .base import Compressor
    from .config import CompressionConfig

__all__ = ["Method", "register_compressor", "attach_hook", "lookup", "compressor_class",
           "available", "make_compressor"]


@dataclass(frozen=True)
class Method:
    """One compression method: what computes it, what a DDP hook keeps for it, what it is called."""

    name: str
    compressor: type["Compressor"]
    # Further names accepted wherever a method is named (configs, optimizer arguments, flags).
    aliases: tuple[str, ...] = ()
    # The DDP hook state class and hook function (None: the generic CompressionState's).
    state: type | None = None
    hook: Callable[..., Any] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this method answers to, its own first."""
        return (self.name,) + self.aliases

    @property
    def dense(self) -> bool:
        """Whether the method is the plain dense average (the optimizer needs no compressor)."""
        return bool(getattr(self.compressor, "dense_average", False))


_METHODS: dict[str, Method] = {}
_BY_NAME: dict[str, str] = {}  # every name and alias -> the method's own name


def register_compressor(name: str, *, aliases: tuple[str, ...] = ()
                        ) -> Callable[[type["Compressor"]], type["Compressor"]]:
    """Register a Compressor subclass as method `name` (a class decorator).

    Example::

        >>> @register_compressor("toy")
        ... class Toy(NoCompression): ...
        >>> CompressionConfig(method="toy")          # accepted from now on
    """
    def deco(cls):
        known = _BY_NAME.get(name)
        if known is not None and _METHODS[known].compressor is not cls:
            raise ValueError(f"register_compressor: {name!r} is already registered to "
                             f"{_METHODS[known].compressor.__name__}")
        for alias in aliases:
            if _BY_NAME.get(alias, name) != name:
                raise ValueError(f"register_compressor: alias {alias!r} already names method "
                                 f"{_BY_NAME[alias]!r}")
        cls.name = name
        _METHODS[name] = Method(name, cls, tuple(aliases))
        for n in _METHODS[name].names:
            _BY_NAME[n] = name
        return cls
    return deco


def attach_hook(name: str, state: type, hook: Callable[..., Any]) -> None:
    """Give method `name` its own DDP hook state class and hook (the hooks layer does this)."""
    _METHODS[lookup(name).name] = dataclasses.replace(lookup(name), state=state, hook=hook)


def lookup(name: str) -> Method:
    """Return the method `name` (or an alias) names, or raise ValueError listing the known ones."""
    own = _BY_NAME.get(name) if isinstance(name, str) else None
    if own is None:
        raise ValueError(f"compression method {name!r} is not registered; known: {available()}")
    return _METHODS[own]


def available() -> list[str]:
    """Return the registered methods' own names, sorted."""
    return sorted(_METHODS)


def compressor_class(name: str) -> type["Compressor"]:
    """Return the compressor class of method `name`, or raise ValueError listing the known ones."""
    return lookup(name).compressor


def make_compressor(config: "CompressionConfig", world_size: int, **kwargs) -> "Compressor":
    """Build the compressor `config.method` names for a group of `world_size` ranks."""
    return compressor_class(config.method)(config, world_size, **kwargs)
