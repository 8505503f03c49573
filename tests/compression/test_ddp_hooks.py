"""The hooks under real DDP on 2 gloo ranks: equal to plain DDP at density 1, many small buckets,
Join."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _worker(rank, world, init_file, result_dir, backend="gloo"):
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow  # noqa: F401 - registers the backend
    import gradientflow.hooks as hooks
    from gradientflow.compression import CompressionConfig

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        data = [
            (torch.randn(16, 256, generator=gen), torch.randint(0, 10, (16,), generator=gen))
            for _ in range(30)
        ]
        loss_fn = torch.nn.CrossEntropyLoss()

        # 1. Density 1 on an FP32 wire gives plain DDP's gradients (several buckets, across the
        # rebuild).
        plain = DDP(_model(), bucket_cap_mb=0.25)
        ours = DDP(_model(), bucket_cap_mb=0.25)
        cfg = CompressionConfig(
            method="csc",
            density=1.0,
            chunk_size=256,
            wire_dtype="fp32",
            dense_wire_dtype="fp32",
            warmup_densities=(),
            momentum_correction=False,
        )
        state = hooks.register(ours, cfg)
        for x, y in data[:3]:
            for m in (plain, ours):
                m.zero_grad()
                loss_fn(m(x), y).backward()
            for (name, a), b in zip(plain.module.named_parameters(), ours.module.parameters()):
                torch.testing.assert_close(
                    b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
                )
        assert state.stats()["steps"] == 3

        # 2. CSC at 5% with many small buckets over many steps: ranks stay identical, nothing
        # mismatches.
        model = DDP(_model(), bucket_cap_mb=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # the recipe: the optimizer's momentum moves over
        state = hooks.register(
            model, CompressionConfig(method="csc", density=0.05, warmup_densities=(),
                                     momentum_correction=True), optimizer=opt
        )
        # followed, not moved: the groups keep 0.9, the compressor applies it
        assert state.config.momentum == 0.9 and opt.param_groups[0]["momentum"] == 0.9
        for x, y in data[:20]:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        st = state.stats()
        assert st["steps"] == 20 and st["steady"]["ratio"] > 5, st

        # 3. Join: uneven inputs (rank r runs 4 + 2r steps), FP16 hook.
        model = DDP(_model(), bucket_cap_mb=0.25)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = hooks.register(model, CompressionConfig(method="fp16"))
        with Join([model]):
            for x, y in data[: 4 + 2 * rank]:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
        # the joined rank shadows the others' steps
        assert state.stats()["steps"] == 4 + 2 * (world - 1)
        shard = state.gather_state_dict()
        if rank == 0:
            assert shard["world_size"] == world and len(shard["shards"]) == world
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", "gradientflow"])
def test_hooks_under_ddp_on_two_ranks(backend):
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), tmp, backend),
                                 nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"DDP hook test did not finish within {TIMEOUT_S} s (a collective mismatch "
                        "hangs)"
                    )
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        assert sorted(f for f in os.listdir(tmp) if f.startswith("ok")) == ["ok0", "ok1"]
