"""IEEE half (binary16) and bfloat16 conversions on raw bits, for numba targets without float16.

numba's CPU target has no float16 type, so the kernels write the 16 bits of each wire value into
a uint16 array that torch then views as ``torch.float16`` / ``torch.bfloat16``. The functions in
this module work on the bit patterns held in int64 (so numba never unifies signed and unsigned
integers into float64) and are written once, in plain Python: the CPU kernels
(``cpu_chunked.py``, ``cpu_wire.py``) compile them with ``njit``, ``cuda.py`` with
``cuda.jit(device=True)``, and the tests run them as Python.

Rounding is to nearest, ties to even, as torch's casts: overflow rounds to inf, values below
half the smallest subnormal round to (signed) zero, NaN stays a quiet NaN with its sign.

The bit casts between float32 and its 32 bits are per target: ``f32_to_bits`` / ``bits_to_f32``
here are the numba CPU intrinsics (an LLVM bitcast, no memory round trip). The CPU kernels use
branch-free variants (``f32_to_f16_bits``, ``f16_bits_to_f32``) that LLVM vectorises (3x faster
on the dense FP16 path, measured), or, where the host has them (x86 F16C, AArch64), the
hardware conversion instructions (another 2.5x on the fused FP16 pass, see the end of this
file); the tests hold every variant to torch's casts.

Caveat for editing: numba's on-disk cache keys a kernel on its own file only, so after changing
this file delete ``kernels/__pycache__/*.nbi`` and ``*.nbc`` (or touch ``cpu_chunked.py`` and
``cpu_wire.py``); an installed package is unaffected (its files change together on upgrade).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "f32bits_to_f16bits",
    "f32bits_to_bf16bits",
    "f16bits_to_f32bits",
    "bf16bits_to_f32bits",
    "f32_to_bits",
    "bits_to_f32",
    "f32_to_f16_bits",
    "f32_to_bf16_bits",
    "f16_bits_to_f32",
    "bf16_bits_to_f32",
    "HARDWARE_HALF",
]


# ---- pure integer functions (shared by every target) ----------------------------------------


def f32bits_to_f16bits(x):
    """Round the float32 with bits ``x`` (0 <= x < 2**32) to binary16 bits, ties to even."""
    sign = (x >> 16) & 0x8000
    f = x & 0x7FFFFFFF
    if f >= 0x7F800000:
        if f > 0x7F800000:
            h = 0x7E00 | ((f >> 13) & 0x3FF)  # NaN: quiet, keep the top payload bits
        else:
            h = 0x7C00  # inf
    elif f >= 0x477FF000:
        # >= 65520 (max half 65504 plus half an ulp): rounds to inf. The exact tie 65520 goes
        # to even, which is inf too.
        h = 0x7C00
    elif f >= 0x38800000:
        # Normal half (>= 2**-14): rebias the exponent (127 -> 15) and round the 13 dropped
        # mantissa bits to nearest even; a carry into the exponent is the right answer.
        h = (f - 0x38000000 + 0xFFF + ((f >> 13) & 1)) >> 13
    elif f >= 0x33000000:
        # Subnormal half (2**-25 <= |x| < 2**-14): the value in units of 2**-24 is the 24-bit
        # significand shifted right by 126 - exponent (14..24 bits), rounded to even.
        e = f >> 23
        mant = (f & 0x7FFFFF) | 0x800000
        shift = 126 - e
        h = mant >> shift
        rem = mant & ((1 << shift) - 1)
        halfway = 1 << (shift - 1)
        if rem > halfway or (rem == halfway and (h & 1) == 1):
            h += 1
    else:
        h = 0  # below 2**-25 (or exactly it: a tie that goes to the even zero)
    return sign | h


def f32bits_to_bf16bits(x):
    """Round the float32 with bits ``x`` to bfloat16 bits, ties to even (NaN stays quiet NaN)."""
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return ((x >> 16) | 0x40) & 0xFFFF
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF


def f16bits_to_f32bits(h):
    """Return the float32 bits of the binary16 value with bits ``h`` (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        # Subnormal half: normalise (it is a normal float32).
        e = 113
        while (m & 0x400) == 0:
            m <<= 1
            e -= 1
        return sign | (e << 23) | ((m & 0x3FF) << 13)
    return sign | ((e + 112) << 23) | (m << 13)


def bf16bits_to_f32bits(h):
    """Return the float32 bits of the bfloat16 value with bits ``h`` (exact)."""
    return (h & 0xFFFF) << 16


# ---- numba CPU: bit casts and compiled wrappers --------------------------------------------


@intrinsic
def f32_to_bits(typingctx, x):
    """Return the 32 bits of a float32 as an int64 in [0, 2**32) (LLVM bitcast)."""
    if not isinstance(x, types.Float):
        return None
    sig = types.int64(x)

    def codegen(context, builder, signature, args):
        val = args[0]
        if isinstance(x, types.Float) and x.bitwidth == 64:
            val = builder.fptrunc(val, ir.FloatType())
        bits = builder.bitcast(val, ir.IntType(32))
        return builder.zext(bits, ir.IntType(64))

    return sig, codegen


@intrinsic
def bits_to_f32(typingctx, x):
    """Return the float32 whose bits are the low 32 bits of integer ``x`` (LLVM bitcast)."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        val = args[0]
        width = x.bitwidth
        if width > 32:
            val = builder.trunc(val, ir.IntType(32))
        elif width < 32:
            val = builder.zext(val, ir.IntType(32))
        return builder.bitcast(val, ir.FloatType())

    return sig, codegen


_jit_int = njit(inline="always", cache=True, nogil=True)
_f32bits_to_f16bits = _jit_int(f32bits_to_f16bits)
_f32bits_to_bf16bits = _jit_int(f32bits_to_bf16bits)
_f16bits_to_f32bits = _jit_int(f16bits_to_f32bits)
_bf16bits_to_f32bits = _jit_int(bf16bits_to_f32bits)


@njit(inline="always", cache=True, nogil=True)
def _f32_to_f16_bits_sw(x):
    """Round float32 ``x`` to binary16 and return its bits (int64); branch-free for vectorising.

    The same results as ``f32bits_to_f16bits``, computed with selects: the subnormal range
    rounds by adding 0.5 in float32 (the FPU rounds to nearest even at exactly half's
    subnormal quantum 2**-24; this is F. Giesen's well-known method), which needs the
    default rounding mode.
    """
    b = f32_to_bits(np.float32(x))
    sign = (b >> 16) & 0x8000
    f = b & 0x7FFFFFFF
    normal = (f - 0x38000000 + 0xFFF + ((f >> 13) & 1)) >> 13
    sub = f32_to_bits(bits_to_f32(f) + np.float32(0.5)) - 0x3F000000
    special = (0x7E00 | ((f >> 13) & 0x3FF)) if f > 0x7F800000 else 0x7C00
    h = special if f >= 0x477FF000 else (normal if f >= 0x38800000 else sub)
    return sign | h


@njit(inline="always", cache=True, nogil=True)
def f32_to_bf16_bits(x):
    """Round float32 ``x`` to bfloat16 and return its bits (int64)."""
    return _f32bits_to_bf16bits(f32_to_bits(np.float32(x)))


@njit(inline="always", cache=True, nogil=True)
def _f16_bits_to_f32_sw(h):
    """Return the float32 value of binary16 bits ``h``; branch-free for vectorising.

    Same values as ``f16bits_to_f32bits``: a subnormal half is its 10-bit mantissa times
    2**-24, exact in float32.
    """
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    normal = bits_to_f32(sign | ((em << 13) + 0x38000000))
    special = bits_to_f32(sign | 0x7F800000 | ((em & 0x3FF) << 13))
    mag = np.float32(em) * np.float32(5.9604644775390625e-08)
    sub = -mag if sign != 0 else mag
    return special if em >= 0x7C00 else (normal if em >= 0x400 else sub)


@njit(inline="always", cache=True, nogil=True)
def bf16_bits_to_f32(h):
    """Return the float32 value of bfloat16 bits ``h``."""
    return bits_to_f32(_bf16bits_to_f32bits(np.int64(h)))


# ---- numba CPU: the conversion instructions of the host, when it has them ------------------
#
# x86 CPUs with F16C (every x86-64 CPU since 2012-2013) and every AArch64 CPU convert between
# binary16 and float32 in hardware, vectorised: LLVM's fptrunc/fpext to `half` compile to
# vcvtps2ph/vcvtph2ps, several times faster than the integer conversions above in the fused
# FP16 error-feedback pass (docs/DECISIONS.md, "CPU kernels").
# Both round to nearest even with the default MXCSR, as torch does; the tests hold them to
# torch's casts on every class. Elsewhere (or with NUMBA_CPU_NAME set: a cache meant for
# other CPUs) the integer versions are used, since LLVM would emit a library call numba's JIT
# may not resolve.


def _host_has_half_instructions() -> bool:
    import platform

    import numba
    from llvmlite import binding as llvm

    if numba.config.CPU_NAME not in (None, "host"):
        return False
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine in ("x86_64", "amd64"):
        try:
            return bool(llvm.get_host_cpu_features().get("f16c", False))
        except Exception:  # noqa: BLE001 - unknown host: the integer versions are always right
            return False
    return False


HARDWARE_HALF = _host_has_half_instructions()


@intrinsic
def _hw_f32_to_f16(typingctx, x):
    """Round a float32 to binary16 and return its 16 bits (LLVM fptrunc to half)."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _hw_f16_to_f32(typingctx, h):
    """Return the float32 value of binary16 bits (LLVM fpext from half)."""
    if not isinstance(h, types.Integer) or h.bitwidth != 16:
        return None
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(inline="always", cache=True, nogil=True)
def _f32_to_f16_bits_hw(x):
    """Round float32 ``x`` to binary16 with the conversion instruction; bits as int64."""
    return np.int64(_hw_f32_to_f16(np.float32(x)))


@njit(inline="always", cache=True, nogil=True)
def _f16_bits_to_f32_hw(h):
    """Return the float32 value of binary16 bits ``h`` with the conversion instruction.

    The instruction quiets a signalling NaN (sets float32 bit 22); torch's cast keeps it
    signalling, so that bit is cleared again for one (a select: the loop stays vectorised).
    """
    h16 = np.uint16(np.int64(h) & 0xFFFF)
    y = _hw_f16_to_f32(h16)
    em = np.int64(h16) & 0x7FFF
    quiet_bit = 0x400000 if (em > 0x7C00 and (em & 0x200) == 0) else 0
    return bits_to_f32(f32_to_bits(y) ^ quiet_bit)


f32_to_f16_bits = _f32_to_f16_bits_hw if HARDWARE_HALF else _f32_to_f16_bits_sw
f16_bits_to_f32 = _f16_bits_to_f32_hw if HARDWARE_HALF else _f16_bits_to_f32_sw


