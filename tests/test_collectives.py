"""Every collective of torch.distributed on the gradientflow backend vs a local reference.

Each rank runs the same derandomized Hypothesis examples; every example draws a seed from
which each rank can build every rank's input, so each rank computes the reference locally.
Integer results and data movement must be bit-exact; floating reductions match within a
tolerance, because the transport's summation order depends on where an element sits.
"""
from __future__ import annotations

import pytest

from harness import RankFailure

FLOATS = ["float32", "float64", "float16", "bfloat16"]
# int8 and int16 too: Horovod takes them on every collective, and gloo has no int16 kernel
# (backend/dtypes.py moves its bits and reduces it widened).
INTS = ["int32", "int64", "uint8", "int8", "int16"]
KINDS = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather",
         "scatter", "barrier", "p2p_ring", "all_gather_object"]


def _input(torch, seed, rank, dtype, shape):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype.is_floating_point:
        if dtype in (torch.float16, torch.bfloat16):
            # Small integers: every sum and product is exact in half precision.
            return torch.randint(-3, 4, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    hi = 4 if dtype == torch.uint8 else 50
    return torch.randint(0, hi, shape, generator=g).to(dtype)


def _reduce_ref(torch, xs, op_name):
    if op_name in ("SUM", "AVG"):
        acc = torch.stack([x.double() if x.is_floating_point() else x for x in xs]).sum(0)
        if op_name == "AVG":
            acc = acc / len(xs)
        return acc.to(xs[0].dtype)
    if op_name == "PRODUCT":
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = acc * x
        return acc
    if op_name == "MIN":
        return torch.stack(xs).min(0).values
    if op_name == "MAX":
        return torch.stack(xs).max(0).values
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = {"BAND": acc & x, "BOR": acc | x, "BXOR": acc ^ x}[op_name]
    return acc


def _close(torch, got, want, xs):
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    scale = torch.stack([x.double().abs() for x in xs]).sum(0) + 1.0
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(got.dtype, 1e-2)
    return bool(((got.double() - want.double()).abs() <= tol * scale).all())


def collectives_property(rank, world, n_examples):
    """Rank body: random collectives, each checked against the reference; all ranks agree."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    checked = []

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), kind=st.sampled_from(KINDS),
           dtype=st.sampled_from(FLOATS + INTS), n=st.integers(1, 40),
           op=st.sampled_from(["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]),
           async_op=st.booleans(), root=st.integers(0, 3))
    def prop(seed, kind, dtype, n, op, async_op, root):
        dt = getattr(torch, dtype)
        root = root % world
        # Agreement on the example itself: every rank must be running the same one.
        ids = [None] * world
        dist.all_gather_object(ids, (seed, kind, dtype, n, op, async_op, root))
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        if dt.is_floating_point and op in ("BAND", "BOR", "BXOR"):
            op = "SUM"
        if not dt.is_floating_point and op == "AVG":
            op = "MAX"
        if dt in (torch.float16, torch.bfloat16) and op == "PRODUCT":
            op = "MIN"
        xs = [_input(torch, seed, r, dt, (n,)) for r in range(world)]
        mine = xs[rank].clone()
        rop = getattr(dist.ReduceOp, op)

        def finish(work):
            if async_op and work is not None:
                work.wait()

        ok, detail = True, ""
        if kind == "all_reduce":
            finish(dist.all_reduce(mine, op=rop, async_op=async_op))
            ok = _close(torch, mine, _reduce_ref(torch, xs, op), xs)
        elif kind == "broadcast":
            finish(dist.broadcast(mine, src=root, async_op=async_op))
            ok = torch.equal(mine, xs[root])
        elif kind == "all_gather":
            out = [torch.empty_like(mine) for _ in range(world)]
            finish(dist.all_gather(out, mine, async_op=async_op))
            ok = all(torch.equal(o, x) for o, x in zip(out, xs))
        elif kind == "all_gather_into_tensor":
            out = torch.empty(n * world, dtype=dt)
            finish(dist.all_gather_into_tensor(out, mine, async_op=async_op))
            ok = torch.equal(out, torch.cat(xs))
        elif kind in ("reduce_scatter", "reduce_scatter_tensor"):
            if op in ("BAND", "BOR", "BXOR", "AVG", "PRODUCT"):
                op, rop = "SUM", dist.ReduceOp.SUM
            big = [_input(torch, seed, r, dt, (n * world,)) for r in range(world)]
            out = torch.empty(n, dtype=dt)
            if kind == "reduce_scatter":
                finish(dist.reduce_scatter(out, list(big[rank].chunk(world)), op=rop,
                                           async_op=async_op))
            else:
                finish(dist.reduce_scatter_tensor(out, big[rank], op=rop, async_op=async_op))
            parts = [b[rank * n:(rank + 1) * n] for b in big]
            ok = _close(torch, out, _reduce_ref(torch, parts, op), parts)
        elif kind == "all_to_all":
            ins = [_input(torch, seed + j, rank, dt, (n,)) for j in range(world)]
            out = [torch.empty(n, dtype=dt) for _ in range(world)]
            finish(dist.all_to_all(out, ins, async_op=async_op))
            ok = all(torch.equal(out[j], _input(torch, seed + rank, j, dt, (n,)))
                     for j in range(world))
        elif kind == "all_to_all_single":
            # Uneven splits: rank r sends (r + j) % 3 + 1 rows to rank j.
            def split(r, j):
                return (r + j + seed) % 3 + 1
            in_splits = [split(rank, j) for j in range(world)]
            out_splits = [split(j, rank) for j in range(world)]
            src = [_input(torch, seed, r, dt, (sum(split(r, j) for j in range(world)),))
                   for r in range(world)]
            out = torch.empty(sum(out_splits), dtype=dt)
            finish(dist.all_to_all_single(out, src[rank], out_splits, in_splits,
                                          async_op=async_op))
            want = []
            for j in range(world):
                off = sum(split(j, k) for k in range(rank))
                want.append(src[j][off:off + split(j, rank)])
            ok = torch.equal(out, torch.cat(want))
        elif kind == "reduce":
            finish(dist.reduce(mine, dst=root, op=rop, async_op=async_op))
            if rank == root:
                ok = _close(torch, mine, _reduce_ref(torch, xs, op), xs)
        elif kind == "gather":
            out = [torch.empty_like(mine) for _ in range(world)] if rank == root else None
            finish(dist.gather(mine, out, dst=root, async_op=async_op))
            if rank == root:
                ok = all(torch.equal(o, x) for o, x in zip(out, xs))
        elif kind == "scatter":
            out = torch.empty_like(mine)
            ins = [xs[j] for j in range(world)] if rank == root else None
            finish(dist.scatter(out, ins, src=root, async_op=async_op))
            ok = torch.equal(out, xs[rank])
        elif kind == "barrier":
            finish(dist.barrier(async_op=async_op))
        elif kind == "p2p_ring":
            recv = torch.empty_like(mine)
            ops = [dist.P2POp(dist.isend, mine, (rank + 1) % world),
                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            ok = torch.equal(recv, xs[(rank - 1) % world])
        elif kind == "all_gather_object":
            objs = [None] * world
            dist.all_gather_object(objs, {"rank": rank, "x": xs[rank].tolist()})
            ok = objs == [{"rank": r, "x": xs[r].tolist()} for r in range(world)]
        if not ok:
            detail = f"rank {rank}: {kind} {dtype} n={n} op={op} async={async_op} root={root}"
        flags = torch.tensor([1 if ok else 0])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        assert ok, detail
        assert flags.item() == 1, "another rank saw a wrong result (see its report)"
        checked.append(kind)

    prop()
    return sorted(set(checked))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_matches_reference(pools, world):
    examples = {2: 120, 3: 60, 4: 50}[world]
    kinds = pools(world).run(collectives_property, examples, timeout=300)
    assert len(kinds[0]) >= 10, kinds[0]  # most kinds were drawn


def dtypes_gloo_lacks(rank, world):
    """Rank body: the dtypes gloo has no kernel for, on every collective, exact."""
    import torch
    import torch.distributed as dist

    bits = {"uint16": 16, "uint32": 32, "uint64": 64}
    checked = []
    for name in ("int16", "uint16", "uint32", "uint64", "complex64", "complex128",
                 "float8_e4m3fn"):
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(7)
        raw = [torch.randint(0, 2**15, (6,), generator=g).to(torch.int64) + 2**14 * r
               for r in range(world)]

        def make(x, dt=dt, name=name):
            if dt.is_complex:
                return torch.complex(x.double(), -x.double()).to(dt)
            if name.startswith("float8"):
                return (x % 16).to(torch.uint8).view(dt)
            return x.to(dt)

        xs = [make(x) for x in raw]
        def same(a, b):  # bit-exact (float8 has no equality of its own)
            return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        out = xs[rank].clone()
        dist.broadcast(out, src=1)
        assert same(out, xs[1]), (name, "broadcast")
        outs = [torch.empty_like(xs[0]) for _ in range(world)]
        dist.all_gather(outs, xs[rank])
        assert all(same(o, x) for o, x in zip(outs, xs)), (name, "all_gather")
        flat = torch.empty(6 * world, dtype=dt)
        dist.all_to_all_single(flat, torch.cat([xs[rank]] * world))
        assert same(flat, torch.cat(xs)), (name, "all_to_all_single")
        if name in bits:  # reductions: modulo 2**bits, as a native integer sum wraps
            mod = 2 ** bits[name]
            for op, ref in (("SUM", lambda v: sum(v) % mod), ("MAX", lambda v: max(v)),
                            ("MIN", lambda v: min(v))):
                t = xs[rank].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                want = [ref([int(x[i]) % mod for x in raw]) for i in range(6)]
                got = [int(v) % mod for v in t.to(torch.int64).tolist()] if name != "uint64" \
                    else [int(v) % mod for v in t.view(torch.int64).tolist()]
                assert got == want, (name, op, got, want)
        checked.append(name)
    return checked


def test_dtypes_gloo_lacks_are_moved_and_reduced_exactly(pools):
    checked = pools(2).run(dtypes_gloo_lacks)
    assert len(checked[0]) == 7, checked


def every_work_has_a_future(rank, world):
    """Rank body: the Work of every collective has a future that completes with the result,
    also queued behind a deferred allreduce (the engine's queued path waits on futures)."""
    import torch
    import torch.distributed as dist

    done = []
    for queued in (False, True):
        pending = dist.all_reduce(torch.ones(3), async_op=True) if queued else None
        calls = {
            "reduce_scatter": lambda: dist.reduce_scatter(
                torch.empty(2), [torch.ones(2) * (r + 1) for r in range(world)], async_op=True),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
                torch.empty(2), torch.ones(2 * world), async_op=True),
            "all_gather": lambda: dist.all_gather([torch.empty(2) for _ in range(world)],
                                                  torch.ones(2), async_op=True),
            "broadcast": lambda: dist.broadcast(torch.ones(2), src=0, async_op=True),
            "barrier": lambda: dist.barrier(async_op=True),
        }
        for name, call in calls.items():
            work = call()
            work.get_future().wait()
            done.append((queued, name))
        if pending is not None:
            pending.wait()
    return done


def test_every_work_has_a_future(pools):
    done = pools(2).run(every_work_has_a_future)
    assert len(done[0]) == 10, done


def bad_inputs(rank, world):
    """Rank body: each bad call raises a clear error on the spot and leaves the group usable."""
    import torch
    import torch.distributed as dist

    cases = {
        "AVG on integers": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64),
                                                   op=dist.ReduceOp.AVG),
        "bitwise on floats": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
        # A strided all_reduce and a sparse SUM are accepted, as gloo accepts them
        # (tests/conformance/test_strided.py); a strided send and a sparse MAX are not.
        "non-contiguous": lambda: dist.send(torch.ones(4, 4).t(), (rank + 1) % world),
        "sparse": lambda: dist.all_reduce(torch.ones(3).to_sparse(), op=dist.ReduceOp.MAX),
        "list length": lambda: dist.all_gather([torch.ones(2)] * (world + 1), torch.ones(2)),
        "shape mismatch": lambda: dist.all_gather([torch.ones(3)] * world, torch.ones(2)),
        "bad root": lambda: dist.broadcast(torch.ones(2), src=world + 5),
        "uneven split": lambda: dist.all_to_all_single(torch.ones(world * 2 + 1),
                                                       torch.ones(world * 2 + 1)),
        "complex max": lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64),
                                               op=dist.ReduceOp.MAX),
        "float8 sum": lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn)),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            messages[name] = str(exc)
        else:
            raise AssertionError(f"{name}: no error")
    # The group still works after every refusal: nothing was sent.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [world, world]
    return messages


def test_bad_input_is_refused_clearly(pools):
    messages = pools(2).run(bad_inputs)[0]
    for name, msg in messages.items():
        if name in ("bad root", "uneven split", "list length", "complex max"):
            continue  # torch itself may refuse these first, also clearly
        assert "gradientflow: rank 0" in msg, (name, msg)
    assert "integer" in messages["AVG on integers"]
    assert "contiguous" in messages["non-contiguous"]
    assert "cannot be reduced" in messages["float8 sum"], messages["float8 sum"]


def raises_inside(rank, world):
    raise ValueError(f"boom on rank {rank}")


def test_harness_reports_failing_rank(pools):
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\]"):
        pools(2).run(raises_inside, backend=None)


def collective_before_init(rank, world):
    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401

    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


def test_collective_before_init_is_refused(pools):
    msg = pools(2).run(collective_before_init, backend=None)[0]
    assert "init" in msg.lower() or "default process group" in msg.lower(), msg
