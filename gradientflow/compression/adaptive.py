"""Refuse CSC beside an Adam-family optimizer unless the user opts in, naming what works.

Why: Adam normalises each coordinate's step by its own second moment (an average of squared
gradients over about 1 / (1 - beta2) steps). Under CSC at 1% a chunk arrives about once in
100 steps, carrying the gradients summed while it waited; Adam then takes one step of at most a
few learning rates for it, where the dense run would have taken one per step, and AdamW's
decoupled weight decay still shrinks it at every step. Error feedback keeps the gradient's
mass, but Adam's step is not linear in it, so the mass does not become movement. Measured on the
byte-level GPT (experiments/lm/README.md, "CSC with AdamW: what was tried").
"""
from __future__ import annotations

import torch

__all__ = ["ADAPTIVE", "is_adam_family", "check_adaptive"]

# The optimizers refused: Adam and AdamW (and their subclasses), the family that was measured.
ADAPTIVE: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)

# What the refusal says works; the numbers come from experiments/lm/README.md.
_WORKS = (
    "what works with Adam-family optimizers: the dense FP16 wire, CompressionConfig(method="
    "'fp16') (2x fewer bytes; CSC at density=1.0, which sends everything on that wire, ended "
    "0.05% above DDP's validation loss after 300 steps on a byte-level GPT with AdamW, where CSC "
    "at 1% was 37% above, at 10% 12%, and with only the MLP matrices sparse 3.6%; over the full "
    "2000 steps CSC at 1% ended 63% above: experiments/lm/README.md), "
    "or CSC with torch.optim.SGD with momentum")


def is_adam_family(optimizer) -> bool:
    """Whether `optimizer` (or the local optimizer a ZeroRedundancyOptimizer wraps) is Adam,
    AdamW or a subclass of either."""
    inner = getattr(optimizer, "optim", None)
    return isinstance(optimizer, ADAPTIVE) or isinstance(inner, ADAPTIVE)


def check_adaptive(config, optimizer, where: str) -> None:
    """Raise ValueError, naming what works, when `config`'s method refuses Adam-family optimizers
    (it has the option `allow_adaptive_optimizer`, left False) and `optimizer` is one.

    Nothing is decided without an optimizer (`optimizer=None`, as a DDP hook is often
    registered): the check needs the optimizer that will step the parameters.
    """
    if optimizer is None or getattr(config, "allow_adaptive_optimizer", True):
        return
    if not is_adam_family(optimizer):
        return
    name = type(optimizer).__name__
    raise ValueError(
        f"{where}: method {config.method!r} at density {config.density:g} with {name} trains "
        f"far behind dense: {name} scales each coordinate's step by its own second moment, so "
        "a chunk that arrives once in many steps with its residual moves about one step's "
        f"worth, not one per step; {_WORKS}. To run it anyway, pass "
        "CompressionConfig(method='csc', ..., allow_adaptive_optimizer=True)")
