"""gradientflow.horovod against Horovod 0.28's documented semantics, on 2 CPU ranks.

Each rank body checks many calls (ranks start once per test); a failed assertion names its
rank through the harness. Expected values are computed from every rank's input, which each
rank can rebuild from the rank number alone.
"""
from __future__ import annotations

import itertools

import pytest
from hvd_common import session as _session

TIMEOUT = 150


def _raises(exc, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{fn.__name__}: expected {text!r} in {e!r}"
        return
    raise AssertionError(f"{fn.__name__}: did not raise {exc.__name__} ({text!r})")


# ------------------------------------------------------------------------------ rank bodies
def basics_body(rank, world):
    def body(hvd, torch):
        assert hvd.is_initialized()
        assert (hvd.rank(), hvd.size()) == (rank, world)
        # One host: every rank is local, one "node".
        assert (hvd.local_rank(), hvd.local_size()) == (rank, world)
        assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
        assert hvd.is_homogeneous()
        assert hvd.mpi_built() is False and hvd.gloo_built() is True
        assert hvd.nccl_built() == 0  # no GPU here
        assert hvd.global_process_set.ranks == list(range(world))
        assert hvd.global_process_set.size() == world
        assert hvd.global_process_set.rank() == rank
        hvd.init()  # a second init is a no-op
        assert hvd.size() == world
        return True

    return _session(body)


def allreduce_body(rank, world):
    def body(hvd, torch):
        ops = {hvd.Sum: lambda xs: sum(xs), hvd.Average: lambda xs: sum(xs) / len(xs),
               hvd.Min: lambda xs: torch.stack(xs).min(0).values,
               hvd.Max: lambda xs: torch.stack(xs).max(0).values,
               hvd.Product: lambda xs: torch.stack(xs).prod(0)}
        dtypes = [torch.float32, torch.float64, torch.int32, torch.int64]

        def value(r, dtype, dim):
            g = torch.Generator().manual_seed(10 * dim + r)
            return (torch.randint(-9, 10, (3,) * dim, generator=g)).to(dtype)

        for dtype, dim, op in itertools.product(dtypes, (1, 2, 3), ops):
            if op is hvd.Average and not dtype.is_floating_point:
                continue
            xs = [value(r, dtype, dim) for r in range(world)]
            want = ops[op](xs).to(dtype)
            mine = xs[rank].clone()
            tag = f"{dtype} dim {dim} {op.name}"
            out = hvd.allreduce(mine, op=op)
            assert torch.equal(mine, xs[rank]), f"{tag}: allreduce modified its input"
            torch.testing.assert_close(out, want, msg=tag)
            out = hvd.synchronize(hvd.allreduce_async(mine, op=op))
            torch.testing.assert_close(out, want, msg=tag + " async")
            ret = hvd.allreduce_(mine, op=op)
            assert ret is mine, f"{tag}: allreduce_ must return its input"
            torch.testing.assert_close(mine, want, msg=tag + " in place")
            mine = xs[rank].clone()
            h = hvd.allreduce_async_(mine, op=op)
            assert hvd.synchronize(h) is mine
            torch.testing.assert_close(mine, want, msg=tag + " async in place")
        # Integer Average: summed, then scaled in float64 and truncated (Horovod's rule).
        t = torch.tensor([rank + 2, -(rank + 2)], dtype=torch.int32)
        want = int(sum(range(2, world + 2)) / world)
        assert hvd.allreduce(t).tolist() == [want, -want]
        # Scale factors: prescale before the sum, postscale after (and after 1/size).
        x = torch.full((4,), float(rank + 1))
        total = sum(range(1, world + 1))
        out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        torch.testing.assert_close(out, torch.full((4,), float(total)))
        out = hvd.allreduce(x, prescale_factor=3.0)
        torch.testing.assert_close(out, torch.full((4,), 3.0 * total / world))
        # Deprecated `average`, and its clash with op.
        with pytest.warns(DeprecationWarning):
            out = hvd.allreduce(x, average=False)
        torch.testing.assert_close(out, torch.full((4,), float(total)))
        _raises(ValueError, "The op parameter supersedes average", hvd.allreduce, x,
                average=True, op=hvd.Sum)
        _raises(NotImplementedError, "Adasum is not offered", hvd.allreduce, x, op=hvd.Adasum)
        _raises(ValueError, "Tensor is required to be contiguous.", hvd.allreduce,
                torch.ones(4, 4).t())
        # FP16 compression: float16 on the wire, the caller's dtype back.
        y = torch.full((5,), 1.0 + rank / 1024, dtype=torch.float64)
        out = hvd.allreduce(y, compression=hvd.Compression.fp16, op=hvd.Sum)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, sum(torch.full((5,), 1.0 + r / 1024,
                                                       dtype=torch.float64)
                                            for r in range(world)), atol=4e-3, rtol=1e-3)
        _raises(ValueError, "compresses gradients only", hvd.allreduce, x,
                compression=hvd.Compression.csc)
        # Autograd: d(sum(allreduce_sum(x)))/dx = world on every rank.
        w = torch.ones(3, requires_grad=True)
        hvd.allreduce(w * (rank + 1), op=hvd.Sum).sum().backward()
        torch.testing.assert_close(w.grad, torch.full((3,), float(world * (rank + 1))))
        return True

    return _session(body)


def grouped_body(rank, world):
    def body(hvd, torch):
        xs = [torch.full((n,), float(rank + n)) for n in (1, 7, 300)]
        want = [torch.full((n,), sum(float(r + n) for r in range(world)) / world)
                for n in (1, 7, 300)]
        for got in (hvd.grouped_allreduce(xs),
                    hvd.synchronize(hvd.grouped_allreduce_async(xs))):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
        assert xs[0].item() == rank + 1, "grouped_allreduce modified its input"
        got = hvd.grouped_allreduce_(xs, op=hvd.Sum)
        assert all(g is x for g, x in zip(got, xs))
        for g, w in zip(xs, want):
            torch.testing.assert_close(g, w * world)
        ys = [torch.full((2,), float(rank)) for _ in range(3)]
        hvd.synchronize(hvd.grouped_allreduce_async_(ys, op=hvd.Max))
        assert all(y.tolist() == [world - 1.0] * 2 for y in ys)
        got = hvd.grouped_allreduce([torch.ones(2)], compression=hvd.Compression.fp16)
        torch.testing.assert_close(got[0], torch.ones(2))
        return True

    return _session(body)


def gather_body(rank, world):
    def body(hvd, torch):
        def rows(r):  # rank r holds r+1 rows of 3 columns
            return torch.arange((r + 1) * 3, dtype=torch.float32).view(r + 1, 3) + 100 * r

        want = torch.cat([rows(r) for r in range(world)])
        assert torch.equal(hvd.allgather(rows(rank)), want)
        assert torch.equal(hvd.synchronize(hvd.allgather_async(rows(rank))), want)
        got = hvd.grouped_allgather([rows(rank), torch.tensor([rank])])
        assert torch.equal(got[0], want) and got[1].tolist() == list(range(world))
        got = hvd.synchronize(hvd.grouped_allgather_async([rows(rank)]))
        assert torch.equal(got[0], want)
        # Autograd (Horovod 0.28): the output's gradient is averaged, each rank keeps its rows.
        x = rows(rank).clone().requires_grad_(True)
        (hvd.allgather(x) * (rank + 1)).sum().backward()
        mean = sum(r + 1 for r in range(world)) / world
        torch.testing.assert_close(x.grad, torch.full_like(x, mean))
        # broadcast: every form, root 1 (a global rank).
        root = world - 1
        b = torch.full((2, 2), float(rank))
        out = hvd.broadcast(b, root_rank=root)
        assert out.tolist() == [[float(root)] * 2] * 2 and b[0, 0].item() == rank
        assert hvd.synchronize(hvd.broadcast_async(b, root)).eq(root).all()
        assert hvd.broadcast_(b, root) is b and b.eq(root).all()
        c = torch.tensor([rank])
        assert hvd.synchronize(hvd.broadcast_async_(c, 0)) is c and c.item() == 0
        _raises(ValueError, "root_rank=7 is not a rank", hvd.broadcast, b, 7)
        x = torch.ones(2, requires_grad=True)
        hvd.broadcast(x * 1.0, root_rank=0).sum().backward()
        assert x.grad.tolist() == ([1.0, 1.0] if rank == 0 else [0.0, 0.0])
        # objects
        obj = hvd.broadcast_object({"rank": rank, "f": lambda v: v + rank}, root_rank=root)
        assert obj["rank"] == root and obj["f"](1) == 1 + root
        assert hvd.allgather_object(("r", rank)) == [("r", r) for r in range(world)]
        return True

    return _session(body)


def alltoall_body(rank, world):
    def body(hvd, torch):
        # Equal splits: rank r sends rows [2i, 2i+2) to rank i.
        x = torch.arange(2 * world, dtype=torch.float32) + 10 * rank
        want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * r
                          for r in range(world)])
        assert torch.equal(hvd.alltoall(x), want)
        out, recv = hvd.synchronize(hvd.alltoall_async(x))
        assert torch.equal(out, want) and recv.tolist() == [2] * world
        # Uneven splits: rank r sends i+r+1 rows to rank i, from a tensor with spare rows.
        splits = [i + rank + 1 for i in range(world)]
        x = torch.arange(sum(splits) + 2, dtype=torch.int64).view(-1, 1) + 1000 * rank
        out, recv = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32))
        assert recv.dtype == torch.int32 and recv.tolist() == [rank + r + 1
                                                               for r in range(world)]
        parts = []
        for r in range(world):
            theirs = [i + r + 1 for i in range(world)]
            first = sum(theirs[:rank])
            parts.append(torch.arange(first, first + theirs[rank]).view(-1, 1) + 1000 * r)
        assert torch.equal(out, torch.cat(parts))
        _raises(ValueError, "not an even multiple of the number of workers", hvd.alltoall,
                torch.ones(2 * world + 1))
        _raises(ValueError, "Number of entries in splits does not equal number of workers",
                hvd.alltoall, torch.ones(4), splits=[1] * (world + 1))
        _raises(ValueError, "Sum of splits entries is greater", hvd.alltoall, torch.ones(2),
                splits=[5] * world)
        # Autograd: the gradient goes back to where each row came from.
        x = torch.ones(2 * world, requires_grad=True)
        (hvd.alltoall(x * (rank + 1)) * (rank + 1)).sum().backward()
        torch.testing.assert_close(x.grad, torch.cat([torch.full((2,), float((i + 1) *
                                                                             (rank + 1)))
                                                      for i in range(world)]))
        return True

    return _session(body)


def reducescatter_body(rank, world):
    def body(hvd, torch):
        rows = 2 * world + 1  # uneven: rank 0 gets one row more (Horovod's cut)
        counts = [rows // world + (1 if i < rows % world else 0) for i in range(world)]
        start = sum(counts[:rank])

        def value(r):
            return torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * (r + 1)

        total = sum(value(r) for r in range(world))
        mine = total[start:start + counts[rank]]
        torch.testing.assert_close(hvd.reducescatter(value(rank)), mine / world)
        torch.testing.assert_close(hvd.reducescatter(value(rank), op=hvd.Sum), mine)
        torch.testing.assert_close(hvd.synchronize(hvd.reducescatter_async(value(rank))),
                                   mine / world)
        out = hvd.reducescatter(value(rank), op=hvd.Sum, prescale_factor=2.0,
                                postscale_factor=0.25)
        torch.testing.assert_close(out, mine * 0.5)
        got = hvd.grouped_reducescatter([value(rank), value(rank)], op=hvd.Sum)
        assert all(torch.equal(g, mine) for g in got)
        got = hvd.synchronize(hvd.grouped_reducescatter_async([value(rank)], op=hvd.Sum))
        torch.testing.assert_close(got[0], mine)
        _raises(ValueError, "Reducescatter currently only supports AVERAGE and SUM.",
                hvd.reducescatter, value(rank), op=hvd.Max)
        out = hvd.reducescatter(value(rank), compression=hvd.Compression.fp16)
        torch.testing.assert_close(out, mine / world, atol=0.05, rtol=1e-3)
        # Autograd (Horovod's rule): Average -> allgather of the gradient.
        x = value(rank).requires_grad_(True)
        hvd.reducescatter(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.ones_like(x))
        return True

    return _session(body)


def control_body(rank, world):
    def body(hvd, torch):
        import time

        h = hvd.allreduce_async(torch.ones(1000))
        deadline = time.monotonic() + 60
        while not hvd.poll(h):
            assert time.monotonic() < deadline, f"rank {rank}: poll never turned True"
        assert hvd.synchronize(h).eq(1).all()
        assert hvd.synchronize(h) is None, "a cleared handle synchronizes to None"
        _raises(ValueError, "was not created or has been cleared", hvd.poll, h)
        hvd.barrier()
        last = hvd.join()
        assert 0 <= last < world
        assert hvd.allgather_object(last) == [last] * world, "ranks disagree on join()"
        return True

    return _session(body)


def process_set_body(rank, world):
    def body(hvd, torch):
        last = hvd.ProcessSet([world - 1])
        _raises(ValueError, "Process set does not exist or has not been registered",
                hvd.allreduce, torch.ones(1), process_set=last)
        hvd.init(process_sets=[last])  # registers the set on an initialized job
        assert last.process_set_id is not None and last.size() == 1
        if rank == world - 1:
            assert last.included() and last.rank() == 0
            out = hvd.allreduce(torch.full((2,), 3.0), op=hvd.Sum, process_set=last)
            assert out.tolist() == [3.0, 3.0], "a one-rank set sums to the rank's own value"
            assert hvd.allgather(torch.tensor([rank]), process_set=last).tolist() == [rank]
            hvd.barrier(process_set=last)
        else:
            assert not last.included()
            _raises(ValueError, "is not a member of the provided process set",
                    hvd.allreduce, torch.ones(1), process_set=last)
        _raises(ValueError, "Attempted to add a duplicate process set", hvd.add_process_set,
                list(range(world)))
        assert hvd.remove_process_set(last) and last.process_set_id is None
        assert not hvd.remove_process_set(hvd.global_process_set)
        kept = hvd.add_process_set([0])  # still registered at shutdown, which destroys it
        hvd.shutdown()
        assert kept.process_set_id is None and not hvd.is_initialized()
        hvd.init()
        _raises(ValueError, "ProcessSet should be initialized with a list of process ranks",
                hvd.ProcessSet, ["a"])
        return True

    return _session(body)


def sync_bn_body(rank, world):
    def body(hvd, torch):
        torch.manual_seed(0)
        sizes = [4 + (r % 2) for r in range(world)]  # batches of different sizes
        full = torch.randn(sum(sizes), 3, 5)
        start = sum(sizes[:rank])
        mine = full[start:start + sizes[rank]].clone().requires_grad_(True)
        ref_in = full.clone().requires_grad_(True)
        sbn = hvd.SyncBatchNorm(3, momentum=0.3)
        ref = torch.nn.BatchNorm1d(3, momentum=0.3)
        with torch.no_grad():
            for m in (sbn, ref):
                m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
                m.bias.copy_(torch.tensor([0.0, -1.0, 1.0]))
        weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(1))
        out = sbn(mine)
        (out * weight[start:start + sizes[rank]]).sum().backward()
        ref_out = ref(ref_in)
        (ref_out * weight).sum().backward()
        torch.testing.assert_close(out, ref_out[start:start + sizes[rank]], atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(mine.grad, ref_in.grad[start:start + sizes[rank]],
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sbn.running_mean, ref.running_mean)
        torch.testing.assert_close(sbn.running_var, ref.running_var)
        # The affine gradients are per-rank sums: their allreduce is the reference's.
        torch.testing.assert_close(hvd.allreduce(sbn.weight.grad, op=hvd.Sum),
                                   ref.weight.grad, atol=1e-4, rtol=1e-4)
        sbn.eval()
        ref.eval()
        torch.testing.assert_close(sbn(full), ref(full))
        _raises(ValueError, "expected at least 2D input", sbn, torch.ones(3))
        return True

    return _session(body)


def functions_body(rank, world):
    def body(hvd, torch):
        torch.manual_seed(rank)  # different start on every rank
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        flat = torch.cat([t.flatten().float() for t in model.state_dict().values()])
        gathered = hvd.allgather(flat.view(1, -1))
        assert torch.equal(gathered[0], gathered[-1]), "parameters differ after broadcast"
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
        buf = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]
        bufs = hvd.allgather(buf.view(1, -1))
        assert torch.equal(bufs[0], bufs[-1]), "momentum differs after broadcast"
        hvd.broadcast_parameters(list(model.named_parameters()), root_rank=world - 1)
        _raises(ValueError, "invalid params of type", hvd.broadcast_parameters, 3, 0)
        return True

    return _session(body)


# ----------------------------------------------------------------------------------- tests
def test_not_initialized_errors():
    import gradientflow.horovod as hvd

    for fn in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
               hvd.cross_size):
        _raises(ValueError, "Horovod has not been initialized; use hvd.init().", fn)
    assert not hvd.is_initialized()
    _raises(NotImplementedError, "hvd.init(comm=...) is not offered", hvd.init, comm=[0])


def test_compression_contract():
    import torch

    import gradientflow.horovod as hvd

    x = torch.tensor([1.5, -2.25], dtype=torch.float64)
    payload, ctx = hvd.Compression.fp16.compress(x)
    assert payload.dtype == torch.float16
    assert torch.equal(hvd.Compression.fp16.decompress(payload, ctx), x)
    i = torch.tensor([3])
    assert hvd.Compression.fp16.compress(i)[0] is i
    assert hvd.Compression.none.compress(x) == (x, None)
    custom = hvd.Compression.csc.configure(density=0.05)
    assert custom.config().density == 0.05 and hvd.Compression.csc.options == {}
    with pytest.raises(ValueError):
        hvd.Compression.csc.configure(density=2.0)
    # Every registered gradientflow method is Compression.<name>, configured by its own options.
    psgd = hvd.Compression.powersgd.configure(rank=2)
    assert psgd.config().rank == 2 and psgd.config().method == "powersgd"
    assert hvd.Compression.powersgd is hvd.Compression.powersgd
    with pytest.raises(ValueError, match="method 'powersgd' has no option 'density'"):
        hvd.Compression.powersgd.configure(density=0.1)
    with pytest.raises(ValueError, match=r"Compression.powersgd compresses gradients only"):
        hvd.Compression.powersgd.compress(x)
    with pytest.raises(AttributeError, match="has no 'topk'"):
        hvd.Compression.topk
    assert [int(op) for op in (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max,
                               hvd.Product)] == list(range(6))


@pytest.mark.parametrize("body", [basics_body, allreduce_body, grouped_body, gather_body,
                                  alltoall_body, reducescatter_body, control_body,
                                  process_set_body, sync_bn_body, functions_body])
def test_api_two_ranks(pools, body):
    assert pools(2).run(body, timeout=TIMEOUT) == [True, True]
