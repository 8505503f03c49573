"""A power-of-two scale per FP16 message, agreed by every rank, so small gradients do not flush.

FP16's normal range ends at 2^-14 (subnormals at 2^-24). The first layers of a deep ReLU
network at default init have gradients far below that: torch's fp16_compress_hook, which sends
grad / n in FP16, loses a large part of them to zero (benchmarks/bench_wire_scale.py measures
it). Here each rank contributes a bound b_r >= max |x_r| of its message; the bound SUM
S = sum_r b_r is the same on every rank and bounds every rank's values and their sum, so every
rank picks the same exponent e with S * 2^e / n <= HEADROOM * max(FP16):

    wire_r = fp16(x_r * 2^e / n);   average = fp32(sum_r wire_r) * 2^-e

Multiplying by a power of two is exact in FP32 (away from its own limits), so the only rounding
is FP16's, now relative to the message's largest value: a message whose values span less than
FP16's dynamic range (2^40 with subnormals) arrives without flushing, down to FP32's normal
range (2^-126). The exponent stays in [MIN_EXPONENT, MAX_EXPONENT] so that 2^e / n, 2^-e and
n / 2^e are normal FP32 numbers. BF16 has FP32's range: its messages keep e = 0 and no bound
is sent.

How the bound travels: the FP16 compressor sends it as one more FP32 element before its
message (`agree`); CSC sends it inside its norms message, which it allreduces anyway.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generator

import torch

__all__ = ["WireScale", "unscaled", "needs_scale", "exponent_for", "scale_for", "local_bound",
           "norms_bound", "agree", "split_bound", "reference_average"]

# The largest wire value as a fraction of the dtype's maximum: the sum of n values each at most
# S / n in magnitude is at most S; the half left over absorbs FP16's rounding up of each.
HEADROOM = 0.5
# 2^e / n, 2^-e and n / 2^e are normal FP32 numbers for e in [MIN_EXPONENT, MAX_EXPONENT] and
# any n < 2^26; 2^126 lifts a message whose largest value is FP32's smallest normal to ~1.
MAX_EXPONENT = 126
MIN_EXPONENT = -100


@dataclass(frozen=True)
class WireScale:
    """The scales of one message: pre-multiply, unscale after the sum, rounding-error factor."""

    exponent: int
    world_size: int

    @property
    def pre(self) -> float:
        """Multiply a rank's values by this before the cast: 2^e / n."""
        return math.ldexp(1.0, self.exponent) / self.world_size

    @property
    def post(self) -> float:
        """Multiply the reduced sum by this after the upcast: 2^-e."""
        return math.ldexp(1.0, -self.exponent)

    @property
    def err(self) -> float:
        """What was sent, in gradient units, is upcast(wire) * err: n / 2^e."""
        return self.world_size * math.ldexp(1.0, -self.exponent)


def unscaled(world_size: int) -> WireScale:
    """The scale of a message sent without a power of two (grad / n, as before)."""
    return WireScale(0, world_size)


def needs_scale(wire_dtype: torch.dtype) -> bool:
    """Whether messages in `wire_dtype` are scaled (FP16 only: BF16 has FP32's range)."""
    return wire_dtype == torch.float16


def exponent_for(bound: float, world_size: int, wire_dtype: torch.dtype) -> int:
    """The exponent e with bound * 2^e / n <= HEADROOM * max(wire_dtype), as large as allowed.

    `bound` must be the same on every rank (the sum of the ranks' local bounds); 0 or a
    non-finite bound gives e = 0 (nothing to scale, or a step the loss scaler skips anyway).
    """
    if not needs_scale(wire_dtype) or not math.isfinite(bound) or bound <= 0.0:
        return 0
    limit = HEADROOM * torch.finfo(wire_dtype).max * world_size
    e = math.floor(math.log2(limit / bound))
    # log2 rounds: step down until the bound really fits.
    while e > MIN_EXPONENT and bound * math.ldexp(1.0, e) > limit:
        e -= 1
    return max(MIN_EXPONENT, min(MAX_EXPONENT, e))


def scale_for(bound: float, world_size: int, wire_dtype: torch.dtype) -> WireScale:
    """The WireScale of a message whose agreed bound is `bound`."""
    return WireScale(exponent_for(bound, world_size, wire_dtype), world_size)


def local_bound(*tensors: torch.Tensor | None) -> torch.Tensor:
    """A float32 scalar >= max |sum of the tensors| elementwise (sum of each one's max |.|)."""
    total = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        m = t.detach().abs().max().to(torch.float32)
        total = m if total is None else total + m
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def norms_bound(norms: torch.Tensor, norm: str, dense: torch.Tensor | None) -> torch.Tensor:
    """A float32 (1,) bound >= max |v| from CSC's chunk norms ("l1", or "l2" squared) and the
    values sent dense (which the masked norms of mixed chunks leave out)."""
    if norms.numel():
        top = norms.max().to(torch.float32)
    else:
        top = norms.new_zeros((), dtype=torch.float32)
    if norm == "l2":
        top = top.sqrt()
    return (top + local_bound(dense).to(top.device)).reshape(1)


def split_bound(reduced: torch.Tensor, scaled: bool, world_size: int,
                wire_dtype: torch.dtype) -> tuple[torch.Tensor, WireScale]:
    """(reduced without its last element, the scale that element agrees) if `scaled`."""
    if not scaled:
        return reduced, unscaled(world_size)
    return reduced[:-1], scale_for(float(reduced[-1]), world_size, wire_dtype)


def agree(world_size: int, wire_dtype: torch.dtype, stage,
          *tensors: torch.Tensor | None) -> Generator[torch.Tensor, torch.Tensor, WireScale]:
    """StageGen: SUM-allreduce this rank's bound of sum(tensors) (one FP32 element); return
    the message's scale.

    `stage` is the compressor's `_stage` (it counts the 4 bytes as wire bytes). For a dtype
    that needs no scale nothing is computed or sent.
    """
    if not needs_scale(wire_dtype):
        return unscaled(world_size)
    reduced = yield from stage(local_bound(*tensors).reshape(1).clone())
    return scale_for(float(reduced[0]), world_size, wire_dtype)


def reference_average(xs: list[torch.Tensor], wire_dtype: torch.dtype = torch.float16,
                      scaled: bool = True) -> torch.Tensor:
    """Pure-torch reference: the average of n ranks' FP32 tensors sent as the wire does.

    Each rank's tensor is cast after the (agreed) pre-scale; the sum is taken in the wire
    dtype, one rank after another, as a ring or tree of FP16 additions would; the result is
    upcast and unscaled. scaled=False is torch's fp16_compress_hook: grad / n, no exponent.
    """
    n = len(xs)
    if scaled:
        bound = float(sum(float(x.abs().max()) for x in xs))
        ws = scale_for(bound, n, wire_dtype)
    else:
        ws = unscaled(n)
    acc = None
    for x in xs:
        w = (x.to(torch.float32) * ws.pre).to(wire_dtype)
        acc = w if acc is None else acc + w
    return acc.to(torch.float32) * ws.post
