"""Momentum applied once: a compressor with momentum correction takes it over from the optimizer.

Under DGC's momentum correction the compressor accumulates the velocity, so the optimizer must
run without momentum; with both, momentum is applied twice and training diverges quietly. Two
ways keep that from happening:

- `take_momentum(config, optimizer)`: the optimizer is known (the DistributedOptimizer always,
  a hook when registered with `optimizer=`): its momentum moves into the config the compressor
  is built from, and its parameter groups are left with momentum 0. An optimizer without
  momentum moves none (the config's own `momentum`, if set, is then applied by the compressor).
- `guard_momentum(...)`: the optimizer is not known (a hook state built without one): the first
  step of any optimizer that would apply momentum to one of the compressed parameters raises,
  saying what to change.

Works on `param_groups` dictionaries only (any optimizer with SGD's "momentum" setting).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .config import CompressionConfig
from .registry import lookup

__all__ = ["take_momentum", "guard_momentum"]

# Set on an optimizer whose momentum was moved, so a second binding finds the value again.
_MOVED = "_gradientflow_moved_momentum"


def _applies(config: CompressionConfig) -> bool:
    return lookup(config.method).compressor.applies_momentum(config)


def take_momentum(config: CompressionConfig, optimizer, where: str) -> CompressionConfig:
    """Move `optimizer`'s momentum into `config` (returned) and set the optimizer's to 0.

    Returns `config` unchanged when its method applies no momentum. Raises ValueError, naming
    what to change, when the optimizer has no SGD-style momentum, when its groups disagree, or
    when `config.momentum` was set to another value than the optimizer's.
    """
    if not _applies(config):
        return config
    groups = optimizer.param_groups
    name = type(optimizer).__name__
    if not all("momentum" in g for g in groups):
        raise ValueError(
            f"{where}: momentum correction (on by default) moves SGD-style momentum from the "
            f"optimizer into the compressor, but {name} has no 'momentum' setting; pass "
            "CompressionConfig(..., momentum_correction=False) to keep the optimizer as it is")
    moved = getattr(optimizer, _MOVED, None)
    found = {(float(g["momentum"]), bool(g.get("nesterov", False)), float(g.get("dampening", 0.0)))
             for g in groups}
    if len(found) > 1:
        raise ValueError(
            f"{where}: the parameter groups of {name} have different momentum settings "
            f"{sorted(found)}; momentum correction applies one momentum to every parameter: use "
            "one setting, or pass momentum_correction=False")
    m_opt, nesterov, dampening = found.pop() if found else (0.0, False, 0.0)
    if m_opt > 0 and dampening != 0:
        raise ValueError(f"{where}: {name} has dampening={dampening}; momentum correction "
                         "implements undampened momentum: use dampening=0, or pass "
                         "momentum_correction=False")
    if m_opt == 0 and moved is not None:
        m_opt, nesterov = moved  # bound before: the value that was moved then
    if m_opt > 0:
        if config.momentum is not None and float(config.momentum) != m_opt:
            raise ValueError(
                f"{where}: CompressionConfig(momentum={config.momentum}) but {name} has "
                f"momentum={m_opt}; the optimizer's momentum moves into the compressor: leave "
                "the config's momentum unset (None), or give both the same value")
        config = dataclasses.replace(config, momentum=m_opt, nesterov=nesterov)
    elif config.momentum:
        config = dataclasses.replace(config, momentum=float(config.momentum))
    else:
        # Nothing to move: momentum 0 is plain error feedback, without the velocity's memory.
        config = dataclasses.replace(config, momentum=0.0, momentum_correction=False)
    for g in groups:
        g["momentum"] = 0.0
        if "nesterov" in g:
            g["nesterov"] = False
    setattr(optimizer, _MOVED, (config.momentum_value if config.momentum_correction else 0.0,
                                config.nesterov))
    return config


def guard_momentum(owner, params: Callable[[object], set[int]], config: CompressionConfig,
                   where: str):
    """Raise at any optimizer step that would apply momentum to a parameter `owner` compresses.

    `params(owner)` returns the ids of the compressed parameters (read at each step: a hook
    learns them from its buckets); it must not hold `owner` itself, which the guard only
    references weakly and outlives by nothing. Returns the hook's handle, or
    None when `config`'s method applies no momentum.
    """
    if not _applies(config):
        return None
    ref = weakref.ref(owner)

    def check(optimizer, args, kwargs):
        me = ref()
        if me is None:
            return None
        ids = params(me)
        for g in optimizer.param_groups:
            if float(g.get("momentum", 0.0) or 0.0) > 0 and any(id(p) in ids for p in g["params"]):
                raise RuntimeError(
                    f"{where}: momentum correction (on by default) applies momentum "
                    f"{config.momentum_value} in the compressor, and {type(optimizer).__name__} "
                    f"would apply momentum={g['momentum']} again. Pass the optimizer when "
                    "registering (gradientflow.hooks.register(ddp, config, optimizer=opt) or "
                    "the state's optimizer= argument): its momentum then moves into the "
                    "compressor. Or set its momentum to 0, or pass momentum_correction=False.")
        return None

    handle = register_optimizer_step_pre_hook(check)
    weakref.finalize(owner, handle.remove)
    return handle
