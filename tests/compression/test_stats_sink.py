"""Compression statistics reach the process-wide sink: stats() gives the density really used."""
from __future__ import annotations

import math

import torch

import gradientflow
from gradientflow.compression import CompressionConfig, Layout, make_compressor
from gradientflow.engine.stages import drive_lockstep


def test_stats_density_is_the_density_in_force():
    lay = Layout.from_shapes([("w", (64, 64)), ("b", (64,))])
    cfg = CompressionConfig(density=0.01, chunk_size=64, warmup_densities=(1.0, 0.25),
                            warmup_unit="step", warmup_period=1, momentum_correction=False,
                            min_numel=0)
    comps = [make_compressor(cfg, 2) for _ in range(2)]
    nch = math.ceil(lay.numel / 64)
    gradientflow.reset_stats()
    seen = []
    for step in range(3):
        drive_lockstep([c.reduce(torch.randn(lay.numel), lay) for c in comps])
        for c in comps:
            c.end_step()
        seen.append(gradientflow.stats()["density"])
        gradientflow.reset_stats()
    expect = [min(nch, math.ceil(d * nch)) / nch for d in (1.0, 0.25, 0.01)]
    assert seen == expect, (seen, expect)
