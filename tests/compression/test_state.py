"""Residuals are keyed by parameter name: they survive state_dict round trips, bucket re-layouts and
resizes."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, make_ranks
from gradientflow.compression import CompressionConfig, Layout, make_compressor
from gradientflow.compression.checkpoint import gather_shards, shard_for_rank
from gradientflow.engine.stages import drive_lockstep

PARAMS = [("l1.weight", (16, 12)), ("l1.bias", (16,)), ("bn.weight", (16,)), ("bn.bias", (16,)),
          ("l2.weight", (9, 16)), ("l2.bias", (9,))]
SHAPES = dict(PARAMS)


def _buckets(order, cuts):
    """Split the parameters (in `order`) into consecutive buckets at the given cut points."""
    names = [PARAMS[i][0] for i in order]
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(names))), len(names)]
    return [
        Layout.from_shapes((n, SHAPES[n]) for n in names[s:e]) for s, e in zip(edges, edges[1:])
    ]


def _run(comps, buckets, grads_by_name, loss_scale=1.0):
    """One step over the buckets; returns {name: applied average}."""
    applied = {}
    for lay in buckets:
        flats = [torch.cat([g[n].reshape(-1) for n in lay.names]) for g in grads_by_name]
        outs = drive_lockstep(
            [c.reduce(f, lay, loss_scale=loss_scale) for c, f in zip(comps, flats)]
        )
        for n, s, e in lay.slices():
            applied[n] = outs[0][s:e].clone().view(SHAPES[n])
    for c in comps:
        c.end_step()
    return applied


def _grads(world, seed):
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=gen) for n, s in PARAMS} for _ in range(world)]


def _held(comps):
    out = {}
    for c in comps:
        for n, t in c.memory.state_dict().get("residual", {}).items():
            out[n] = out.get(n, 0) + t.double()
    return out


CFG = dict(
    method="csc", density=0.25, chunk_size=8, wire_dtype="fp16", warmup_densities=(), min_numel=0
)


@SETTINGS
@given(world=st.integers(1, 3), order=st.permutations(range(len(PARAMS))),
       cuts=st.lists(st.integers(1, len(PARAMS) - 1), max_size=3), momentum=st.booleans(),
       seed=st.integers(0, 2**16))
def test_relayout_keeps_every_parameters_state_and_loses_nothing(
    world, order, cuts, momentum, seed
):
    """DDP's rebuild: first layout, then another; per-name state is carried over and the invariant
    holds."""
    cfg = CompressionConfig(**CFG, momentum_correction=momentum)
    comps = make_ranks(cfg, world)
    first = _buckets(list(reversed(range(len(PARAMS)))), [])
    second = _buckets(order, cuts)
    produced = {n: torch.zeros(s, dtype=torch.float64) for n, s in PARAMS}
    applied = {n: torch.zeros(s, dtype=torch.float64) for n, s in PARAMS}
    for t in range(4):
        grads = _grads(world, seed + t)
        for g in grads:
            for n in g:
                produced[n] += g[n].double()
        if t == 2:
            snapshot = [c.memory.state_dict() for c in comps]
            for c in comps:
                for lay in second:
                    c.memory.get(lay, ("residual", "_residual_spare"), torch.zeros(1), 1.0)
            for c, snap in zip(comps, snapshot):
                now = c.memory.state_dict()
                for slot in snap:
                    for n in snap[slot]:
                        assert torch.equal(now[slot][n], snap[slot][n]), (slot, n)
        out = _run(comps, first if t < 2 else second, grads)
        for n in out:
            applied[n] += world * out[n].double()
    if not momentum:
        held = _held(comps)
        for n, _ in PARAMS:
            err = (applied[n] + held.get(n, 0) - produced[n]).abs().max().item()
            assert err < 0.05, (n, err)


@SETTINGS
@given(
    world=st.integers(1, 3),
    order=st.permutations(range(len(PARAMS))),
    seed=st.integers(0, 2**16),
    momentum=st.booleans(),
)
def test_state_dict_round_trip_resumes_exactly(world, order, seed, momentum):
    """Save after a rebuilt layout, load into fresh compressors that start from the FIRST layout
    again
    (a resumed DDP), and both continue identically once on the same layout."""
    cfg = CompressionConfig(**CFG, momentum_correction=momentum)
    comps = make_ranks(cfg, world)
    first = _buckets(list(reversed(range(len(PARAMS)))), [])
    rebuilt = _buckets(order, [2, 4])
    _run(comps, first, _grads(world, seed))
    _run(comps, rebuilt, _grads(world, seed + 1))
    shards = []
    for c in comps:
        buf = io.BytesIO()
        torch.save(c.state_dict(), buf)
        buf.seek(0)
        shards.append(torch.load(buf))
    resumed = make_ranks(cfg, world)
    for c, sd in zip(resumed, shards):
        c.load_state_dict(sd)
    original = copy.deepcopy(comps)
    g = _grads(world, seed + 2)
    a = _run(original, first, g)
    b = _run(resumed, first, g)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert resumed[0].step == comps[0].step + 1


def _shards(world, seed):
    comps = make_ranks(CompressionConfig(**CFG), world)
    _run(comps, _buckets(range(len(PARAMS)), [3]), _grads(world, seed))
    return comps, [c.state_dict() for c in comps]


def test_gather_without_a_group_wraps_one_shard():
    comps, shards = _shards(1, 0)
    ckpt = gather_shards(shards[0])
    assert ckpt["world_size"] == 1 and len(ckpt["shards"]) == 1


def test_resize_redistribute_keeps_the_summed_residual_and_warns():
    comps, shards = _shards(3, 1)
    ckpt = {"world_size": 3, "shards": shards}
    total = _held(comps)
    new = make_ranks(CompressionConfig(**CFG), 2)
    with pytest.warns(RuntimeWarning, match="redistribute"):
        for r, c in enumerate(new):
            c.load_state_dict(shard_for_rank(ckpt, r, 2))
    again = _held(new)
    for n in total:
        torch.testing.assert_close(again[n], total[n], rtol=1e-6, atol=1e-6)


def test_resize_reset_and_error_policies():
    comps, shards = _shards(2, 2)
    ckpt = {"world_size": 2, "shards": shards}
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        shard_for_rank(ckpt, 0, 3, policy="error")
    c = make_compressor(CompressionConfig(**CFG), 3)
    with pytest.warns(RuntimeWarning, match="reset"):
        c.load_state_dict(shard_for_rank(ckpt, 0, 3, policy="reset"))
    assert c.memory.state_dict() == {}
    same = make_compressor(CompressionConfig(**CFG), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(shard_for_rank(ckpt, 1, 2))
    with pytest.raises(ValueError, match="world size"):
        make_compressor(CompressionConfig(**CFG), 3).load_state_dict(shards[0])


def test_loaded_state_with_a_changed_parameter_is_refused():
    comps, shards = _shards(1, 3)
    c = make_compressor(CompressionConfig(**CFG), 1)
    c.load_state_dict(shards[0])
    lay = Layout.from_shapes([("l1.weight", (16, 13))])
    with pytest.raises(ValueError, match="l1.weight"):
        drive_lockstep([c.reduce(torch.zeros(16 * 13), lay)])


def test_put_and_scale_reach_live_layouts_and_pending_names():
    """put() sets a slot where a parameter lives now (in that layout's loss-scaled units) or
    keeps it until a layout claims the name; scale_slot() multiplies both."""
    from gradientflow.compression.memory import ResidualMemory

    mem = ResidualMemory()
    live = Layout.from_shapes([("a", (2, 3)), ("b", (4,))])
    slots = mem.get(live, ("residual", "momentum"), torch.zeros(10), scale=8.0)
    slots["residual"].fill_(1.0)
    mem.put("momentum", {"b": torch.full((4,), 2.0), "c": torch.full((3,), 5.0)})
    assert torch.equal(slots["momentum"], torch.tensor([0.0] * 6 + [16.0] * 4))  # 2 x scale 8
    mem.scale_slot("momentum", 0.5)
    later = mem.get(Layout.from_shapes([("c", (3,))]), ("residual", "momentum"), torch.zeros(3))
    assert torch.equal(later["momentum"], torch.full((3,), 2.5))
    sd = mem.state_dict()
    assert torch.equal(sd["momentum"]["b"], torch.full((4,), 1.0))  # stored unscaled
    assert torch.equal(sd["residual"]["a"], torch.full((2, 3), 1.0 / 8))  # untouched
    with pytest.raises(ValueError, match="'b' has 3 elements but the parameter has 4"):
        mem.put("momentum", {"b": torch.zeros(3)})
