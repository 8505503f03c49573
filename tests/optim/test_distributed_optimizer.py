"""DistributedOptimizer vs DDP (dense FP32): gradients and weights equal over several steps.

Each rank body trains the same model twice from the same start, with DDP on a gloo group (the
reference) and with gradientflow's DistributedOptimizer, on rank-dependent data, and returns the
worst difference it saw. One pool run covers several configurations, to keep the group fast.
"""
from __future__ import annotations

import pytest

TOL = 1e-5


def _mlp(torch, widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(torch, step, micro, rank, width, n=6):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)


def _worst(torch, xs, ys):
    worst = 0.0
    for a, b in zip(xs, ys):
        if (a is None) != (b is None):
            return float("inf")
        if a is not None:
            worst = max(worst, float((a.detach() - b.detach()).abs().max()))
    return worst


def vs_ddp(rank, world, configs, steps=4, widths=(12, 40, 40, 1)):
    """Rank body: for each config, the worst grad/weight difference to DDP and the launch logs."""
    import copy
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.optim as gfo

    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, cfg in configs.items():
        cfg = dict(cfg)
        bpps = cfg.get("backward_passes_per_step", 1)
        clip = cfg.pop("clip", None)
        slow = cfg.pop("slow_rank", None)
        use_gloo = cfg.pop("gloo_group", False)
        set_to_none = cfg.pop("set_to_none", True)
        base = _mlp(torch, widths)
        ddp = DDP(copy.deepcopy(base), process_group=gloo, bucket_cap_mb=0.001)
        ref = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        model = copy.deepcopy(base)
        if slow is not None and rank == slow:
            # A rank whose backward is slower half-way: partitions become ready at other times
            # than on the other ranks, so the agreed sets differ from the local readiness.
            model[2].register_full_backward_pre_hook(lambda m, g: time.sleep(0.01))
        opt = gfo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
            named_parameters=model.named_parameters(),
            process_group=gloo if use_gloo else None, **cfg)
        worst_g = worst_w = 0.0
        logs = []
        for step in range(steps):
            ref.zero_grad(set_to_none=set_to_none)
            opt.zero_grad(set_to_none=set_to_none)
            for micro in range(bpps):
                x, y = _batch(torch, step, micro, rank, widths[0])
                out_model = model(x)  # next-forward overlap: this forward applies last step
                if step and micro == 0 and cfg.get("overlap_next_forward"):
                    logs.append(opt.launch_log)  # all of the last step waited for by now
                if step:
                    worst_w = max(worst_w, _worst(torch, [p for p in model.parameters()],
                                                  [p for p in ddp.parameters()]))
                loss = ((out_model - y) ** 2).mean()
                if micro < bpps - 1:
                    with ddp.no_sync():
                        ((ddp(x) - y) ** 2).mean().backward()
                else:
                    ((ddp(x) - y) ** 2).mean().backward()
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                worst_g = max(worst_g, _worst(torch, [p.grad for p in model.parameters()],
                                              [p.grad for p in ddp.parameters()]))
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
                if not cfg.get("overlap_next_forward"):
                    worst_g = max(worst_g, _worst(torch, [p.grad for p in model.parameters()],
                                                  [p.grad for p in ddp.parameters()]))
            ref.step()
            if not cfg.get("overlap_next_forward"):
                logs.append(opt.launch_log)
        opt.finish_updates()
        if cfg.get("overlap_next_forward"):
            logs.append(opt.launch_log)
        worst_w = max(worst_w, _worst(torch, list(model.parameters()), list(ddp.parameters())))
        out[name] = (worst_g, worst_w, logs)
        opt.close()
    return out


CONFIGS = {
    "priority": {"priority": True},
    "fifo": {},
    "one_partition": {"partition_bytes": 1 << 30},
    "tiny_partitions": {"partition_bytes": 256},
    "accumulate2": {"backward_passes_per_step": 2, "partition_bytes": 2048},
    "clip": {"clip": 0.05, "partition_bytes": 2048},
    "slow_rank": {"slow_rank": 1, "partition_bytes": 1024},
    "slow_rank_fifo": {"slow_rank": 0, "partition_bytes": 1024, "priority": False},
    "next_forward": {"overlap_next_forward": True, "partition_bytes": 2048},
    "next_forward_accumulate": {"overlap_next_forward": True, "backward_passes_per_step": 2,
                                "partition_bytes": 1024},
    "predivide": {"gradient_predivide_factor": 2.0, "partition_bytes": 4096},
    "gloo_fallback": {"gloo_group": True, "partition_bytes": 2048},
    # Gradients zeroed in place: they are views of the reused partition buffers by then.
    "zero_in_place": {"set_to_none": False, "partition_bytes": 2048},
    "zero_in_place_accumulate": {"set_to_none": False, "backward_passes_per_step": 2},
    "zero_in_place_next_forward": {"set_to_none": False, "overlap_next_forward": True},
}


def _check(results, configs, world):
    for name in configs:
        per_rank = [r[name] for r in results]
        for rank, (wg, ww, _) in enumerate(per_rank):
            assert wg <= TOL, (name, rank, "grad", wg)
            assert ww <= TOL, (name, rank, "weight", ww)
        logs = [r[2] for r in per_rank]
        assert all(log == logs[0] for log in logs), (name, logs)
        if not configs[name].get("gloo_group"):
            assert all(sorted(step) == sorted(set(step)) and step for step in logs[0]), name


@pytest.mark.parametrize("world", [2, 3])
def test_equals_ddp(pools, world):
    configs = CONFIGS if world == 2 else {k: CONFIGS[k] for k in
                                          ("priority", "fifo", "accumulate2", "clip",
                                           "slow_rank", "next_forward")}
    results = pools(world).run(vs_ddp, configs, timeout=150)
    _check(results, configs, world)


def issue_order(rank, world):
    """Rank body: partitions go out in backward's order whatever the priority setting."""
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (8, 16, 16, 16, 1))
    out = {}
    for prio in (True, False):
        for bpps in (1, 2):
            # bpps 2, one backward: no partition completes during backward, step() issues
            # them all; bpps 1: backward issues them as they complete.
            opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                           named_parameters=model.named_parameters(),
                                           partition_bytes=1, priority=prio,
                                           backward_passes_per_step=bpps)
            x, _ = _batch(torch, 0, 0, rank, 8)
            model(x).sum().backward()
            opt.step()
            out[prio, bpps] = (opt.launch_log, len(opt.plan))
            opt.zero_grad()
            opt.close()
    return out


def test_issue_order_is_backwards_on_every_rank(pools):
    # One ordered stream: every rank issues the same partitions in the same order, backward's;
    # priority acts among the partitions one round agrees (tests/test_fusion_plan.py).
    res = pools(2).run(issue_order, timeout=60)
    for log, n in res[0].values():
        assert log == list(reversed(range(n))), log
    assert res[0] == res[1]


def unused_and_frozen(rank, world, steps=3):
    """Rank body: a branch used only on rank 0, one never used, one frozen; vs DDP(find_unused)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.optim as gfo

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 8)
            self.frozen = torch.nn.Linear(8, 8)
            self.branch = torch.nn.Linear(8, 8)
            self.never = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)
            self.frozen.requires_grad_(False)

        def forward(self, x, use_branch):
            h = self.frozen(torch.tanh(self.a(x)))
            if use_branch:
                h = h + self.branch(h)
            return self.head(h)

    torch.manual_seed(0)
    base = Net()
    gloo = dist.new_group(backend="gloo")
    ddp = DDP(copy.deepcopy(base), process_group=gloo, find_unused_parameters=True)
    ref = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model = copy.deepcopy(base)
    opt = gfo.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                        momentum=0.9),
        named_parameters=model.named_parameters(), partition_bytes=300)
    worst = 0.0
    for step in range(steps):
        x, y = _batch(torch, step, 0, rank, 6)
        use = rank == 0
        ref.zero_grad()
        opt.zero_grad()
        ((ddp(x, use) - y) ** 2).mean().backward()
        ((model(x, use) - y) ** 2).mean().backward()
        ref.step()
        opt.step()
        worst = max(worst, _worst(torch, [p.grad for p in model.parameters()],
                                  [p.grad for p in ddp.parameters()]))
        worst = max(worst, _worst(torch, list(model.parameters()), list(ddp.parameters())))
    return worst, model.never.weight.grad is None, model.frozen.weight.grad is None


def test_unused_and_frozen_parameters_match_ddp(pools):
    for worst, never_none, frozen_none in pools(2).run(unused_and_frozen, timeout=60):
        assert worst <= TOL, worst
        assert never_none and frozen_none


def compressed(rank, world, method):
    """Rank body: compressed averaging runs through the engine; fp16 stays close to DDP."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.optim as gfo
    from gradientflow.compression import CompressionConfig

    base = _mlp(torch, (12, 64, 64, 1))
    gloo = dist.new_group(backend="gloo")
    ddp = DDP(copy.deepcopy(base), process_group=gloo)
    ref = torch.optim.SGD(ddp.parameters(), lr=0.05)
    model = copy.deepcopy(base)
    comp = method if method != "csc" else CompressionConfig(method="csc", density=0.5,
                                                             chunk_size=64, warmup_densities=())
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   partition_bytes=8192)
    logs = []
    worst = 0.0
    for step in range(3):
        x, y = _batch(torch, step, 0, rank, 12)
        ref.zero_grad()
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        ref.step()
        logs.append(opt.launch_log)
        worst = max(worst, _worst(torch, list(model.parameters()), list(ddp.parameters())))

    def flat(params):
        return torch.cat([p.detach().reshape(-1) for p in params])

    # How far the compressed run is from DDP, relative to how far DDP moved from the start: a
    # CSC that sent nothing would read 1.0 here.
    ddp_moved = flat(ddp.parameters()) - flat(base.parameters())
    rel = float((flat(model.parameters()) - flat(ddp.parameters())).norm() / ddp_moved.norm())
    return worst, logs, opt._compressor.step, rel


def fused_csc(rank, world, steps=5):
    """Rank body: CSC through the DistributedOptimizer over many partitions; returns (the
    parameters, collectives per step, partitions)."""
    import torch
    import torch.distributed as dist

    import gradientflow
    import gradientflow.optim as gfo
    from gradientflow.compression import CompressionConfig

    model = _mlp(torch, (12, 64, 64, 1))
    cfg = CompressionConfig(method="csc", density=0.1, chunk_size=32, warmup_densities=())
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=cfg,
                                   partition_bytes=4096)
    per_step = []
    for step in range(steps):
        x, y = _batch(torch, step, 0, rank, 12)
        before = gradientflow.stats()["fused_operations"] if dist.get_backend() != "gloo" else 0
        # Every other step the gradients stay and are zeroed in place: backward then
        # accumulates into the buffer the last step's results lie in.
        opt.zero_grad(set_to_none=step % 2 == 0)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        if dist.get_backend() != "gloo":
            per_step.append(gradientflow.stats()["fused_operations"] - before)
    parts = len(opt._reducer.plan)
    opt.close()
    return [p.detach().clone() for p in model.parameters()], per_step, parts


def test_compressed_partitions_fuse_into_three_collectives_per_step(pools):
    """The compressed partitions of a step are one engine batch: chunk norms, chunks and used
    flags, 3 collectives for all of them; with fusion off each partition makes its own 3. Each
    partition keeps its own quota, so the parameters are the same fused, alone and on gloo
    (where every partition is reduced alone, synchronously, at step())."""
    import torch

    fused = pools(2).run(fused_csc, timeout=120)
    alone = pools(2).run(fused_csc, timeout=120, env={"GRADIENTFLOW_FUSION_THRESHOLD": "0"})
    gloo = pools(2).run(fused_csc, backend="gloo", timeout=120)
    for rank in range(2):
        parts = fused[rank][2]
        assert parts >= 4, parts
        assert set(fused[rank][1]) == {3}, (rank, fused[rank][1])
        assert set(alone[rank][1]) == {3 * parts}, (rank, alone[rank][1])
        for a, b, c in zip(fused[rank][0], alone[rank][0], gloo[rank][0]):
            assert torch.equal(a, b) and torch.equal(a, c), rank


@pytest.mark.parametrize("method", ["fp16", "csc"])
def test_compression_through_the_engine(pools, method):
    res = pools(2).run(compressed, method, timeout=60)
    assert res[0][1] == res[1][1]
    assert all(r[2] == 3 for r in res)  # one compressor step per optimizer step
    if method == "fp16":
        assert max(r[0] for r in res) < 1e-3
    else:  # half of the chunks per step, the rest fed back: most of DDP's update arrives
        assert all(r[3] < 0.5 for r in res), [r[3] for r in res]


def sparse_embedding(rank, world):
    """Rank body: a sparse embedding allgathered, and densified, equal the dense average."""
    import copy

    import torch

    import gradientflow.optim as gfo

    torch.manual_seed(0)
    dense_base = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Flatten(),
                                     torch.nn.Linear(12, 1))
    results = {}
    for how in ("allgather", "sparse_as_dense"):
        model = copy.deepcopy(dense_base)
        model[0].sparse = True
        opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=how == "sparse_as_dense",
                                       partition_bytes=64)
        refm = copy.deepcopy(dense_base)
        for step in range(3):
            grads = []
            for r in range(world):  # the reference: every rank's dense gradient, averaged
                g = torch.Generator().manual_seed(step * 10 + r)
                idx = torch.randint(0, 20 if r == 0 else 5, (2, 3), generator=g)
                refm.zero_grad()
                refm(idx).pow(2).sum().backward()
                grads.append([p.grad.clone() for p in refm.parameters()])
                if r == rank:
                    mine = idx
            with torch.no_grad():
                for p, *gs in zip(refm.parameters(), *grads):
                    p -= 0.5 * sum(gs) / world
            opt.zero_grad()
            model(mine).pow(2).sum().backward()
            opt.step()
        results[how] = max(float((a - b).abs().max())
                           for a, b in zip(model.parameters(), refm.parameters()))
    return results


def test_sparse_embedding_gradients(pools):
    for res in pools(2).run(sparse_embedding, timeout=60):
        assert res["allgather"] <= TOL and res["sparse_as_dense"] <= TOL, res


def broadcasts(rank, world):
    """Rank body: parameters and optimizer state from root 1 reach every rank."""
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8, 1), seed=rank)
    model.register_buffer("steps", torch.tensor(rank))
    gfo.broadcast_parameters(model.state_dict(), root_rank=1)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    if rank == 1:
        model(torch.ones(2, 4)).sum().backward()
        sgd.step()
    gfo.broadcast_optimizer_state(sgd, root_rank=1)
    mom = torch.cat([sgd.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return flat.tolist(), int(model.steps), mom.tolist(), sgd.param_groups[0]["lr"]


def test_broadcast_parameters_and_optimizer_state(pools):
    res = pools(2).run(broadcasts, timeout=60)
    assert res[0] == res[1]
    assert res[0][1] == 1 and res[0][3] == pytest.approx(0.2)


# ---------------------------------------------------------------- bad input


def mismatched_parameters(rank, world):
    """Rank body: rank 1 builds a different model; every rank must refuse, naming it."""
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8 if rank == 0 else 9, 1))
    try:
        gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_parameter_list_differs_across_ranks(pools):
    for msg in pools(2).run(mismatched_parameters, timeout=60):
        assert "differs across ranks" in msg and "'0.weight'" in msg, msg
        assert "same model on every rank" in msg, msg


def _local_opt(**kw):
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8, 1))
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kw)
    return torch, model, opt


def test_zero_grad_between_backward_and_step():
    torch, model, opt = _local_opt()
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) was called after loss.backward"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()  # fine after step


def test_step_without_backward():
    torch, model, opt = _local_opt()
    with pytest.raises(RuntimeError, match=r"step\(\) was called without a backward\(\)"):
        opt.step()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="without a backward"):
        opt.step()


def test_gradient_produced_twice_before_step():
    torch, model, opt = _local_opt()
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="increase backward_passes_per_step"):
        model(torch.ones(2, 4)).sum().backward()
    torch2, model2, opt2 = _local_opt(backward_passes_per_step=2)
    for _ in range(2):
        model2(torch.ones(2, 4)).sum().backward()
    opt2.step()


def test_bad_arguments():
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        gfo.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="compression="):
        gfo.DistributedOptimizer(sgd, compression="gzip")
    with pytest.raises(ValueError, match="not in it"):
        gfo.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="more than once"):
        gfo.DistributedOptimizer(sgd, named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        gfo.DistributedOptimizer(sgd, op=gfo.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="already distributed"):
        gfo.DistributedOptimizer(gfo.DistributedOptimizer(sgd))


def test_wrapped_optimizer_keeps_its_class_state_and_schedulers():
    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8, 1))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    adam.step()
    adam.zero_grad()
    opt = gfo.DistributedOptimizer(adam, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam)
    assert opt.state_dict()["state"][0]["step"] == 1
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.state_dict()["state"][0]["step"] == 2


def test_next_forward_overlap_uses_the_hyperparameters_of_step_time():
    import copy

    import torch

    import gradientflow.optim as gfo

    model = _mlp(torch, (4, 8, 8, 1))
    model2 = copy.deepcopy(model)
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   overlap_next_forward=True, partition_bytes=64)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    s1 = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    s2 = torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5)
    for step in range(3):
        x = torch.full((2, 4), float(step + 1))
        for m, o, s in ((model, opt, s1), (model2, opt2, s2)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
            s.step()  # before the deferred update is applied: it must not see this lr
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 4))  # the forward applies the last update, layer by layer
    after = list(model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def closure_step(rank, world, steps=3):
    """Rank body: step(closure) (the closure runs backward) vs DDP; with and without overlap."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow.optim as gfo

    gloo = dist.new_group(backend="gloo")
    out = {}
    for nf in (False, True):
        base = _mlp(torch, (6, 16, 1))
        ddp = DDP(copy.deepcopy(base), process_group=gloo)
        ref = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        model = copy.deepcopy(base)
        opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       partition_bytes=256, overlap_next_forward=nf)
        worst_loss = 0.0
        for step in range(steps):
            x, y = _batch(torch, step, 0, rank, 6)

            def closure():
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss

            ref.zero_grad()
            ref_loss = ((ddp(x) - y) ** 2).mean()
            ref_loss.backward()
            ref.step()
            loss = opt.step(closure)
            worst_loss = max(worst_loss, abs(float(loss) - float(ref_loss)))
        opt.finish_updates()
        out[nf] = (worst_loss, _worst(torch, list(model.parameters()), list(ddp.parameters())))
        opt.close()
    return out


def test_step_with_closure_matches_ddp(pools):
    for per_rank in pools(2).run(closure_step, timeout=60):
        for nf, (wl, ww) in per_rank.items():
            assert wl <= TOL and ww <= TOL, (nf, wl, ww)


def fp16_dense(rank, world, steps=2):
    """Rank body: FP16 parameters on the dense path; the average of FP16 gradients, in FP16."""
    import copy

    import torch
    import torch.distributed as dist

    import gradientflow.optim as gfo

    gloo = dist.new_group(backend="gloo")
    model = _mlp(torch, (8, 24, 24, 1)).half()
    local = copy.deepcopy(model)  # the same model without the optimizer: this rank's gradients
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), partition_bytes=512)
    worst = 0.0
    dtypes = set()
    for step in range(steps):
        x, y = _batch(torch, step, 0, rank, 8)
        x, y = x.half(), y.half()
        opt.zero_grad()
        local.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        ((local(x) - y) ** 2).mean().backward()
        opt.synchronize()
        for p, q in zip(model.parameters(), local.parameters()):
            dtypes.add(p.grad.dtype)
            everyone = [torch.zeros_like(q.grad, dtype=torch.float32) for _ in range(world)]
            dist.all_gather(everyone, q.grad.float(), group=gloo)
            want = torch.stack(everyone).mean(0)
            # FP16 has 11 significant bits: compare relative to the gradient's scale.
            err = float((p.grad.float() - want).abs().max()) / max(1e-3, float(want.abs().max()))
            worst = max(worst, err)
        with opt.skip_synchronize():
            opt.step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), local.parameters()):
                q.copy_(p)
    return worst, sorted(map(str, dtypes))


def test_fp16_parameters_dense_average(pools):
    for worst, dtypes in pools(2).run(fp16_dense, timeout=60):
        assert dtypes == ["torch.float16"]
        assert worst <= 2e-3, worst


def test_fifo_is_the_default_and_carries_no_priority():
    """FIFO partitions carry no priority, so the engine routes them as any async allreduce;
    only priority=True makes them priority-ordered ops agreed in rounds."""
    import dataclasses

    import torch

    from gradientflow.optim import GradientReducer, ReducerOptions

    model = _mlp(torch, (8, 16, 16, 1))
    fifo = ReducerOptions(compression=None, partition_bytes=256)
    assert fifo.priority is False
    reducer = GradientReducer(list(model.named_parameters()), fifo)
    n = len(reducer.plan)
    assert n > 1 and reducer.priority == [None] * n
    reducer.close()
    tic = GradientReducer(list(model.named_parameters()),
                          dataclasses.replace(fifo, priority=True))
    assert tic.priority == list(range(n))
    tic.close()
