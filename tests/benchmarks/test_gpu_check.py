"""The GPU acceptance script off the GPU: it refuses at once, and its report renders."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_refuses_at_once_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_report_renders_every_part():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as G

    impls = ["triton", "torch"]
    timing, speed = {}, {}
    for name in ("ef", "ef_momentum", "inplace"):
        for i in impls:
            stage = {"bytes": 1, "GBps": 1.0, "of_copy": 0.5}
            timing[f"{name}/{i}"] = {
                "median_ms": {s: 1.0 for s in ("norms", "select", "pack", "unpack", "step",
                                               "wall")},
                "bandwidth": {**{s: stage for s in ("norms", "select", "pack", "unpack")},
                              "step": {**stage, "floor_ms": 0.1}}}
        speed[f"{name}/triton"] = 2.0
    cmp = {"norms_max_rel_err": 1e-7, "same_selection": True, "packed_bits_differ": 0,
           "grad_bits_differ": 0, "residual_bits_differ": 0}
    rep = {
        "command": "python benchmarks/gpu_check.py", "written": "now",
        "env": {"ok": True, "seconds": 1, "result": {"device": "GPU"}},
        "kernels": {"ok": True, "seconds": 1, "result": {
            "numel": 10, "chunk": 2, "k": 1, "nchunks": 5, "reps": 3, "impls": impls,
            "copy": {"ms": 0.1, "GBps": 100.0}, "timing": timing, "speedup_vs_torch": speed,
            "compare": {"ef/triton": cmp}}},
        "ddp": {"ok": True, "seconds": 1, "result": {
            "model": "m", "batch": 2, "steps": 3, "warmup": 1, "precision": "fp32",
            "median_step_ms": {"no hook": 10.0, "csc hook": 11.0},
            "added_ms_paired_median": {"csc hook": 1.0}}},
        "world1": {"ok": True, "seconds": 1, "result": {"mode": "backend", "checks": [
            {"name": "c", "ok": True, "seconds": 1, "details": {}}]}},
        "two_ranks": {"ok": False, "seconds": 1, "result": {
            "transport": "gloo", "seconds": 1, "hung_ranks": [], "ranks": [
                [{"name": "c", "ok": True}], [{"name": "c", "ok": False, "error": "boom"}]]}},
        "pytest": {"ok": True, "rc": 0, "seconds": 1, "log_tail": "1 passed"},
    }
    md = G._markdown(rep)
    for text in ("| ef | 1.000 | 1.000 | 2.00x | 0.100 |", "| csc hook | 11.00 | 1.0 |",
                 "| c | ok | **boom** |", "1 passed", "| two_ranks | **NO** | 1 |"):
        assert text in md, text
