"""DDP on gradientflow equals DDP on gloo; the CUDA dispatch; TORCH_DISTRIBUTED_DEBUG=DETAIL."""
from __future__ import annotations


def ddp_vs_gloo(rank, world, steps):
    """Rank body: the same model trained by DDP on gradientflow and on a gloo group."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 10))
    gloo = dist.new_group(backend="gloo")
    models = {"gradientflow": DDP(copy.deepcopy(base), bucket_cap_mb=0.01),
              "gloo": DDP(copy.deepcopy(base), process_group=gloo, bucket_cap_mb=0.01)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        grads = {}
        for k, m in models.items():
            opts[k].zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads[k] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
            opts[k].step()
        worst = max(worst, float((grads["gradientflow"] - grads["gloo"]).abs().max()))
    return worst


def test_ddp_gradients_equal_gloo(pools):
    worst = pools(2).run(ddp_vs_gloo, 5, timeout=200)
    assert max(worst) < 1e-5, worst


def test_cuda_transport_is_created_lazily_and_only_for_cuda():
    import datetime

    import torch

    from gradientflow.backend import transports as B

    calls = []

    def fake_gloo(*args):
        calls.append(("cpu", args[-1]))
        return object()

    def fake_nccl(*args):
        calls.append(("cuda", args[-1]))
        return object()

    saved = dict(B.Transports.factories)
    B.Transports.factories.update(gloo=fake_gloo, nccl=fake_nccl)
    try:
        tp = B.Transports(None, 0, 2, datetime.timedelta(seconds=5))
        assert calls == [("cpu", "gradientflow/cpu/")]  # gloo eagerly, NCCL not yet
        cpu = tp.get(torch.device("cpu"))
        assert tp.get(torch.device("cpu")) is cpu and tp.created() == ["cpu"]
        cuda = tp.get(torch.device("cuda", 0))
        assert calls[-1] == ("cuda", "gradientflow/cuda/")  # on first CUDA use, own prefix
        assert tp.get(torch.device("cuda", 1)) is cuda and len(calls) == 2  # created once
        # cuda_transport="gloo": CUDA tensors on a gloo group of their own (ranks may share a GPU)
        calls.clear()
        tp = B.Transports(None, 0, 2, datetime.timedelta(seconds=5), cuda_transport="gloo")
        tp.get(torch.device("cuda", 0))
        assert calls == [("cpu", "gradientflow/cpu/"), ("cpu", "gradientflow/cuda/")], calls
        assert B.Transports.factory("cuda", "gloo") is fake_gloo
    finally:
        B.Transports.factories.clear()
        B.Transports.factories.update(saved)


def detail_debug(rank, world, port):
    """Rank body: TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend and still works."""
    import os

    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401
    from gradientflow.backend import backend_of

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        dist.init_process_group("gradientflow", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        out = [torch.zeros(3) for _ in range(world)]
        dist.all_gather(out, t)
        ok = t.tolist() == [6.0] * 3 and backend_of() is not None
        from gradientflow.backend.backend import IS_PROCESS_GROUP

        # Before torch 2.14 the group is ours itself: torch wraps no per-device backend.
        pg = dist.group.WORLD
        wrapped = type(pg if IS_PROCESS_GROUP else pg._get_backend(torch.device("cpu"))).__name__
        return ok, wrapped
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        dist.set_debug_level_from_env()


def test_torch_distributed_debug_detail_works(pools):
    from harness import free_port

    res = pools(2).run(detail_debug, free_port(), backend=None, timeout=120)
    assert all(ok for ok, _ in res), res
