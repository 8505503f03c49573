"""torch's own parallelism stack on 2 CPU ranks, on gloo and on gradientflow: same results.

Each rank body runs a real client from torch (FSDP2 with torch.distributed.checkpoint,
DTensor, functional collectives, ZeroRedundancyOptimizer, DDP with static_graph, Join and
torch.compile) once on each backend, in the same warm rank pool, and returns what it computed;
the test compares the two runs.
"""
from __future__ import annotations

import pytest
import torch

BACKENDS = ("gloo", "gradientflow")


def _on_both(pools, fn, *args, timeout: float = 240) -> dict:
    """fn's results by rank, on each backend."""
    return {b: pools(2).run(fn, *args, backend=b, timeout=timeout) for b in BACKENDS}


def _assert_same(runs: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """gradientflow's results equal gloo's on every rank: tensors within float tolerance,
    anything else exactly."""
    for rank, (want, got) in enumerate(zip(runs["gloo"], runs["gradientflow"])):
        _same(got, want, rtol, atol, f"rank {rank}")


def _same(got, want, rtol: float, atol: float, where: str) -> None:
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _same(got[k], want[k], rtol, atol, f"{where} {k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, rtol, atol, f"{where} [{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- the ops the stack calls
def stack_ops(rank, world):
    """Rank body: every process-group op FSDP2, DTensor and friends issue; their outputs."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    g = dist.group.WORLD
    x = torch.arange(6.0) * (rank + 1)
    out: dict = {}
    t = torch.empty(6 * world)
    dist.all_gather_into_tensor(t, x)
    out["all_gather_into_tensor"] = t
    t = torch.empty(6 // world)
    dist.reduce_scatter_tensor(t, x)
    out["reduce_scatter_tensor"] = t
    t = torch.empty(6 // world)
    dist.reduce_scatter_tensor(t, x, op=dist.ReduceOp.AVG)  # FSDP2's op for fp32 gradients
    out["reduce_scatter_tensor_avg"] = t
    ag, rs, ar = [torch.empty(6 * world), torch.empty(2 * world)], [
        torch.empty(6 // world), torch.empty(2 // world)], [x.clone(), x[:2].clone()]
    with dist._coalescing_manager(async_ops=True) as cm:  # allgather_into_tensor_coalesced
        dist.all_gather_into_tensor(ag[0], x)
        dist.all_gather_into_tensor(ag[1], x[:2].contiguous())
    cm.wait()
    with dist._coalescing_manager(async_ops=True) as cm:  # reduce_scatter_tensor_coalesced
        dist.reduce_scatter_tensor(rs[0], x)
        dist.reduce_scatter_tensor(rs[1], x[:2].contiguous())
    cm.wait()
    with dist._coalescing_manager(async_ops=True) as cm:  # allreduce_coalesced
        for a in ar:
            dist.all_reduce(a)
    cm.wait()
    out["coalesced"] = ag + rs + ar
    t = torch.empty(6)
    dist.all_to_all_single(t, x)  # alltoall_base
    out["all_to_all_single"] = t
    # Issued back to back, then waited: wait_tensor on each (a result pickled unwaited
    # could still be filling).
    out["functional"] = [fc.wait_tensor(t) for t in (
        fc.all_reduce(x, "sum", g), fc.all_gather_tensor(x, 0, g),
        fc.reduce_scatter_tensor(x, "sum", 0, g), fc.all_to_all_single(x, None, None, g),
        fc.broadcast(x, 1, g), *fc.all_reduce_coalesced([x, x[:2]], "sum", g),
        *fc.all_gather_into_tensor_coalesced([x, x[:2]], g),
        *fc.reduce_scatter_tensor_coalesced([x, x[:2]], "sum", [0, 0], g))]
    peer = (rank + 1) % world
    got = torch.empty(6)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                     dist.P2POp(dist.irecv, got, (rank - 1) % world)]):
        w.wait()
    out["batch_isend_irecv"] = got
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    box = [rank, "x"]
    dist.broadcast_object_list(box, src=1)
    mine = [None]
    dist.scatter_object_list(mine, [10, 11] if rank == 0 else None, src=0)
    out["objects"] = [objs, box, mine]
    return out


def test_stack_ops_equal_gloo(pools):
    _assert_same(_on_both(pools, stack_ops))


def bad_coalesced_calls(rank, world):
    """Rank body: malformed coalesced calls raise before anything is sent; the group goes on."""
    import torch.distributed as dist

    errors = []
    x = torch.ones(4)
    for form in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        try:
            with dist._coalescing_manager(async_ops=True) as cm:
                if form == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(torch.empty(4 * world), x)
                    dist.all_gather_into_tensor(torch.empty(3), x)  # too small
                else:
                    dist.reduce_scatter_tensor(torch.empty(4 // world), x)
                    dist.reduce_scatter_tensor(torch.empty(3), x)
            cm.wait()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(f"{type(exc).__name__}: {exc}")
    t = torch.ones(2)
    dist.all_reduce(t)  # still usable, and still in step on every rank
    return errors, t.tolist()


def test_bad_coalesced_calls_raise_a_sentence_and_leave_the_group_usable(pools):
    res = pools(2).run(bad_coalesced_calls, backend="gradientflow", timeout=120)
    for rank, (errors, after) in enumerate(res):
        assert after == [2.0, 2.0]
        assert len(errors) == 2, errors
        for err, op in zip(errors, ("all_gather_into_tensor_coalesced",
                                    "reduce_scatter_tensor_coalesced")):
            assert f"rank {rank}: {op}: pair 1" in err and "world_size (2)" in err, err


def all_to_all_composed(rank, world):
    """Rank body: all_to_all of lists as on a gloo that has none (torch 2.9): uneven parts,
    one of them a 2-D output, sync and async."""
    import torch.distributed as dist

    from gradientflow.backend import composed

    composed._gloo_alltoall = False
    try:
        sizes = [[1, 3], [2, 4]]  # sizes[src][dst]: what rank src sends to rank dst
        ins = [torch.full((sizes[rank][d],), 10.0 * rank + d) for d in range(world)]
        outs = [torch.empty(sizes[s][rank]) for s in range(world)]
        outs[1] = outs[1].view(-1, 1) if outs[1].numel() > 1 else outs[1]
        dist.all_to_all(outs, ins)
        again = [torch.empty_like(o) for o in outs]
        dist.all_to_all(again, ins, async_op=True).wait()
        return [o.reshape(-1).tolist() for o in outs], [o.reshape(-1).tolist() for o in again]
    finally:
        composed._gloo_alltoall = None


def test_all_to_all_of_lists_composed_where_gloo_has_none(pools):
    res = pools(2).run(all_to_all_composed, backend="gradientflow", timeout=120)
    sizes = [[1, 3], [2, 4]]
    for rank, (outs, again) in enumerate(res):
        want = [[10.0 * s + rank] * sizes[s][rank] for s in range(2)]
        assert outs == want and again == want, (rank, outs, again)


def group_helpers(rank, world):
    """Rank body: monitored_barrier (torch's before 2.14 refuses any group not named gloo) and
    pg._get_backend(device) on a gradientflow group, on every torch."""
    import datetime

    import torch.distributed as dist

    import gradientflow

    gradientflow.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    gradientflow.monitored_barrier(wait_all_ranks=True)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.name(), backend.supports_coalescing


def test_group_helpers_work_on_every_torch(pools):
    res = pools(2).run(group_helpers, backend="gradientflow", timeout=120)
    assert res == [("gradientflow", False)] * 2


# ---------------------------------------------------------------- FSDP2 + DCP
def fsdp2_dcp(rank, world, ckpt_dir):
    """Rank body: fully_shard + AdamW for 3 steps, a DCP save, a step, a load, the same step.

    Returns the parameters when saved, after the load, and after the step taken twice (before
    the load and after it: equal when the optimizer state came back too).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        _step(model, opt, rank, step)

    def full():
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    saved = full()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    _step(model, opt, rank, 3)
    first = full()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full()
    _step(model, opt, rank, 3)
    return {"saved": saved, "loaded": loaded, "first": first, "again": full()}


def test_fsdp2_adamw_and_checkpoint_round_trip_equal_gloo(pools, tmp_path):
    runs = {b: pools(2).run(fsdp2_dcp, str(tmp_path / b), backend=b, timeout=240)
            for b in BACKENDS}
    for b, res in runs.items():
        for r in res:  # the round trip itself, on each backend
            torch.testing.assert_close(r["loaded"], r["saved"], rtol=0, atol=0)
            torch.testing.assert_close(r["again"], r["first"], rtol=0, atol=0)
        torch.testing.assert_close(res[1]["saved"], res[0]["saved"], rtol=0, atol=0)
    _assert_same(runs)


# ---------------------------------------------------------------- DTensor
def dtensor_ops(rank, world):
    """Rank body: DTensor matmuls under each sharding, and redistributions between them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    out = {"reference": a @ b}
    rows = distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()])
    out["rowwise"] = rows.full_tensor()  # all-gather
    cols = distribute_tensor(a, mesh, [Replicate()]) @ distribute_tensor(b, mesh, [Shard(1)])
    out["colwise"] = cols.redistribute(mesh, [Replicate()]).to_local()
    inner = distribute_tensor(a, mesh, [Shard(1)]) @ distribute_tensor(b, mesh, [Shard(0)])
    out["partial"] = inner.placements[0].is_partial()
    out["partial_to_replicate"] = inner.redistribute(mesh, [Replicate()]).to_local()  # all-reduce
    out["partial_to_shard"] = inner.redistribute(mesh, [Shard(0)]).to_local()  # reduce-scatter
    out["shard0_to_shard1"] = rows.redistribute(mesh, [Shard(1)]).to_local()  # all-to-all
    return out


def test_dtensor_matmul_and_redistribution_equal_gloo(pools):
    runs = _on_both(pools, dtensor_ops)
    for rank, res in enumerate(runs["gradientflow"]):
        ref = res["reference"]
        assert res["partial"] is True
        for k in ("rowwise", "colwise", "partial_to_replicate"):
            torch.testing.assert_close(res[k], ref, msg=k)
        torch.testing.assert_close(res["partial_to_shard"], ref.chunk(2, 0)[rank])
        torch.testing.assert_close(res["shard0_to_shard1"], ref.chunk(2, 1)[rank])
    _assert_same(runs)


# ---------------------------------------------------------------- ZeRO, DDP
def zero_adamw(rank, world):
    """Rank body: DDP with ZeroRedundancyOptimizer(AdamW), 3 steps, the state consolidated."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=0.01)
    for step in range(3):
        _step(model, opt, rank, step)
    opt.consolidate_state_dict(to=0)
    steps = None
    if rank == 0:
        steps = sorted(float(s["step"]) for s in opt.state_dict()["state"].values())
    return _params(model), steps


def test_zero_redundancy_optimizer_equals_gloo(pools):
    runs = _on_both(pools, zero_adamw)
    assert runs["gradientflow"][0][1] == [3.0] * 6  # every parameter's state reached rank 0
    torch.testing.assert_close(runs["gradientflow"][1][0], runs["gradientflow"][0][0])
    _assert_same(runs)


def ddp_static_graph(rank, world):
    """Rank body: DDP(static_graph=True) with a parameter no step uses, 4 steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x)

    model = DDP(Branchy(), static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        _step(model, opt, rank, step)
    return _params(model)


def test_ddp_static_graph_equals_gloo(pools):
    _assert_same(_on_both(pools, ddp_static_graph))


def ddp_join(rank, world):
    """Rank body: DDP under Join, rank r with 2 + 2r batches (uneven inputs)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for step in range(2 + 2 * rank):
            _step(model, opt, rank, step)
    return _params(model)


def test_ddp_join_with_uneven_inputs_equals_gloo(pools):
    runs = _on_both(pools, ddp_join)
    torch.testing.assert_close(runs["gradientflow"][1], runs["gradientflow"][0])
    _assert_same(runs)


def ddp_compiled(rank, world):
    """Rank body: torch.compile over DDP (dynamo's DDP optimizer, graph breaks at bucket
    boundaries), 3 steps. backend="aot_eager": dynamo and AOT autograd as under inductor,
    without inductor's C++ compilation, which costs minutes on 2 shared cores."""
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = DDP(_mlp())
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        _step(compiled, opt, rank, step)
    return _params(model)


@pytest.mark.timeout(600)
def test_ddp_under_torch_compile_equals_gloo(pools):
    runs = _on_both(pools, ddp_compiled, timeout=300)
    torch.testing.assert_close(runs["gradientflow"][1], runs["gradientflow"][0])
    _assert_same(runs)
