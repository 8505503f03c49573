"""Compression configuration: the settings every method shares, and the options of the method
chosen (registered with it: registry.py), validated at construction.

    CompressionConfig(method="csc", density=0.01)       # CSC's options beside the common ones
    CompressionConfig(method="powersgd", rank=4)
    CompressionConfig(method="fp16", density=0.01)      # ValueError: 'fp16' has no option 'density'

A method's options are read as attributes of the config (`config.density`), as before the split.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..fingerprint import text_fingerprint
from . import registry
from .registry import Options

__all__ = ["CompressionConfig", "WIRE_DTYPES", "COMMON", "wire_dtype_name", "queue_name"]

# Names the wire dtype is given by in configs, flags and the environment.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
# The settings every method has; the rest are the method's own options.
COMMON = ("method", "wire_dtype", "error_feedback")


def wire_dtype_name(value: Any, what: str) -> str:
    """The name ("fp32", "fp16", "bf16") of a wire dtype given by name or torch dtype; ValueError
    naming `what` otherwise."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES:
            raise ValueError(f"CompressionConfig: {what}={value} is not a wire dtype; use one of "
                             f"{sorted(WIRE_DTYPES)}")
        return _DTYPE_NAMES[value]
    if value not in WIRE_DTYPES:
        raise ValueError(f"CompressionConfig: {what}={value!r} is not a wire dtype; use one of "
                         f"{sorted(WIRE_DTYPES)}")
    return value


@dataclass(frozen=True, init=False, repr=False)
class CompressionConfig:
    """Configure how gradient buffers are compressed for the wire (immutable, validated).

    Args:
        method: a registered method ("csc" by default, "fp16", "powersgd", "none", ...).
        wire_dtype: the dtype on the wire, "fp32", "fp16" or "bf16" (or a torch dtype); None:
            the method's own default.
        error_feedback: keep what was not sent (and the wire's rounding error) and add it back
            at the next step.
        options: the method's Options, whole (as `dataclasses.replace` passes them); the given
            keywords are applied on top.
        **given: the method's own options, e.g. ``density=0.01`` for CSC, ``rank=4`` for
            PowerSGD. One the method does not have raises ValueError naming the method.

    Example::

        >>> cfg = CompressionConfig(method="csc", density=0.01)
        >>> [cfg.density_at(epoch=0, step=s) for s in (0, 5, 10, 15, 20)]   # warm-up in steps
        [1.0, 0.25, 0.0625, 0.015625, 0.01]
    """

    # "csc" by default: the point of the project; "fp16"/"bf16" only halve the bytes, "none"
    # is the dense FP32 average (the reference every other method is tested against).
    method: str
    # FP16 halves the payload; values are pre-scaled by 1/world_size before the sum so the sum
    # cannot overflow where the inputs do not. bf16 trades mantissa for FP32's range.
    wire_dtype: str
    # Without it sparsification biases the update and accuracy drops (DGC, GRACE's ablations).
    error_feedback: bool
    options: Options

    def __init__(self, method: str = "csc", *, wire_dtype: Any = None,
                 error_feedback: bool = True, options: Options | None = None,
                 **given: Any) -> None:
        try:
            entry = registry.lookup(method)
        except ValueError:
            raise ValueError(f"CompressionConfig: method={method!r} is unknown; use one of "
                             f"{registry.available()} (or register_compressor a new one)") from None
        wire = entry.wire_dtype if wire_dtype is None else wire_dtype
        object.__setattr__(self, "method", entry.name)
        object.__setattr__(self, "wire_dtype", wire_dtype_name(wire, "wire_dtype"))
        object.__setattr__(self, "error_feedback", bool(error_feedback))
        object.__setattr__(self, "options", _build_options(entry, options, given))
        self.options.check(self)

    # --- the method's options, read as attributes ----------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not the config's own; "options" missing means an
        # instance still being built or unpickled.
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        try:
            options = object.__getattribute__(self, "options")
        except AttributeError:
            raise AttributeError(name) from None
        try:
            return getattr(options, name)
        except AttributeError:
            raise AttributeError(_no_option(self.method, name, type(options))) from None

    def as_dict(self) -> dict[str, Any]:
        """The common settings and the method's options as one flat dict (checkpoints, logs)."""
        return {"method": self.method, "wire_dtype": self.wire_dtype,
                "error_feedback": self.error_feedback,
                **{f: getattr(self.options, f) for f in self.options.names()}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"CompressionConfig({args})"

    # --- derived values --------------------------------------------------------------------------
    @property
    def torch_wire_dtype(self) -> torch.dtype:
        """The torch dtype of the wire payload."""
        return WIRE_DTYPES[self.wire_dtype]


def _no_option(method: str, option: str, options: type[Options]) -> str:
    """The sentence for an option `method` does not have."""
    others = [m for m in registry.methods_with_option(option) if m != method]
    where = f" ({option!r} is an option of {', '.join(map(repr, others))})" if others else ""
    own = list(options.names())
    return (f"CompressionConfig: method {method!r} has no option {option!r}{where}; its options "
            f"are {own or 'none'}, beside the common {list(COMMON)}")


def _build_options(entry: registry.Method, options: Options | None,
                   given: dict[str, Any]) -> Options:
    """The method's options: `options` (or the defaults) with `given` applied, validated."""
    cls = entry.options
    for name in given:
        if name not in cls.names():
            raise ValueError(_no_option(entry.name, name, cls))
    if options is None:
        return cls(**given)
    if type(options) is not cls:
        raise ValueError(f"CompressionConfig: options={type(options).__name__}(...) belong to "
                         f"another method than {entry.name!r}; pass {entry.name!r}'s options "
                         "as keywords")
    return dataclasses.replace(options, **given) if given else options


def queue_name(config: CompressionConfig, what: str = "bucket") -> str:
    """The name the engine queues a compressed op of `config` under (`what`: its kind).

    The agreement round fingerprints it, so ranks whose compression settings differ (their
    stage tensors would not pair) get a mismatch error naming both, not a transport hang.
    """
    return f"{config.method} {what} (config {text_fingerprint(repr(config))})"
