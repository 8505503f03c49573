"""The one table of compression methods: per method its compressor, its options, its hook state
and its names.

A method is usable everywhere once it is registered here: `CompressionConfig(method=...)`
validates its options against this table, the DDP hooks build the state its entry names (the
generic `CompressionState` when none is attached), the DistributedOptimizer and Horovod's
`hvd.Compression.<name>` accept its names.

Adding a method is one file (a `Compressor` subclass decorated with `register_compressor`, with
its `Options` beside it) plus its module's name in `BUILTIN` below.

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

__all__ = ["BUILTIN", "Method", "Options", "register_compressor", "attach_hook", "lookup",
           "compressor_class", "available", "make_compressor", "methods_with_option"]

# The modules of the built-in methods, imported by the package (each registers itself).
BUILTIN = ("none", "half", "csc", "powersgd")


@dataclass(frozen=True)
class Options:
    """A method's own options (a frozen dataclass per method; this one has none).

    A subclass declares its fields with their defaults and the reason for each, refuses a bad
    value in `__post_init__` (ValueError naming the range), and a bad combination with the
    common settings (method, wire dtype, error feedback) in `check`.
    """

    def check(self, config: "CompressionConfig") -> None:
        """Refuse these options beside `config`'s common settings (nothing to refuse here)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class Method:
    """One compression method: what computes it, its options, what a DDP hook keeps for it, what
    it is called."""

    name: str
    compressor: type["Compressor"]
    options: type[Options] = Options
    # The wire dtype a config of this method gets when none is given.
    wire_dtype: str = "fp16"
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


def register_compressor(name: str, *, options: type[Options] = Options, wire_dtype: str = "fp16",
                        aliases: tuple[str, ...] = ()
                        ) -> Callable[[type["Compressor"]], type["Compressor"]]:
    """Register a Compressor subclass as method `name`, with its options (a class decorator).

    Args:
        name: the method's name in configs, flags and `hvd.Compression.<name>`.
        options: its Options subclass (a frozen dataclass; default: no options of its own).
        wire_dtype: the wire dtype of a config that names none ("fp32", "fp16" or "bf16").
        aliases: further names for it.

    Example::

        >>> @register_compressor("toy")
        ... class Toy(NoCompression): ...
        >>> CompressionConfig(method="toy")          # accepted from now on
    """
    if not (isinstance(options, type) and issubclass(options, Options)
            and dataclasses.is_dataclass(options)):
        raise TypeError(f"register_compressor({name!r}): options must be a dataclass subclass of "
                        f"gradientflow.compression.Options, got {options!r}")

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
        _METHODS[name] = Method(name, cls, options, wire_dtype, tuple(aliases))
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


def methods_with_option(option: str) -> list[str]:
    """Return the registered methods that have option `option`, sorted (for error messages)."""
    return sorted(m.name for m in _METHODS.values() if option in m.options.names())


def compressor_class(name: str) -> type["Compressor"]:
    """Return the compressor class of method `name`, or raise ValueError listing the known ones."""
    return lookup(name).compressor


def make_compressor(config: "CompressionConfig", world_size: int, **kwargs) -> "Compressor":
    """Build the compressor `config.method` names for a group of `world_size` ranks."""
    return compressor_class(config.method)(config, world_size, **kwargs)
