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
message (`agree`); CSC sends it inside its norms message, which it allreduces anyway. On a GPU
the agreed scale stays there (`TensorScale`: the kernels read it from device memory), so the
host never waits for the bound's allreduce; on the CPU it is read at once (`WireScale`). Both
come from one computation (`_exponent`), so CPU and GPU scale alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generator

import torch

__all__ = ["WireScale", "TensorScale", "unscaled", "needs_scale", "exponent_for", "scale_for",
           "scale_of", "tensor_scale", "local_bound", "norms_bound", "agree", "split_bound",
           "reference_average"]

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


@dataclass(frozen=True, eq=False)
class TensorScale:
    """A message's scales (as WireScale's) as 0-dim float32 tensors on the message's device."""

    pre: torch.Tensor
    post: torch.Tensor
    err: torch.Tensor


def unscaled(world_size: int) -> WireScale:
    """The scale of a message sent without a power of two (grad / n, as before)."""
    return WireScale(0, world_size)


def needs_scale(wire_dtype: torch.dtype) -> bool:
    """Whether messages in `wire_dtype` are scaled (FP16 only: BF16 has FP32's range)."""
    return wire_dtype == torch.float16


def _exponent(bound: torch.Tensor, world_size: int, wire_dtype: torch.dtype) -> torch.Tensor:
    """The largest e in [MIN_EXPONENT, MAX_EXPONENT] with bound * 2^e <= HEADROOM *
    max(wire_dtype) * n, as a float64 tensor on bound's device (0 for a bound that is 0 or not
    finite: nothing to scale, or a step the loss scaler skips anyway). Every product below is
    exact in float64 (a power of two times a float32), so every device finds the same e."""
    b = bound.detach().reshape(()).to(torch.float64)
    limit = HEADROOM * torch.finfo(wire_dtype).max * world_size
    ok = torch.isfinite(b) & (b > 0)
    b_safe = torch.where(ok, b, torch.ones_like(b))
    e = torch.floor(torch.log2(limit / b_safe)).clamp(MIN_EXPONENT - 2, MAX_EXPONENT + 2)
    # log2 rounds either way: one step up where it still fits, one down where it does not.
    e = torch.where(b_safe * _pow2(e + 1) <= limit, e + 1, e)
    e = torch.where(b_safe * _pow2(e) > limit, e - 1, e)
    e = e.clamp(MIN_EXPONENT, MAX_EXPONENT)
    return torch.where(ok, e, torch.zeros_like(e))


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e for integral float64 e (well inside float64's normal range), exactly: built from its
    exponent bits, where a library's exp2 or pow may be off by an ulp on some device."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def exponent_for(bound: float, world_size: int, wire_dtype: torch.dtype) -> int:
    """The exponent e with bound * 2^e / n <= HEADROOM * max(wire_dtype), as large as allowed.

    `bound` must be the same on every rank (the sum of the ranks' local bounds); 0 or a
    non-finite bound gives e = 0 (nothing to scale, or a step the loss scaler skips anyway).
    """
    if not needs_scale(wire_dtype):
        return 0
    return int(_exponent(torch.tensor(float(bound), dtype=torch.float64), world_size,
                         wire_dtype))


def scale_for(bound: float, world_size: int, wire_dtype: torch.dtype) -> WireScale:
    """The WireScale of a message whose agreed bound is `bound`."""
    return WireScale(exponent_for(bound, world_size, wire_dtype), world_size)


def scale_of(bound: torch.Tensor, world_size: int,
             wire_dtype: torch.dtype) -> WireScale | TensorScale:
    """The scale agreed by a reduced bound (a one-element tensor): kept on a GPU (TensorScale,
    no host read), read at once elsewhere (WireScale)."""
    if not bound.is_cuda:
        return scale_for(float(bound.reshape(())), world_size, wire_dtype)
    return tensor_scale(bound, world_size, wire_dtype)


def tensor_scale(bound: torch.Tensor, world_size: int, wire_dtype: torch.dtype) -> TensorScale:
    """The TensorScale a reduced bound agrees, computed on its device (any device): the same
    float32 values as scale_for's WireScale."""
    if not needs_scale(wire_dtype):
        e = torch.zeros((), dtype=torch.float64, device=bound.device)
    else:
        e = _exponent(bound, world_size, wire_dtype)
    two_e = _pow2(e)
    f32 = torch.float32
    return TensorScale((two_e / world_size).to(f32), (1.0 / two_e).to(f32),
                       (world_size / two_e).to(f32))


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


def split_bound(reduced: torch.Tensor, scaled: bool, world_size: int, wire_dtype: torch.dtype
                ) -> tuple[torch.Tensor, WireScale | TensorScale]:
    """(reduced without its last element, the scale that element agrees) if `scaled`."""
    if not scaled:
        return reduced, unscaled(world_size)
    return reduced[:-1], scale_of(reduced[-1:], world_size, wire_dtype)


def agree(world_size: int, wire_dtype: torch.dtype, stage, *tensors: torch.Tensor | None
          ) -> Generator[torch.Tensor, torch.Tensor, WireScale | TensorScale]:
    """StageGen: SUM-allreduce this rank's bound of sum(tensors) (one FP32 element); return
    the message's scale.

    `stage` is the compressor's `_stage` (it counts the 4 bytes as wire bytes). For a dtype
    that needs no scale nothing is computed or sent.
    """
    if not needs_scale(wire_dtype):
        return unscaled(world_size)
    reduced = yield from stage(local_bound(*tensors).reshape(1).clone())
    return scale_of(reduced, world_size, wire_dtype)


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
