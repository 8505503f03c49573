"""Strided views and sparse COO tensors: gradientflow accepts what gloo accepts, refuses what
gloo refuses, and writes correct results into the caller's views.

Every case runs on gloo and on gradientflow in the same pool of ranks. For each case the
result on a strided view must equal the result of the same call on contiguous tensors (the
semantics a view promises); refusals must match gloo's. Values differ per rank and per
element, so a result read from the wrong storage positions cannot pass.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

N = 4  # elements per view


def _cases():
    """name -> fn(torch, dist, rank, ws, make) -> result tensor; make(n, base, strided)."""

    def all_reduce(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        dist.all_reduce(v)
        return v

    def all_reduce_async(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        dist.all_reduce(v, async_op=True).wait()
        return v

    def all_reduce_future(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        dist.all_reduce(v, async_op=True).get_future().wait()
        return v

    def broadcast(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        dist.broadcast(v, 1)
        return v

    def reduce(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        dist.reduce(v, 0)
        return v if rank == 0 else torch.zeros(N)

    def all_gather_in(torch, dist, rank, ws, mk):
        out = [torch.zeros(N) for _ in range(ws)]
        dist.all_gather(out, mk(N, rank))
        return torch.cat(out)

    def all_gather_out(torch, dist, rank, ws, mk):
        out = [mk(N, 100 + r) for r in range(ws)]
        dist.all_gather(out, torch.arange(N, dtype=torch.float32) + 10 * rank)
        return torch.cat(out)

    def gather(torch, dist, rank, ws, mk):
        out = [mk(N, 50 + r) for r in range(ws)] if rank == 0 else None
        dist.gather(mk(N, rank), out, 0)
        return torch.cat(out) if rank == 0 else torch.zeros(N)

    def scatter(torch, dist, rank, ws, mk):
        v = mk(N, 100)
        ins = [mk(N, 10 * r + 1) for r in range(ws)] if rank == 0 else None
        dist.scatter(v, ins, 0)
        return v

    def reduce_scatter(torch, dist, rank, ws, mk):
        v = mk(N, 100)
        dist.reduce_scatter(v, [mk(N, 10 * r + rank) for r in range(ws)])
        return v

    def all_to_all(torch, dist, rank, ws, mk):
        outs = [mk(N, 100 + r) for r in range(ws)]
        dist.all_to_all(outs, [mk(N, 10 * r + rank) for r in range(ws)])
        return torch.cat(outs)

    def all_gather_into_tensor(torch, dist, rank, ws, mk):
        out = mk(N * ws, 100)
        dist.all_gather_into_tensor(out, mk(N, rank))
        return out

    def reduce_scatter_tensor(torch, dist, rank, ws, mk):
        out = mk(N, 100)
        dist.reduce_scatter_tensor(out, mk(N * ws, rank))
        return out

    def all_to_all_single_out(torch, dist, rank, ws, mk):
        out = mk(N * ws, 100)
        dist.all_to_all_single(out, torch.arange(N * ws, dtype=torch.float32) + 10 * rank)
        return out

    def all_to_all_single_in(torch, dist, rank, ws, mk):
        out = torch.zeros(N * ws)
        dist.all_to_all_single(out, mk(N * ws, rank))
        return out

    def send_recv(torch, dist, rank, ws, mk):
        v = mk(N, rank)
        if rank == 0:
            dist.send(v, 1)
        elif rank == 1:
            dist.recv(v, 0)
        return v

    def all_reduce_coalesced(torch, dist, rank, ws, mk):
        a, b = mk(N, rank), mk(N, 7 * rank)
        dist.all_reduce_coalesced([a, b])
        return torch.cat([a, b])

    return {f.__name__: f for f in (
        all_reduce, all_reduce_async, all_reduce_future, broadcast, reduce, all_gather_in,
        all_gather_out, gather, scatter, reduce_scatter, all_to_all, all_gather_into_tensor,
        reduce_scatter_tensor, all_to_all_single_out, all_to_all_single_in, send_recv,
        all_reduce_coalesced)}


def _run_cases(rank, ws):
    """On every rank: each case on contiguous tensors and on strided views."""
    import torch
    import torch.distributed as dist

    def make(strided):
        def mk(n, base):
            values = torch.arange(n, dtype=torch.float32) * 3 + 1000 * rank + base
            if not strided:
                return values.clone()
            storage = torch.full((n, 2), -7.0)  # stride 2: the view is every other element
            storage[:, 0] = values
            return storage[:, 0]
        return mk

    out = {}
    for name, case in _cases().items():
        row = {}
        for strided in (False, True):
            try:
                row[strided] = ("ok", case(torch, dist, rank, ws, make(strided)).tolist())
            except Exception as exc:  # noqa: BLE001 - compared with gloo's
                row[strided] = ("refused", type(exc).__name__, str(exc).splitlines()[0])
            dist.barrier()
        out[name] = row
    return out


def test_strided_views_match_gloo(pools):
    pool = pools(2)
    gloo = pool.run(_run_cases, backend="gloo")
    gf = pool.run(_run_cases, backend="gradientflow")
    problems = []
    for rank in range(2):
        for name, row in gf[rank].items():
            dense, view = row[False], row[True]
            g_view = gloo[rank][name][True]
            if dense[0] != "ok":
                problems.append(f"rank {rank} {name}: contiguous call failed: {dense}")
            elif (view[0] == "ok") != (g_view[0] == "ok"):
                problems.append(f"rank {rank} {name}: gradientflow {view[0]}, gloo {g_view[0]}"
                                f" ({view if view[0] != 'ok' else g_view})")
            elif view[0] == "ok" and view[1] != dense[1]:
                problems.append(f"rank {rank} {name}: view result {view[1]} != contiguous "
                                f"{dense[1]}")
            elif view[0] == "refused" and "contiguous" not in view[2]:
                problems.append(f"rank {rank} {name}: refusal does not say why: {view[2]}")
    assert not problems, "\n".join(problems)
    # The cases where gloo refuses really are refused (not a vacuous comparison).
    refused = sorted(n for n, row in gloo[0].items() if row[True][0] == "refused")
    assert refused == ["all_to_all_single_in", "send_recv"], refused


def _sparse(rank, ws):
    import torch
    import torch.distributed as dist

    i = torch.tensor([[rank, 3], [0, rank + 1]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0 + rank, 10.0]), (4, 4))
    dist.all_reduce(t)
    errors = []
    try:
        dist.all_reduce(t.clone(), op=dist.ReduceOp.MAX)
    except Exception as exc:  # noqa: BLE001
        errors.append(str(exc))
    return t.to_dense().tolist(), errors


def test_sparse_all_reduce_sums_like_gloo(pools):
    pool = pools(2)
    gloo = pool.run(_sparse, backend="gloo")
    gf = pool.run(_sparse, backend="gradientflow")
    assert [r[0] for r in gf] == [r[0] for r in gloo]
    assert gf[0][0][3][1] == 10.0 and gf[0][0][3][2] == 10.0 and gf[0][0][0][0] == 1.0
    assert all(e and "SUM" in e[0] for _, e in gf), gf
