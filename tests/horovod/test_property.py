"""Hypothesis properties of gradientflow.horovod: collectives vs a local reference, on 2 ranks.

Each rank runs the same derandomized examples (agreed by an allgather of the example); an
example's seed builds every rank's input (row counts and splits included), so each rank
computes the reference alone. Also the compressor contract, in one process.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
FORMS = ["sync", "async", "inplace", "async_inplace"]


def _rows(seed, r, lo=0, hi=4):
    import random

    return random.Random(seed * 7 + r).randint(lo, hi)


def _splits(seed, r, world):
    import random

    rng = random.Random(seed * 11 + r)
    return [rng.randint(0, 3) for _ in range(world)]


def _data(torch, seed, r, rows, cols, dtype):
    g = torch.Generator().manual_seed(seed * 131 + r)
    return torch.randint(-20, 21, (rows, cols), generator=g).to(dtype)


def hvd_property(rank, world, n_examples):
    """Rank body: random collectives in random forms, each against the reference."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase
    from hypothesis import given as hgiven
    from hypothesis import settings as hsettings
    from hypothesis import strategies as hst

    import gradientflow.horovod as hvd

    hvd.init()
    ran = []

    @hsettings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
               phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @hgiven(seed=hst.integers(0, 2**30), kind=hst.sampled_from(KINDS),
            form=hst.sampled_from(FORMS), cols=hst.integers(1, 5),
            dtype=hst.sampled_from(["float32", "float64", "int32", "int64"]),
            op=hst.sampled_from(["Sum", "Average", "Min", "Max", "Product"]),
            root=hst.integers(0, 7), scale=hst.sampled_from([1.0, 0.5, 2.0]))
    def prop(seed, kind, form, cols, dtype, op, root, scale):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, kind, form, cols, dtype, op, root, scale))
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        dt = getattr(torch, dtype)
        hop = getattr(hvd, op)
        if not dt.is_floating_point:
            scale = 1.0  # integer scaling truncates: covered by the unit tests
            hop = hvd.Sum if hop is hvd.Average else hop
        tag = f"{kind}/{form}/{dtype}/{op}/seed {seed}"
        inplace = "inplace" in form
        asynch = "async" in form
        if kind == "allreduce":
            xs = [_data(torch, seed, r, 3, cols, dt) for r in range(world)]
            if hop is hvd.Product:
                xs = [x.clamp(-2, 2) for x in xs]
            st_ = torch.stack(xs)
            want = {hvd.Sum: st_.sum(0), hvd.Average: st_.sum(0) / world,
                    hvd.Min: st_.min(0).values, hvd.Max: st_.max(0).values,
                    hvd.Product: st_.prod(0)}[hop]
            if hop in (hvd.Sum, hvd.Average):
                want = want * scale * scale
            mine = xs[rank].clone()
            kw = dict(op=hop)
            if hop in (hvd.Sum, hvd.Average):
                kw.update(prescale_factor=scale, postscale_factor=scale)
            fn = {"sync": hvd.allreduce, "async": hvd.allreduce_async,
                  "inplace": hvd.allreduce_, "async_inplace": hvd.allreduce_async_}[form]
            got = fn(mine, **kw)
            got = hvd.synchronize(got) if asynch else got
            if inplace:
                assert got is mine, tag
            torch.testing.assert_close(got, want.to(dt), msg=tag)
        elif kind == "broadcast":
            root = root % world
            xs = [_data(torch, seed, r, 2, cols, dt) for r in range(world)]
            mine = xs[rank].clone()
            fn = {"sync": hvd.broadcast, "async": hvd.broadcast_async,
                  "inplace": hvd.broadcast_, "async_inplace": hvd.broadcast_async_}[form]
            got = fn(mine, root)
            got = hvd.synchronize(got) if asynch else got
            assert torch.equal(got, xs[root]), tag
            assert (got is mine) == inplace, tag
        elif kind == "allgather":
            xs = [_data(torch, seed, r, _rows(seed, r), cols, dt) for r in range(world)]
            got = (hvd.synchronize(hvd.allgather_async(xs[rank])) if asynch
                   else hvd.allgather(xs[rank]))
            assert torch.equal(got, torch.cat(xs)), tag
        elif kind == "alltoall":
            splits = [_splits(seed, r, world) for r in range(world)]
            xs = [_data(torch, seed, r, sum(splits[r]) + _rows(seed, r, 0, 2), cols, dt)
                  for r in range(world)]
            parts = []
            for r in range(world):
                first = sum(splits[r][:rank])
                parts.append(xs[r][first:first + splits[r][rank]])
            if asynch:
                got, recv = hvd.synchronize(hvd.alltoall_async(xs[rank], splits[rank]))
            else:
                got, recv = hvd.alltoall(xs[rank], splits=splits[rank])
            assert torch.equal(got, torch.cat(parts)), tag
            assert recv.tolist() == [splits[r][rank] for r in range(world)], tag
        else:  # reducescatter: Average and Sum only, as Horovod
            hop = hvd.Sum if hop not in (hvd.Sum, hvd.Average) else hop
            rows = _rows(seed, 0, world, 3 * world)
            xs = [_data(torch, seed, r, rows, cols, dt) for r in range(world)]
            total = torch.stack(xs).sum(0)
            if hop is hvd.Average:
                total = total / world
            counts = [rows // world + (1 if i < rows % world else 0) for i in range(world)]
            start = sum(counts[:rank])
            want = (total[start:start + counts[rank]] * scale * scale).to(dt)
            kw = dict(op=hop, prescale_factor=scale, postscale_factor=scale)
            got = (hvd.synchronize(hvd.reducescatter_async(xs[rank], **kw)) if asynch
                   else hvd.reducescatter(xs[rank], **kw))
            torch.testing.assert_close(got, want, msg=tag)
        ran.append(kind)

    try:
        prop()
    finally:
        hvd.shutdown()
    return sorted(set(ran))


def test_collectives_property_two_ranks(pools):
    kinds = pools(2).run(hvd_property, 30, timeout=240)
    assert kinds[0] == kinds[1] == sorted(KINDS), kinds


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-6e4, 6e4, allow_nan=False), min_size=1, max_size=20),
       dtype=st.sampled_from(["float32", "float64", "bfloat16", "int32"]))
def test_fp16_compressor_round_trip_is_a_cast(values, dtype):
    import torch

    import gradientflow.horovod as hvd

    dt = getattr(torch, dtype)
    x = torch.tensor(values, dtype=torch.float64).to(dt)
    payload, ctx = hvd.Compression.fp16.compress(x)
    back = hvd.Compression.fp16.decompress(payload, ctx)
    assert back.dtype == dt and back.shape == x.shape
    if dt.is_floating_point:
        assert payload.dtype == torch.float16
        assert torch.equal(back, x.to(torch.float16).to(dt))  # the reference: one cast each way
    else:
        assert payload is x and back is x
    none_payload, none_ctx = hvd.Compression.none.compress(x)
    assert hvd.Compression.none.decompress(none_payload, none_ctx) is x
