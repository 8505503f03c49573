"""The float32 -> binary16/bfloat16 bit conversions against torch's own casts, on every class."""

import numpy as np
import pytest
import torch

from gradientflow import kernels as K
from gradientflow.kernels import half

from .conftest import assert_same_bits

WIRE16 = [torch.float16, torch.bfloat16]


def _bits(*values: int) -> torch.Tensor:
    """float32 tensor from raw bit patterns (and their negatives)."""
    b = np.array(values, dtype=np.uint32)
    b = np.concatenate([b, b | np.uint32(0x80000000)])
    return torch.from_numpy(b.view(np.float32).copy())


def _class_samples() -> torch.Tensor:
    """Normals, subnormals, halfway cases, overflow boundaries, inf, NaN, +-0, for both formats."""
    rng = np.random.default_rng(1)
    pats = [0x0, 0x1, 0x7FFFFF, 0x400000, 0x00800000, 0x7F800000, 0x7FC00000, 0x7F800001,
            0x7FBFFFFF, 0x7FFFFFFF, 0x7F7FFFFF, 0x3F800000]
    # binary16 landmarks: max 65504 (0x477FE000), its half-ulp 65520 (0x477FF000) and around;
    # smallest normal 2**-14 (0x38800000), smallest subnormal 2**-24 (0x33800000), 2**-25.
    for base in (0x477FE000, 0x477FF000, 0x38800000, 0x38000000, 0x33800000, 0x33000000,
                 0x33400000, 0x37800000, 0x387FC000):
        pats += [base - 1, base, base + 1]
    # Halfway cases of binary16 (13 dropped bits = 0x1000) with even and odd kept lsb, normal and
    # subnormal; and of bfloat16 (16 dropped bits = 0x8000).
    for e in (0x3F800000, 0x38800000, 0x46000000, 0x3A000000):
        for lsb in (0, 1):
            pats += [e | (lsb << 13) | 0x1000, e | (lsb << 13) | 0x0FFF, e | (lsb << 13) | 0x1001,
                     e | (lsb << 16) | 0x8000, e | (lsb << 16) | 0x7FFF, e | (lsb << 16) | 0x8001]
    for sub_e in range(102, 113):  # every exponent that lands in binary16's subnormal range
        for m in (0, 0x1000, 0x2000, 0x400000, 0x7FFFFF, 0x3000, 0x6000):
            pats.append((sub_e << 23) | m)
    pats += [int(x) for x in rng.integers(0, 2**31, size=20000)]
    return _bits(*pats)


@pytest.mark.parametrize("wire", WIRE16)
def test_numba_round_matches_torch_on_every_class(wire):
    x = _class_samples()
    ours = K.cast_scaled(x, 1.0, wire, impl="numba")
    assert_same_bits(ours, x.to(wire))


@pytest.mark.parametrize("wire", WIRE16)
def test_python_round_functions_match_torch(wire):
    # The same integer functions run as plain Python under the CUDA simulator: check them too.
    x = _class_samples()[:3000]
    f = half.f32bits_to_f16bits if wire == torch.float16 else half.f32bits_to_bf16bits
    bits = x.view(torch.int32).numpy().view(np.uint32)
    ours = np.array([f(int(b)) for b in bits], dtype=np.uint16)
    assert_same_bits(torch.from_numpy(ours.view(np.int16)).view(wire), x.to(wire))


@pytest.mark.parametrize("wire", WIRE16)
def test_upcast_is_exact_on_all_65536_patterns(wire):
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(wire)
    out = torch.empty(h.numel())
    assert_same_bits(K.upcast_scaled(h, 1.0, out=out, impl="numba"), h.to(torch.float32))
    f = half.f16bits_to_f32bits if wire == torch.float16 else half.bf16bits_to_f32bits
    py = np.array([f(int(b) & 0xFFFF) for b in h.view(torch.int16).numpy()], dtype=np.uint32)
    assert_same_bits(torch.from_numpy(py.view(np.float32)), h.to(torch.float32))


def test_nan_keeps_its_sign_and_stays_quiet():
    x = _bits(0x7F800001, 0x7FC00000, 0x7FFFFFFF)
    for wire in WIRE16:
        ours = K.cast_scaled(x, 1.0, wire, impl="numba")
        assert bool(torch.isnan(ours.float()).all())
        sign16 = ours.view(torch.int16) < 0
        assert torch.equal(sign16, torch.signbit(x))
        quiet = 0x0200 if wire == torch.float16 else 0x0040
        assert bool(((ours.view(torch.int16).int() & quiet) != 0).all())
