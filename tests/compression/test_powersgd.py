"""PowerSGD on the engine: against a pure-torch reference, exact at full rank, nothing lost,
checkpoints, and under DDP (several buckets) and the DistributedOptimizer on 2 ranks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from compression_helpers import SETTINGS, grads_for, make_ranks, step
from gradientflow.compression import CompressionConfig, Layout, make_compressor
from gradientflow.engine.stages import drive_lockstep

TIMEOUT_S = 120


# --- the reference ------------------------------------------------------------------------------
def _gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns by classical Gram-Schmidt (another basis of the span than QR's)."""
    out = p.clone()
    for j in range(out.shape[1]):
        col = out[:, j]
        for k in range(j):
            col -= (out[:, k] @ col) * out[:, k]
        col /= col.norm().clamp(min=1e-30)
    return out


def _matrix(shape, rank, rate):
    """(rows, cols, r) if a parameter of `shape` travels as factors, else None."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    rows = shape[0]
    cols = math.prod(shape) // rows
    r = min(rank, rows, cols)
    return (rows, cols, r) if (rows + cols) * r * rate < rows * cols else None


class Reference:
    """PowerSGD of Vogels et al. for N ranks at once, in float64, parameter by parameter."""

    def __init__(self, layout: Layout, world: int, rank: int, rate: float, first_q) -> None:
        self.layout, self.n, self.rank, self.rate = layout, world, rank, rate
        self.res = [torch.zeros(layout.numel, dtype=torch.float64) for _ in range(world)]
        self.q = {}
        self.first_q = first_q

    def step(self, grads: list[torch.Tensor]) -> torch.Tensor:
        n = self.n
        vs = [g.double() + e for g, e in zip(grads, self.res)]
        out = torch.zeros(self.layout.numel, dtype=torch.float64)
        for (name, s, e), shape in zip(self.layout.slices(), self.layout.shapes):
            mat = _matrix(shape, self.rank, self.rate)
            if mat is None:
                out[s:e] = sum(v[s:e] for v in vs) / n
                for v, res in zip(vs, self.res):
                    res[s:e] = 0.0
                continue
            rows, cols, r = mat
            ms = [v[s:e].view(rows, cols) for v in vs]
            q = self.q.get(name, self.first_q(name, cols, r))
            p = _gram_schmidt(sum(m @ q for m in ms) / n)
            q_i = [m.t() @ p for m in ms]
            q_avg = sum(q_i) / n
            out[s:e] = (p @ q_avg.t()).reshape(-1)
            for m, res in zip(ms, self.res):
                res[s:e] = (m - p @ q_avg.t()).reshape(-1)
            self.q[name] = q_avg
        return out


def _first_q(cfg):
    """The compressor's own first Q (drawn alike on every rank), for the reference."""
    from gradientflow.compression.powersgd import _Matrix

    def draw(name, cols, r):
        fresh = make_compressor(cfg, 1)
        return fresh._q_of(_Matrix(name, 0, 1, cols, r), torch.device("cpu")).double()
    return draw


@st.composite
def _layouts(draw):
    shapes = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["vector", "matrix", "conv"]))
        if kind == "vector":
            shapes.append((f"b{i}", (draw(st.integers(1, 20)),)))
        elif kind == "matrix":
            shapes.append((f"w{i}", (draw(st.integers(1, 24)), draw(st.integers(1, 24)))))
        else:
            shapes.append((f"c{i}", (draw(st.integers(1, 8)), draw(st.integers(1, 4)), 3, 3)))
    return Layout.from_shapes(shapes)


@SETTINGS
@given(layout=_layouts(), world=st.integers(1, 4), rank=st.integers(1, 5),
       rate=st.sampled_from([0.0, 2.0]), seed=st.integers(0, 2**16))
def test_matches_the_reference_and_loses_nothing(layout, world, rank, rate, seed):
    """Over 3 steps (warm start, error feedback): every rank's output is the reference's, the
    ranks agree bit for bit, and the residuals plus what was applied are what was produced."""
    cfg = CompressionConfig(method="powersgd", rank=rank, min_compression_rate=rate)
    comps = make_ranks(cfg, world)
    ref = Reference(layout, world, rank, rate, _first_q(cfg))
    produced = torch.zeros(layout.numel, dtype=torch.float64)
    applied = torch.zeros_like(produced)
    for t in range(3):
        grads = grads_for(world, layout.numel, seed + t)
        outs = step(comps, layout, grads)
        want = ref.step(grads)
        assert all(torch.equal(o, outs[0]) for o in outs)
        err = float((outs[0].double() - want).norm())
        assert err <= 1e-4 * (1.0 + float(want.norm())), (t, err, float(want.norm()))
        produced += sum(g.double() for g in grads)
        applied += world * outs[0].double()
    held = torch.zeros_like(produced)
    scale = float(sum(g.double().abs() for g in grads).sum()) + 1.0
    for c, ref_res in zip(comps, ref.res):
        mine = torch.zeros_like(produced)
        for name, t in c.state_dict()["memory"].get("residual", {}).items():
            i = layout.names.index(name)
            mine[layout.offsets[i]:layout.offsets[i] + layout.numels[i]] = t.reshape(-1).double()
        # each rank keeps what the applied average did not carry of its own M (the output
        # depends only on the ranks' sum, so this pins the split, not the training)
        assert float((mine - ref_res).abs().max()) <= 1e-4 * scale
        held += mine
    assert float((produced - applied - held).abs().max()) <= 1e-5 * scale


@SETTINGS
@given(layout=_layouts(), world=st.integers(1, 3), rank=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_local_work_done_ahead_gives_the_same_bits(layout, world, rank, seed):
    """`prepare` (the engine runs it while the batch's round is open) then `reduce_many` with
    what it returned is the plain `reduce`, bit for bit, outputs and residuals, step by step
    (the warm start and error feedback carried across)."""
    cfg = CompressionConfig(method="powersgd", rank=rank, min_compression_rate=0.0)
    plain, ahead = make_ranks(cfg, world), make_ranks(cfg, world)
    for t in range(3):
        grads = grads_for(world, layout.numel, seed + t)
        want = step(plain, layout, grads)
        flats = [g.clone() for g in grads]
        prepared = [c.prepare(f, layout) for c, f in zip(ahead, flats)]
        gens = [c.reduce_many([f], [layout], prepared=[p])
                for c, f, p in zip(ahead, flats, prepared)]
        outs = [r[0] for r in drive_lockstep(gens)]
        for c in ahead:
            c.end_step()
        assert all(torch.equal(o, w) for o, w in zip(outs, want)), t
        for a, b in zip(plain, ahead):
            ra = a.state_dict()["memory"].get("residual", {})
            rb = b.state_dict()["memory"].get("residual", {})
            assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exact_at_full_rank(world):
    """At a rank >= the smaller side of every matrix the output is the dense average."""
    layout = Layout.from_shapes([("a", (12, 8)), ("bias", (12,)), ("conv", (6, 3, 2, 2)),
                                 ("wide", (3, 40))])
    cfg = CompressionConfig(method="powersgd", rank=12, min_compression_rate=0)
    comps = make_ranks(cfg, world)
    for t in range(3):
        grads = grads_for(world, layout.numel, 50 + t)
        outs = step(comps, layout, grads)
        torch.testing.assert_close(outs[0], sum(grads) / world, rtol=1e-5, atol=1e-5)
    assert set(comps[0].state_dict()["powersgd_q"]) == {"a", "conv", "wide"}


def test_small_matrices_travel_dense_and_large_ones_as_factors():
    """A matrix whose factors would not save min_compression_rate x travels dense (the dense
    average exactly); a large one costs (rows + cols) x rank values on the wire."""
    small = Layout.from_shapes([("w", (8, 8)), ("b", (8,))])
    comps = make_ranks(CompressionConfig(method="powersgd", rank=4), 2)
    grads = grads_for(2, small.numel, 3)
    torch.testing.assert_close(step(comps, small, grads)[0], sum(grads) / 2, rtol=1e-6, atol=0)
    big = Layout.from_shapes([("w", (256, 128)), ("b", (256,))])
    comp = make_compressor(CompressionConfig(method="powersgd", rank=4), 1)
    step([comp], big, grads_for(1, big.numel, 4))
    assert comp.stats.as_dict()["last_step"]["wire_bytes"] == 4 * ((256 + 128) * 4 + 256)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_a_half_wire_keeps_its_rounding_in_the_residual(wire):
    """The factors cast to a half wire: what the cast lost waits in the residual, so what was
    applied plus what waits is what was produced, up to the rounding of the sum itself."""
    layout = Layout.from_shapes([("w", (64, 32)), ("b", (64,)), ("v", (16, 48))])
    comps = make_ranks(CompressionConfig(method="powersgd", rank=2, wire_dtype=wire), 3)
    produced = torch.zeros(layout.numel, dtype=torch.float64)
    applied = torch.zeros_like(produced)
    for t in range(4):
        grads = grads_for(3, layout.numel, 20 + t)
        out = step(comps, layout, grads)[0]
        assert bool(torch.isfinite(out).all())
        produced += sum(g.double() for g in grads)
        applied += 3 * out.double()
    held = sum(torch.cat([c.state_dict()["memory"]["residual"][n].reshape(-1)
                          for n in layout.names]).double() for c in comps)
    eps = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[wire]
    assert float((produced - applied - held).abs().max()) <= 2 * eps * float(produced.abs().max())


def test_options_are_checked_where_they_are_registered():
    with pytest.raises(ValueError, match=r"rank=0 must be an integer >= 1"):
        CompressionConfig(method="powersgd", rank=0)
    with pytest.raises(ValueError, match=r"min_compression_rate=-1"):
        CompressionConfig(method="powersgd", min_compression_rate=-1)
    with pytest.raises(ValueError, match=r"method 'powersgd' has no option 'density'"):
        CompressionConfig(method="powersgd", density=0.1)
    cfg = CompressionConfig(method="powersgd", rank=4)
    assert cfg.wire_dtype == "fp32" and cfg.rank == 4 and cfg.warm_start


def test_start_step_sends_dense_first():
    layout = Layout.from_shapes([("w", (64, 64))])
    comps = make_ranks(CompressionConfig(method="powersgd", rank=1, start_step=2), 2)
    for t in range(3):
        grads = grads_for(2, layout.numel, 10 + t)
        out = step(comps, layout, grads)[0]
        close = torch.allclose(out, sum(grads) / 2, rtol=1e-5, atol=1e-6)
        assert close == (t < 2), t


def test_checkpoint_resume_keeps_the_residual_and_the_warm_start(tmp_path):
    """A run saved after 3 steps and resumed in fresh compressors continues bit for bit."""
    layout = Layout.from_shapes([("w", (32, 24)), ("b", (32,)), ("v", (20, 30))])
    cfg = CompressionConfig(method="powersgd", rank=2)
    run = make_ranks(cfg, 2)
    for t in range(3):
        step(run, layout, grads_for(2, layout.numel, t))
    path = tmp_path / "state.pt"
    torch.save([c.state_dict() for c in run], path)
    resumed = make_ranks(cfg, 2)
    for c, s in zip(resumed, torch.load(path)):
        c.load_state_dict(s)
    assert all(float(s["memory"]["residual"]["w"].abs().sum()) > 0 for s in torch.load(path))
    for t in range(3, 5):
        grads = grads_for(2, layout.numel, t)
        assert torch.equal(step(run, layout, grads)[0], step(resumed, layout, grads)[0])


def test_a_non_finite_step_leaves_residual_and_q_as_they_were():
    layout = Layout.from_shapes([("w", (16, 16))])
    cfg = CompressionConfig(method="powersgd", rank=2, min_compression_rate=0)
    comps = make_ranks(cfg, 2)
    step(comps, layout, grads_for(2, layout.numel, 0))
    before = [c.state_dict() for c in comps]
    bad = grads_for(2, layout.numel, 1)
    bad[1][5] = math.inf
    outs = step(comps, layout, bad)
    assert all(not bool(torch.isfinite(o).all()) for o in outs)
    for c, b in zip(comps, before):
        after = c.state_dict()
        assert torch.equal(after["memory"]["residual"]["w"], b["memory"]["residual"]["w"])
        assert torch.equal(after["powersgd_q"]["w"], b["powersgd_q"]["w"])


# --- on 2 ranks: DDP with several buckets, the DistributedOptimizer, Horovod ---------------------
def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                               torch.nn.ReLU(), torch.nn.Linear(48, 10))


def ddp_buckets(rank, world):
    """Full rank under DDP (several buckets) equals plain DDP; at rank 1 the ranks agree."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.hooks as hooks

    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(4)]
    loss_fn = torch.nn.CrossEntropyLoss()
    plain, ours = DDP(_net(), bucket_cap_mb=0.005), DDP(_net(), bucket_cap_mb=0.005)
    full = CompressionConfig(method="powersgd", rank=64, min_compression_rate=0)
    state = hooks.CompressionState(None, full)
    state.bind_parameter_names(ours.module)
    buckets = set()

    def counting_hook(state, bucket):
        buckets.add(bucket.index())
        return hooks.compression_hook(state, bucket)

    ours.register_comm_hook(state, counting_hook)
    # Each bucket is its own op, sent when ready (Compressor.fuses_buckets), not one op for the
    # step's buckets closed by the last.
    batches, fuse = [], state._fuse
    state._fuse = lambda parts: (batches.append(len(parts)), fuse(parts))[1]
    for x, y in data:
        for m in (plain, ours):
            m.zero_grad()
            loss_fn(m(x), y).backward()
        for a, b in zip(plain.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    model = DDP(_net(), bucket_cap_mb=0.005)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    low = hooks.register(model, CompressionConfig(method="powersgd", rank=1), optimizer=opt)
    for x, y in data * 2:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(e, every[0]) for e in every)
    st = low.stats()
    # (DDP may rebuild its buckets after the first step: more ops than steps, each of one.)
    assert set(batches) == {1} and len(batches) > len(data), (
        f"rank {rank}: a step's buckets were fused: {batches}")
    return {"steps": state.stats()["steps"], "ratio": st["average"]["ratio"],
            "buckets": len(buckets),
            "finite": bool(torch.isfinite(flat).all())}


def test_ddp_with_several_buckets_on_gradientflow(pools):
    for out in pools(2).run(ddp_buckets, backend="gradientflow", timeout=TIMEOUT_S):
        assert out["buckets"] >= 2 and out["steps"] == 4, out
        assert out["finite"] and out["ratio"] > 3, out


def optimizer_full_rank(rank, world):
    """gradientflow.optim and hvd.DistributedOptimizer with PowerSGD at full rank step as SGD
    on the average gradient."""
    import gradientflow.horovod as hvd
    import gradientflow.optim as gfo

    hvd.init()  # on the task's group
    try:
        return _full_rank_runs(rank, world, hvd, gfo)
    finally:
        hvd.shutdown()


def _full_rank_runs(rank, world, hvd, gfo):
    import copy

    worst = {}
    for api in ("optim", "horovod"):
        model = _net()
        ref = copy.deepcopy(model)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if api == "optim":
            opt = gfo.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(),
                compression=CompressionConfig(method="powersgd", rank=64, min_compression_rate=0))
        else:
            opt = hvd.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(),
                compression=hvd.Compression.powersgd.configure(rank=64, min_compression_rate=0))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        w = 0.0
        for t in range(3):
            batches = []
            for r in range(world):
                g = torch.Generator().manual_seed(100 * t + r)
                batches.append((torch.randn(8, 32, generator=g),
                                torch.randint(0, 10, (8,), generator=g)))
            opt.zero_grad()
            ref_opt.zero_grad()
            loss_fn(model(batches[rank][0]), batches[rank][1]).backward()
            loss_fn(ref(torch.cat([b[0] for b in batches])),
                    torch.cat([b[1] for b in batches])).backward()
            opt.step()
            ref_opt.step()
            w = max(w, max(float((p - q).detach().abs().max())
                           for p, q in zip(model.parameters(), ref.parameters())))
        worst[api] = w
        opt.close() if hasattr(opt, "close") else None
    return worst


def test_optimizer_and_horovod_at_full_rank_equal_sgd_on_the_average(pools):
    for rank, worst in enumerate(pools(2).run(optimizer_full_rank, backend="gradientflow",
                                              timeout=TIMEOUT_S)):
        assert all(w < 1e-5 for w in worst.values()), (rank, worst)


@SETTINGS
@given(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 4)), min_size=1,
                       max_size=6),
       repeat=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_batched_orthonormalisation_is_each_matrix_alone(shapes, repeat, seed):
    """orthonormalize_many (one batched QR per shape) gives each matrix orthonormal columns
    spanning what orthonormalize alone spans, in the input's order."""
    from gradientflow.compression.powersgd import orthonormalize, orthonormalize_many

    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(max(rows, r), r, generator=gen) for rows, r in shapes for _ in
          range(repeat)]
    got = orthonormalize_many(ps)
    assert len(got) == len(ps)
    for p, q in zip(ps, got):
        want = orthonormalize(p)
        assert q.shape == want.shape
        eye = torch.eye(q.shape[1])
        assert torch.allclose(q.t() @ q, eye, atol=1e-5)
        assert torch.allclose(q @ q.t(), want @ want.t(), atol=1e-5)
