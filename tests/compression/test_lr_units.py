"""The residual follows the learning rate (Compressor.follow_lr): what waits keeps its update.

Dense SGD applies each step's gradient at that step's rate. With each parameter's residual
re-expressed at every change of its rate, a run that sends part of each step applies, in
total, the dense run's update: sum_t lr_t * out_t + lr_T * (what is still waiting) =
sum_t lr_t * mean gradient_t, parameter by parameter, under any schedules of positive rates
(warm-up, decay, steps, one per parameter group); a rate of 0 leaves the residual as it is
(test_rescale_and_checkpoint).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from compression_helpers import flat_slot, grads_for, make_ranks, step
from gradientflow.compression import CompressionConfig, Layout

LAYOUT = Layout.from_shapes([("w", (48, 8)), ("v", (64,))])
RATES = st.sampled_from([1e-3, 0.01, 0.05, 0.1, 0.4])


def _config(density: float) -> CompressionConfig:
    return CompressionConfig(method="csc", density=density, chunk_size=16, wire_dtype="fp32",
                             warmup_densities=(), momentum_correction=False, min_numel=1)


def _per_element(rates: dict[str, float]) -> torch.Tensor:
    return torch.cat([torch.full((n,), rates[name], dtype=torch.float64)
                      for name, n in zip(LAYOUT.names, LAYOUT.numels)])


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 3), seed=st.integers(0, 2**16),
       schedule=st.lists(st.tuples(RATES, RATES), min_size=2, max_size=8),
       density=st.sampled_from([0.05, 0.2, 0.5]))
def test_update_mass_is_kept_under_any_schedule(world, seed, schedule, density):
    comps = make_ranks(_config(density), world)
    numel = LAYOUT.numel
    applied = torch.zeros(numel, dtype=torch.float64)
    dense = torch.zeros(numel, dtype=torch.float64)
    for t, (lr_w, lr_v) in enumerate(schedule):  # two parameter groups, two schedules
        rates = {"w": lr_w, "v": lr_v}
        for c in comps:
            c.follow_lr(rates)
        grads = grads_for(world, numel, seed + t)
        outs = step(comps, LAYOUT, grads)
        lr = _per_element(rates)
        applied += lr * outs[0].double()
        dense += lr * torch.stack(grads).double().mean(0)
    waiting = sum(flat_slot(c, LAYOUT).double() for c in comps) / world
    total = applied + _per_element(comps[0].residual_lr) * waiting
    assert torch.allclose(total, dense, rtol=1e-5, atol=1e-5), (total - dense).abs().max()


def test_rescale_and_checkpoint():
    (comp,) = make_ranks(_config(0.05), 1)
    comp.follow_lr({"w": 0.1, "v": 0.1})
    step([comp], LAYOUT, grads_for(1, LAYOUT.numel, 0))
    before = flat_slot(comp, LAYOUT).clone()
    w = LAYOUT.numels[0]
    comp.follow_lr({"w": 0.05, "v": 0.1})  # w's rate halves: what waits is worth twice
    after = flat_slot(comp, LAYOUT)
    assert torch.allclose(after[:w], 2 * before[:w]) and torch.equal(after[w:], before[w:])
    comp.follow_lr({"w": 0.0, "v": 0.0})  # expresses nothing: kept as it is
    assert torch.allclose(flat_slot(comp, LAYOUT)[:w], 2 * before[:w])
    assert comp.residual_lr == {"w": 0.05, "v": 0.1}
    (other,) = make_ranks(_config(0.05), 1)
    other.load_state_dict(comp.state_dict())
    assert other.residual_lr == {"w": 0.05, "v": 0.1}


def test_the_follower_hands_every_parameter_its_groups_rate():
    from gradientflow.compression.momentum import SGDFollower

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}],
                          momentum=0.9)
    seen = []
    SGDFollower(opt, "test", lambda bufs: None, follow_lr=seen.append).begin_step()
    assert seen == [{id(a): 0.1, id(b): 0.2}]


@pytest.mark.parametrize("world", [2])
def test_a_schedule_through_the_optimizer_keeps_the_update(pools, world):
    """Through the DistributedOptimizer, a warm-up then decay at density 1 stays the dense run
    (nothing waits to be rescaled), and every segment's residual follows its group's rate
    under the name the compressor keeps it by (row-split parameters included)."""
    res = pools(world).run(_dense_vs_density_one, timeout=120)
    for rank, (worst, followed, segments) in enumerate(res):
        assert worst < 1e-5, (rank, worst)
        assert followed == {name: 0.02 for name in segments}, (rank, followed, segments)


def _dense_vs_density_one(rank, world):
    import copy

    import torch

    import gradientflow.optim as gfo

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    cfg = CompressionConfig(method="csc", density=1.0, chunk_size=16, wire_dtype="fp32",
                            warmup_densities=(), min_numel=1)
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=cfg,
                                   partition_bytes=256)
    worst = 0.0
    for t, lr in enumerate([0.01, 0.05, 0.1, 0.05, 0.02]):
        for o in (ref_opt, opt):
            for g in o.param_groups:
                g["lr"] = lr
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        xs, ys = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
        opt.zero_grad()
        ((model(xs) - ys) ** 2).mean().backward()
        opt.step()
        worst = max(worst, max(float((p - q).abs().max())
                               for p, q in zip(model.parameters(), ref.parameters())))
    segments = [seg.name for part in opt.plan for seg in part.segments]
    followed = dict(opt._compressor.residual_lr)
    opt.close()
    return worst, followed, segments
