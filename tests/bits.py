"""Bit-exact tensor comparison shared by the CPU and GPU kernel tests."""
from __future__ import annotations

import torch


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Assert two tensors are bit-identical (any NaN matches any NaN), naming the first miss."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
        ours.dtype, ref.dtype, ours.shape, ref.shape)
    view = {torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[ours.dtype]
    a, b = ours.contiguous(), ref.contiguous()
    same = (a.view(view) == b.view(view)) | (torch.isnan(a.float()) & torch.isnan(b.float()))
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{int((~same).sum())} of {a.numel()} elements differ; first at {i}: "
            f"ours {a[i].item()!r} (bits {a.view(view)[i].item():#x}) vs "
            f"ref {b[i].item()!r} (bits {b.view(view)[i].item():#x})")
