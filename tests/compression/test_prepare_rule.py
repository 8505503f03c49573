"""The rule of `prepare`: it changes no value that outlives the step.

The engine may run a buffer's `prepare` before its batch is agreed, so it may write only spare
buffers. The values kept across steps (the residual, the velocity as SGD's momentum buffer, the
step counter, the statistics) must read the same after it, whatever the step brings: a new
loss scale, a new momentum under Nesterov, a re-bucketed layout (compression/csc.py's rule).
"""
from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, grads_for, layouts, make_ranks, step
from gradientflow.compression import CompressionConfig, Layout
from gradientflow.compression.sgd import SGDTerms


def _values(comp) -> dict:
    """What one rank keeps across steps, in value terms (units and layouts factored out)."""
    state = comp.memory.state_dict()
    factor = comp.velocity_factor()
    out = {f"{slot}/{name}": t.double() / (factor if slot == "momentum" else 1.0)
           for slot, per_name in state.items() for name, t in per_name.items()}
    out["step"] = torch.tensor(float(comp.step))
    out["stats"] = torch.tensor([float(comp.stats.steps), float(comp.stats.skipped_steps)])
    return out


@SETTINGS
@given(layout=layouts(), steps=st.integers(0, 3), density=st.sampled_from([0.1, 0.5, 1.0]),
       momentum_correction=st.booleans(), nesterov=st.booleans(),
       wire=st.sampled_from(["fp16", "fp32", "bf16"]),
       loss_scale=st.sampled_from([1.0, 1024.0]), new_scale=st.sampled_from([1.0, 65536.0]),
       new_momentum=st.sampled_from([0.9, 0.5]), regroup=st.booleans(), seed=st.integers(0, 999))
def test_prepare_changes_no_value_kept_across_steps(layout, steps, density, momentum_correction,
                                                   nesterov, wire, loss_scale, new_scale,
                                                   new_momentum, regroup, seed):
    cfg = CompressionConfig(method="csc", density=density, chunk_size=8, wire_dtype=wire,
                            warmup_densities=(), momentum_correction=momentum_correction,
                            nesterov=nesterov and momentum_correction, min_numel=16)
    (comp,) = make_ranks(cfg, 1)
    for t in range(steps):
        step([comp], layout, grads_for(1, layout.numel, seed + t), loss_scale=loss_scale)
    before = _values(comp)
    # The next step's buffer: another loss scale, another momentum, maybe DDP's new buckets.
    target = layout
    if regroup:
        target = Layout.from_shapes(list(zip(layout.names, layout.shapes))[::-1])
    terms = SGDTerms(new_momentum, cfg.nesterov) if momentum_correction else None
    grad = grads_for(1, target.numel, seed + 100)[0]
    comp.prepare(grad, target, loss_scale=new_scale, terms=terms)
    after = _values(comp)
    # A slot created by prepare holds zeros: the value it had before, when nothing was kept.
    for key in before.keys() | after.keys():
        was = before.get(key, torch.zeros_like(after.get(key, torch.zeros(0))))
        now = after.get(key, torch.zeros_like(was))
        torch.testing.assert_close(now, was, rtol=1e-6, atol=0.0, msg=key)
