"""CompressionConfig refuses bad values at construction, naming the valid range."""
from __future__ import annotations

import pytest
import torch

from gradientflow.compression import (DENSE_FIRST_WARMUP, DGC_WARMUP, CompressionConfig, available,
                                      compressor_class, make_compressor)


@pytest.mark.parametrize("kwargs, match", [
    (dict(density=0.0), r"density=0.0 must be in \(0, 1\]"),
    (dict(density=1.5), r"\(0, 1\]"),
    (dict(density=float("nan")), r"\(0, 1\]"),
    (dict(chunk_size=0), r"chunk_size=0 must be an integer >= 1"),
    (dict(chunk_size=2.5), r">= 1"),
    (dict(norm="l3"), r"'l1' or 'l2'"),
    (dict(wire_dtype="fp8"), r"one of \['bf16', 'fp16', 'fp32'\]"),
    (dict(wire_dtype=torch.int8), r"not a wire dtype"),
    (dict(method="topk"), r"unknown; use one of \[.csc., .fp16., .none., .powersgd.\]"),
    (dict(method="fp16", wire_dtype="fp32"), r"half-precision"),
    (dict(warmup_densities=(0.5, 0.0)), r"every stage must be in \(0, 1\]"),
    (dict(warmup_unit="batch"), r"'epoch' or 'step'"),
    (dict(warmup_period=0), r">= 1"),
    (dict(momentum=1.0), r"\[0, 1\)"),
    (dict(momentum_correction=True, error_feedback=False), r"needs error_feedback"),
    (dict(clip_norm=0.0), r"clip_norm=0.0 must be a finite number > 0"),
    (dict(clip_norm=float("inf")), r"clip_norm"),
    (dict(min_numel=-1), r">= 0"),
])
def test_invalid_config_raises_value_error_naming_the_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(**kwargs)


def test_defaults_and_dtype_names():
    cfg = CompressionConfig(wire_dtype=torch.bfloat16)
    assert cfg.wire_dtype == "bf16" and cfg.torch_wire_dtype is torch.bfloat16
    d = CompressionConfig()
    assert (d.method, d.density, d.chunk_size, d.norm, d.wire_dtype) == (
        "csc",
        0.01,
        1024,
        "l1",
        "fp16",
    )
    with pytest.raises(Exception):
        d.density = 0.5  # frozen


def test_warmup_schedule_ramps_to_the_target_never_below():
    cfg = CompressionConfig(density=0.01, warmup_densities=DGC_WARMUP, warmup_unit="epoch",
                            warmup_period=1)
    assert [cfg.density_at(e, 0) for e in range(6)] == [0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01]
    assert cfg.in_warmup(2, 0) and not cfg.in_warmup(3, 0)
    per_step = CompressionConfig(density=0.001, warmup_densities=DGC_WARMUP, warmup_period=10)
    assert per_step.density_at(99, 9) == 0.25 and per_step.density_at(0, 10) == 0.0625
    assert per_step.density_at(0, 35) == 0.004 and per_step.density_at(0, 40) == 0.001
    assert CompressionConfig(warmup_densities=()).density_at(0, 0) == 0.01


def test_dense_rule():
    cfg = CompressionConfig()
    assert cfg.is_dense_param((64,)) and cfg.is_dense_param(()) and cfg.is_dense_param((10, 10))
    # Matrices below 16 default chunks are dense; from 16 on they are sparsified.
    assert cfg.is_dense_param((64, 64)) and cfg.is_dense_param((16, 16, 3, 3))
    assert not cfg.is_dense_param((128, 128)) and not cfg.is_dense_param((64, 32, 3, 3))
    assert not CompressionConfig(dense_1d=False, min_numel=0).is_dense_param((64,))


def test_registry_builds_by_name():
    assert set(available()) >= {"csc", "fp16", "none"}
    assert make_compressor(CompressionConfig(method="fp16"), 2).name == "fp16"
    with pytest.raises(ValueError, match="not registered"):
        compressor_class("topk")


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="fp16", density=0.01), r"method 'fp16' has no option 'density' \('density' is "
                                         r"an option of 'csc'\)"),
    (dict(method="none", chunk_size=8), r"method 'none' has no option 'chunk_size'"),
    (dict(method="csc", rank=4), r"method 'csc' has no option 'rank' \('rank' is an option of "
                                 r"'powersgd'\)"),
    (dict(method="powersgd", density=0.1), r"method 'powersgd' has no option 'density'.*"
                                           r"its options are \['rank'"),
    (dict(method="csc", densty=0.1), r"method 'csc' has no option 'densty'; its options are "
                                     r"\['density'"),
])
def test_an_option_the_method_does_not_have_is_refused_naming_the_method(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(**kwargs)


def test_options_read_replace_compare_and_pickle_as_one_config():
    """The method's options read as the config's attributes; dataclasses.replace, equality,
    hashing, pickling and the flat dict keep working across the core/options split."""
    import dataclasses
    import pickle

    cfg = CompressionConfig(method="csc", density=0.05, wire_dtype="bf16")
    assert (cfg.density, cfg.chunk_size, cfg.wire_dtype) == (0.05, 1024, "bf16")
    smaller = dataclasses.replace(cfg, chunk_size=64)
    assert smaller.chunk_size == 64 and smaller.density == 0.05 and smaller != cfg
    with pytest.raises(ValueError, match=r"chunk_size=0"):
        dataclasses.replace(cfg, chunk_size=0)
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(
        CompressionConfig(method="csc", density=0.05, wire_dtype="bf16"))
    flat = cfg.as_dict()
    assert flat["density"] == 0.05 and flat["method"] == "csc" and "options" not in flat
    assert CompressionConfig(**flat) == cfg
    fp16 = CompressionConfig(method="fp16")
    assert not hasattr(fp16, "density") and fp16.as_dict() == {
        "method": "fp16", "wire_dtype": "fp16", "error_feedback": True}
    with pytest.raises(ValueError, match="belong to another method"):
        dataclasses.replace(cfg, method="fp16")


def test_default_recipe_is_dense_first_in_steps_with_the_optimizers_momentum():
    """The default recipe with nothing set: dense, then DGC's stages, counted in steps; the
    optimizer keeps its momentum (momentum correction off)."""
    d = CompressionConfig(density=0.01)
    assert not d.momentum_correction and d.error_feedback
    assert d.momentum is None and d.momentum_value == 0.9
    assert d.warmup_unit == "step" and d.warmup_densities == DENSE_FIRST_WARMUP
    p = d.warmup_period
    assert [d.density_at(0, s * p) for s in range(6)] == [1.0, 0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert d.in_warmup(0, 4 * p - 1) and not d.in_warmup(0, 4 * p)


def test_default_compressor_reaches_the_target_without_set_epoch():
    """CSCState(density=0.01) with nothing else set may not stay at a warm-up density for ever."""
    from gradientflow.compression import Layout
    from gradientflow.engine.stages import drive_lockstep
    c = make_compressor(CompressionConfig(density=0.01), 1)
    lay = Layout.from_shapes([("w", (64, 64))])
    for _ in range(CompressionConfig().warmup_length):
        drive_lockstep([c.reduce(torch.randn(lay.numel), lay)])
        c.end_step()
    assert c.density_in_force() == 0.01 and not c.in_warmup()


def test_epoch_warmup_without_set_epoch_raises_saying_what_to_call():
    from gradientflow.compression import Layout
    from gradientflow.engine.stages import drive_lockstep
    c = make_compressor(CompressionConfig(warmup_unit="epoch"), 1)
    lay = Layout.from_shapes([("w", (64, 64))])
    with pytest.raises(RuntimeError, match=r"set_epoch\(epoch\)"):
        drive_lockstep([c.reduce(torch.randn(lay.numel), lay)])
    c.set_epoch(0)
    drive_lockstep([c.reduce(torch.randn(lay.numel), lay)])
    assert c.density_in_force() == 1.0
    fp16 = make_compressor(CompressionConfig(method="fp16"), 1)
    fp16.check_schedule()  # no warm-up to drive: nothing to set


def test_non_float_gradient_is_refused():
    from gradientflow.compression import Layout
    c = make_compressor(CompressionConfig(method="none"), 1)
    lay = Layout.from_shapes([("w", (4,))])
    with pytest.raises(ValueError, match="float32"):
        next(c.reduce(torch.zeros(4, dtype=torch.float64), lay))
    with pytest.raises(ValueError, match="float32"):
        next(c.reduce(torch.zeros(4, dtype=torch.int32), lay))
