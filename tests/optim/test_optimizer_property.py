"""Property: for random MLPs, partition sizes and options, DistributedOptimizer equals a local
reference.

Each rank runs the same derandomized Hypothesis examples (agreed by an allgather of the example);
every rank builds every rank's batch from the example's seed, so it computes the reference (the
average over ranks of the gradients, then plain SGD with momentum) on its own. Plus the plan's
invariants, in one process.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def optimizer_property(rank, world, n_examples):
    """Rank body: random examples, each checked against the local reference on every rank."""
    import copy

    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    import gradientflow.optim as gfo

    seen = []

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), widths=st.lists(st.integers(1, 24), min_size=2, max_size=4),
           partition_bytes=st.sampled_from([1, 16, 100, 1000, 1 << 20]),
           priority=st.booleans(), bpps=st.integers(1, 2), op=st.sampled_from(["avg", "sum"]),
           predivide=st.sampled_from([1.0, 4.0]), overlap=st.booleans())
    def prop(seed, widths, partition_bytes, priority, bpps, op, predivide, overlap):
        example = (seed, tuple(widths), partition_bytes, priority, bpps, op, predivide, overlap)
        ids = [None] * world
        dist.all_gather_object(ids, example)
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        if op == "sum":
            predivide = 1.0
        torch.manual_seed(seed)
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        base = torch.nn.Sequential(*layers)
        model, refm = copy.deepcopy(base), copy.deepcopy(base)
        opt = gfo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
            named_parameters=model.named_parameters(), partition_bytes=partition_bytes,
            priority=priority, backward_passes_per_step=bpps,
            op=gfo.Average if op == "avg" else gfo.Sum, gradient_predivide_factor=predivide,
            overlap_next_forward=overlap)
        ref = torch.optim.SGD(refm.parameters(), lr=0.1, momentum=0.5)

        def batch(step, micro, r):
            g = torch.Generator().manual_seed(seed + 7919 * step + 104729 * micro + 31 * r)
            return torch.randn(3, widths[0], generator=g)

        for step in range(2):
            opt.zero_grad()
            for micro in range(bpps):
                model(batch(step, micro, rank)).square().sum().backward()
            opt.step()
            total = [torch.zeros_like(p) for p in refm.parameters()]
            for r in range(world):
                for micro in range(bpps):
                    refm.zero_grad()
                    refm(batch(step, micro, r)).square().sum().backward()
                    for t, p in zip(total, refm.parameters()):
                        t += p.grad
            for t, p in zip(total, refm.parameters()):
                p.grad = t / world if op == "avg" else t
            ref.step()
        opt.finish_updates()
        worst = max(float((a.detach() - b.detach()).abs().max() /
                          (1.0 + b.detach().abs().max()))
                    for a, b in zip(model.parameters(), refm.parameters()))
        opt.close()
        ok = worst <= 1e-5
        flags = torch.tensor([1 if ok else 0])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        everyone_ok = flags.item() == 1  # wait before raising: the ranks stay in step
        assert ok, f"rank {rank}: {example}: worst relative difference {worst}"
        assert everyone_ok, "another rank saw a wrong result (see its report)"
        seen.append(len(opt.plan))

    prop()
    return seen


@pytest.mark.parametrize("world,examples", [(2, 14), (4, 5)])
def test_random_models_equal_reference(pools, world, examples):
    seen = pools(world).run(optimizer_property, examples, timeout=150)
    assert seen[0] == seen[-1] and len(seen[0]) == examples


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1,
                       max_size=6),
       partition_bytes=st.integers(1, 400))
def test_plan_covers_every_element_once(shapes, partition_bytes):
    import torch

    from gradientflow.optim.plan import ParamSpec, build_plan

    specs = [ParamSpec(f"p{i}", tuple(s), torch.float32, torch.device("cpu"))
             for i, s in enumerate(shapes)]
    plan = build_plan(specs, partition_bytes)
    assert plan == build_plan(specs, partition_bytes)  # a pure function of the specs
    covered = {i: [] for i in range(len(specs))}
    for k, part in enumerate(plan):
        assert part.key == k and part.segments
        for seg in part.segments:
            covered[seg.index].append((seg.row0, seg.row1, seg.whole, seg.numel))
        if len(part.segments) > 1:  # only a single segment may exceed the size
            assert part.nbytes <= partition_bytes
        part.layout()  # names unique, shapes consistent
    order = [seg.index for part in plan for seg in part.segments]
    assert order == sorted(order)  # forward order is kept: partition k is consumed k-th
    for i, spec in enumerate(specs):
        segs = covered[i]
        assert sum(s[3] for s in segs) == math.prod(spec.shape)
        if len(segs) > 1:
            rows = [(a, b) for a, b, _, _ in segs]
            assert rows[0][0] == 0 and rows[-1][1] == spec.shape[0]
            assert all(b0 == a1 for (_, b0), (a1, _) in zip(rows, rows[1:]))
