"""gradientflow.horovod where a Horovod job's behaviour depends on more than the happy path.

Each test checks one of Horovod 0.28's documented behaviours on 2 CPU ranks: every dtype on
every collective, errors (never wrong data, a hang or an abort) when the ranks differ,
shutdown() then init() again, sparse allreduce and sparse gradients, the zero step of
broadcast_optimizer_state, poll() on every handle, splits of integers only, names, join.
Each rank builds every rank's input from the rank number, so it checks its result alone.
"""
from __future__ import annotations

import pytest

from harness import environ, free_port
from hvd_common import session as _session

TIMEOUT = 200
# Horovod's dtypes (ByteTensor ... DoubleTensor, HalfTensor).
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]




def _refused(fn, *args, **kwargs) -> str:
    """The RuntimeError `fn` raises (at the call or at synchronize); fails if none."""
    try:
        out = fn(*args, **kwargs)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)}: no error; returned {out!r}")


# ------------------------------------------------------------------------------ dtypes
def every_dtype_body(rank, world):
    def body(hvd, torch):
        done = []
        for name in DTYPES:
            dt = getattr(torch, name)

            def value(r, rows=4, dt=dt):
                return (torch.arange(rows * 3).view(rows, 3) % 7 + r + 1).to(dt)

            xs = [value(r) for r in range(world)]
            exact = (lambda a, b: torch.equal(a, b)) if not dt.is_floating_point else (
                lambda a, b: torch.equal(a.double(), b.double()))
            total = sum(x.double() for x in xs).to(dt)  # small integers: exact in every dtype
            assert exact(hvd.allreduce(xs[rank], op=hvd.Sum), total), (name, "allreduce")
            got = hvd.allgather(value(rank, rows=rank + 1))
            assert exact(got, torch.cat([value(r, rows=r + 1) for r in range(world)])), (
                name, "allgather")
            assert exact(hvd.broadcast(xs[rank], root_rank=1), xs[1]), (name, "broadcast")
            out = hvd.alltoall(xs[rank])  # 4 rows: 2 to each rank
            want = torch.cat([x[2 * rank:2 * rank + 2] for x in xs])
            assert exact(out, want), (name, "alltoall")
            mine = hvd.reducescatter(xs[rank], op=hvd.Sum)
            assert exact(mine, total[2 * rank:2 * rank + 2]), (name, "reducescatter")
            done.append(name)
        return done

    return _session(body)


def test_every_horovod_dtype_on_every_collective(pools):
    assert pools(2).run(every_dtype_body, timeout=TIMEOUT)[0] == DTYPES


# ------------------------------------------------------------------------------ mismatches
def mismatch_body(rank, world):
    """Every rank differs in one thing per call: each call raises a RuntimeError on every
    rank (naming the tensor when it has a name), and the next call works."""
    def body(hvd, torch):
        other = torch.float32 if rank == 0 else torch.int32
        cases = {
            "allreduce shape": lambda: hvd.allreduce(torch.ones([17 + rank] * 3), name="x"),
            "allreduce dims": lambda: hvd.allreduce(
                torch.ones(17, 23 * 57) if rank == 0 else torch.ones(17, 23, 57)),
            "allreduce dtype": lambda: hvd.allreduce(torch.ones(17, dtype=other)),
            "allreduce op": lambda: hvd.allreduce(torch.ones(5),
                                                  op=hvd.Sum if rank == 0 else hvd.Max),
            "allgather dims": lambda: hvd.allgather(torch.ones(4, 10 * (rank + 1), 3)),
            "allgather dtype": lambda: hvd.allgather(torch.ones(4, 3, dtype=other)),
            "broadcast root": lambda: hvd.broadcast(torch.ones(4), root_rank=rank),
            "broadcast dims": lambda: hvd.broadcast(torch.ones(4, 2 + rank), root_rank=0),
            "broadcast dtype": lambda: hvd.broadcast(torch.ones(4, dtype=other), root_rank=0),
            "alltoall dtype": lambda: hvd.alltoall(torch.ones(world, dtype=other)),
            "alltoall dims": lambda: hvd.alltoall(torch.ones(2 * world, 10 * (rank + 1))),
            "reducescatter dims": lambda: hvd.reducescatter(
                torch.ones(17, 23 * 57) if rank == 0 else torch.ones(17, 23, 57)),
            "reducescatter dtype": lambda: hvd.reducescatter(torch.ones(4, 3, dtype=other),
                                                             op=hvd.Sum),
            "grouped allreduce": lambda: hvd.grouped_allreduce(
                [torch.ones(3), torch.ones(3 + rank)], op=hvd.Sum),
        }
        msgs = {}
        for case, call in cases.items():
            msgs[case] = _refused(call)
            # The group is usable right after the refusal: nothing was sent.
            ok = hvd.allreduce(torch.ones(3), op=hvd.Sum)
            assert ok.tolist() == [world] * 3, (case, ok)
        return msgs

    return _session(body)


def test_mismatches_raise_on_every_rank_and_leave_the_job_usable(pools):
    results = pools(2).run(mismatch_body, timeout=TIMEOUT)
    for rank, msgs in enumerate(results):
        for case, msg in msgs.items():
            assert "collective mismatch" in msg, (rank, case, msg)
            assert "rank 0" in msg and "rank 1" in msg, (rank, case, msg)
        assert "'x'" in msgs["allreduce shape"], msgs["allreduce shape"]
        assert "(17, 1311)" in msgs["allreduce dims"] and "(17, 23, 57)" in msgs[
            "allreduce dims"], msgs["allreduce dims"]
        assert "root 0" in msgs["broadcast root"] and "root 1" in msgs["broadcast root"]
        assert "SUM" in msgs["allreduce op"] and "MAX" in msgs["allreduce op"]
        assert "int32" in msgs["alltoall dtype"] and "float32" in msgs["alltoall dtype"]


# ------------------------------------------------------------------------------ init again
def reinit_body(rank, world, port):
    import torch
    import torch.distributed as dist

    import gradientflow.horovod as hvd

    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    with environ(env):
        for i in range(3):
            hvd.init()
            assert (hvd.rank(), hvd.size()) == (rank, world)
            out = hvd.allreduce(torch.full((3,), float(rank + i)), op=hvd.Sum)
            assert out.tolist() == [float(sum(range(world)) + world * i)] * 3, (i, out)
            hvd.shutdown()
            assert not hvd.is_initialized()
        for i in range(2):
            dist.init_process_group("gradientflow")
            t = torch.ones(2) * (i + 1)
            dist.all_reduce(t)
            assert t.tolist() == [2.0 * world * (i + 1) / 2] * 2, (i, t)
            dist.destroy_process_group()
    return True


def test_shutdown_then_init_again_any_number_of_times(pools):
    port = free_port()
    assert pools(2).run(reinit_body, port, backend=None, timeout=TIMEOUT) == [True, True]


# ------------------------------------------------------------------------------ sparse
def sparse_body(rank, world):
    def body(hvd, torch):
        g = torch.Generator().manual_seed(5)
        dense = [torch.rand(20, 4, generator=g) for r in range(world)]
        for d in dense:
            d[d < 0.7] = 0  # a different number of entries on each rank
        for op, scale in ((hvd.Average, 1.0 / world), (hvd.Sum, 1.0)):
            handle = hvd.sparse_allreduce_async(dense[rank].to_sparse(), name=f"s{op}", op=op)
            out = handle()
            assert out.is_sparse
            torch.testing.assert_close(out.to_dense(), sum(dense) * scale)
        # Sparse gradients: averaged, and sparse again for the optimizer, with or without
        # sparse_as_dense (SparseAdam takes sparse gradients only).
        for as_dense in (False, True):
            emb = torch.nn.Embedding(10, 3, sparse=True)
            hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
            idx = [torch.tensor([1, 2, 4, 5, 4]), torch.tensor([1, 3, 4, 7])]
            opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters())),
                                           sparse_as_dense=as_dense)
            opt.zero_grad()
            emb(idx[rank]).sum().backward()
            opt.synchronize()
            grad = emb.weight.grad
            assert grad is not None and grad.is_sparse, (as_dense, grad)
            want = torch.zeros(10, 3)
            for r in range(world):
                for i in idx[r].tolist():
                    want[i] += 1.0 / world
            torch.testing.assert_close(grad.to_dense(), want)
            with opt.skip_synchronize():
                opt.step()
        return True

    return _session(body)


def test_sparse_allreduce_and_sparse_gradients(pools):
    assert pools(2).run(sparse_body, timeout=TIMEOUT) == [True, True]


# ------------------------------------------------------------------------------ helpers
def optimizer_state_body(rank, world):
    def body(hvd, torch):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        opt = torch.optim.SGD([*model.parameters(), frozen], lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        # Horovod's zero step: a zero gradient where one is required, state made.
        for p in model.parameters():
            assert p.grad is not None and not p.grad.any(), p.grad
        assert frozen.grad is None
        assert len(opt.state_dict()["state"]) == 2
        got = hvd.broadcast(model[0].weight.grad, root_rank=0)
        assert torch.equal(got, model[0].weight.grad)
        # The states agree: they are root's.
        flat = torch.cat([s["momentum_buffer"].reshape(-1)
                          for s in opt.state_dict()["state"].values()])
        assert torch.equal(hvd.broadcast(flat, root_rank=0), flat)
        return True

    return _session(body)


def test_broadcast_optimizer_state_steps_a_new_optimizer_first(pools):
    assert pools(2).run(optimizer_state_body, timeout=TIMEOUT) == [True, True]


# ------------------------------------------------------------------------------ handles
def handles_body(rank, world):
    def body(hvd, torch):
        t = torch.ones(4, 2)
        starts = {
            "allreduce": lambda: hvd.allreduce_async(t),
            "grouped_allreduce": lambda: hvd.grouped_allreduce_async([t, t]),
            "allgather": lambda: hvd.allgather_async(t),
            "grouped_allgather": lambda: hvd.grouped_allgather_async([t, t]),
            "broadcast": lambda: hvd.broadcast_async(t, root_rank=0),
            "alltoall": lambda: hvd.alltoall_async(t),
            "reducescatter": lambda: hvd.reducescatter_async(t),
            "grouped_reducescatter": lambda: hvd.grouped_reducescatter_async([t, t]),
        }
        for op, start in starts.items():
            h = start()
            assert hvd.poll(h) in (True, False), op
            assert hvd.synchronize(h) is not None, op
            with pytest.raises(ValueError):
                hvd.poll(h)  # cleared by synchronize
        # splits: whole numbers only, as Horovod's int32 tensor.
        x = torch.arange(4.0)
        for bad in (torch.ones(world, dtype=torch.float32), [2.0] * world, [True] * world):
            with pytest.raises(ValueError, match="splits"):
                hvd.alltoall(x, splits=bad)
        for good in (torch.full((world,), 2, dtype=torch.int32), [2] * world,
                     torch.full((world,), 2, dtype=torch.int64)):
            out, received = hvd.alltoall(x, splits=good)
            assert received.dtype == torch.int32 and received.tolist() == [2] * world
        return True

    return _session(body)


def test_poll_on_every_handle_and_integer_splits(pools):
    assert pools(2).run(handles_body, timeout=TIMEOUT) == [True, True]


def names_body(rank, world):
    def body(hvd, torch):
        import torch.distributed as dist

        side = dist.new_group(backend="gloo")  # orders the ranks without a Horovod collective
        t = torch.ones(3)
        if rank == 0:
            # Rank 1 issues it only after the side barrier, so it cannot have finished: the
            # name is in use, on every op.
            first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
            with pytest.raises(ValueError, match="'dup'"):
                hvd.allreduce_async(t, name="dup")
            with pytest.raises(ValueError, match="'dup'"):
                hvd.broadcast_async(t, root_rank=0, name="dup")
            dist.barrier(group=side)
        else:
            dist.barrier(group=side)
            first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        assert hvd.synchronize(first).tolist() == [world] * 3
        # Synchronized: the name is free again.
        again = hvd.synchronize(hvd.allreduce_async(t, name="dup", op=hvd.Sum))
        assert again.tolist() == [world] * 3
        dist.destroy_process_group(side)
        return True

    return _session(body)


def test_a_name_in_use_is_refused(pools):
    assert pools(2).run(names_body, timeout=TIMEOUT) == [True, True]


def join_body(rank, world):
    def body(hvd, torch):
        msgs = []
        if rank == 0:
            last = hvd.join()
        else:
            # Rank 0 has joined: a collective it takes no part in is refused here.
            msgs.append(_refused(hvd.allgather, torch.ones(3, 2)))
            msgs.append(_refused(hvd.broadcast, torch.ones(3), root_rank=1))
            last = hvd.join()
        assert last == 1, last
        return msgs

    return _session(body)


def test_join_refuses_what_joined_ranks_take_no_part_in(pools):
    msgs = pools(2).run(join_body, timeout=TIMEOUT)
    assert msgs[0] == [] and len(msgs[1]) == 2, msgs
    assert all("collective mismatch" in m for m in msgs[1]), msgs[1]
