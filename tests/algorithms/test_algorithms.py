"""Each algorithm against ring on 4 CPU ranks (2 hosts x 2), and their settings.

One group start per test: the ring world group and a gradientflow group per algorithm are
created once, then the Hypothesis examples run inside (every rank draws the same example,
checked with an all_gather of its parameters). Integer-valued floats make every sum exact
in any order, so those results must equal ring's bit for bit; random floats up to rounding.
"""
from __future__ import annotations

import pytest

from gradientflow.config import Config

WORLD = 4
TIMEOUT = 240


def _host(rank: int) -> str:
    return f"host{rank // 2}"


def _groups(rank, algorithms, **extra):
    import torch.distributed as dist

    return {a: dist.new_group(backend="gradientflow",
                              pg_options={"algorithm": a, "host": _host(rank), **extra})
            for a in algorithms}


def _inputs(torch, seed, rank, dtype, n, integer):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if integer:
        return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def match_ring(rank, world, algorithms, n_examples, extra):
    """Rank body: fused, solo and stage messages under each algorithm equal ring's."""
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.algorithms import algorithm_stats, reset_algorithm_stats
    from gradientflow.backend.api import submit_stages

    groups = _groups(rank, algorithms, **extra)
    reset_algorithm_stats()

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), dtype=st.sampled_from(["float32", "float64"]),
           sizes=st.lists(st.integers(1, 300_000), min_size=1, max_size=6),
           integer=st.booleans(), staged=st.booleans())
    def prop(seed, dtype, sizes, integer, staged):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, dtype, sizes, integer, staged))
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        dt = getattr(torch, dtype)
        xs = [_inputs(torch, seed + i, rank, dt, n, integer) for i, n in enumerate(sizes)]
        want = [x.clone() for x in xs]
        for w in want:  # the ring: the world group, gloo's allreduce, one tensor at a time
            dist.all_reduce(w)
        for name, pg in groups.items():
            got = [x.clone() for x in xs]
            if staged:  # compressed-stage style: a generator whose messages are allreduced
                def gen(ts):
                    for t in ts:
                        t.copy_((yield t))
                    return ts

                fut = submit_stages(pg, ("test", name), gen(got))
                fut.wait()
            else:
                works = [dist.all_reduce(g, group=pg, async_op=True) for g in got]
                for w in works:
                    w.wait()
            for i, (g, w) in enumerate(zip(got, want)):
                if integer:
                    assert torch.equal(g, w), f"rank {rank}: {name}, tensor {i}: differs"
                else:
                    assert torch.allclose(g, w, rtol=1e-5, atol=1e-5), (
                        f"rank {rank}: {name}, tensor {i}: max error "
                        f"{(g - w).abs().max().item()}")

    prop()
    return algorithm_stats()


def test_hierarchical_and_auto_equal_ring(pools):
    stats = pools(WORLD).run(match_ring, ["hierarchical", "auto"], 12, {}, timeout=TIMEOUT)
    for rank, s in enumerate(stats):
        assert s["hierarchical"]["messages"] > 0, f"rank {rank}: no hierarchical message"
        h = s["hierarchical"]
        # Leaders (ranks 0 and 2) carry the hosts' traffic across: 2(H-1)/H = 1x the bytes.
        if rank % 2 == 0:
            assert h["inter_host_sent_bytes"] == h["bytes"], (rank, h)
        else:
            assert h["inter_host_sent_bytes"] == 0, (rank, h)


def test_config_validation():
    for bad in ("tree", "", "RINGS"):
        with pytest.raises(ValueError, match="is not one of ring, hierarchical"):
            Config.resolve({"algorithm": bad}, environ={})
    with pytest.raises(ValueError, match="GRADIENTFLOW_ALGORITHM='x' is not one of"):
        Config.resolve(environ={"GRADIENTFLOW_ALGORITHM": "x"})
    with pytest.raises(ValueError, match="GRADIENTFLOW_REDUCERS='-1' is out of range"):
        Config.resolve(environ={"GRADIENTFLOW_REDUCERS": "-1"})
    assert Config.resolve({"algorithm": " Hierarchical "}, environ={}).algorithm == \
        "hierarchical"
    assert Config.resolve(environ={"GRADIENTFLOW_ALGORITHM": "auto"}).algorithm == "auto"
    # torchrun's node: its first global rank names the host.
    cfg = Config.resolve(environ={"RANK": "5", "LOCAL_RANK": "1"})
    assert cfg.node.endswith("/4") and cfg.host == ""
    assert Config.resolve({"host": "a"}, environ={"RANK": "5", "LOCAL_RANK": "1"}).host == "a"
    with pytest.raises(ValueError, match="unknown gradientflow option 'node'"):
        Config.resolve({"node": "x"}, environ={})


def test_reduction_server_needs_reducers():
    from gradientflow.algorithms import Algorithms

    cfg = Config.resolve({"algorithm": "reduction_server"}, environ={})
    with pytest.raises(ValueError, match="needs reducers >= 1"):
        Algorithms(cfg, None, 0, 4, 10.0, None, "g")


def test_auto_rule():
    from gradientflow.algorithms.auto import CostModel, choose
    from gradientflow.algorithms.topology import Topology

    two_by_two = Topology.from_keys(["a", "a", "b", "b"])
    flat = Topology.from_keys(["a", "b", "c", "d"])
    slow = CostModel(inter_host_Bps=1e9 / 8)
    assert choose(1000, 4, two_by_two, 0, slow) == "ring"  # latency-bound
    assert choose(50 * 2**20, 4, two_by_two, 0, slow) == "hierarchical"
    assert choose(50 * 2**20, 4, flat, 0, slow) == "ring"  # one rank per host: no hierarchy
    assert choose(50 * 2**20, 4, flat, 4, slow) == "reduction_server"
    assert choose(1000, 4, flat, 4, slow) == "ring"


def test_reduction_server_fallback_is_counted_apart():
    """A message reduction_server cannot take (here: not on CPU) goes to ring, counted under
    ring_fallback in stats()["algorithms"], so the fallback is visible."""
    import torch
    from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

    from gradientflow.algorithms import Algorithms, algorithm_stats, reset_algorithm_stats
    from gradientflow.algorithms.ring import FALLBACK

    class Transport:
        def allreduce(self, tensors, opts):
            return "sent"

    cfg = Config.resolve({"algorithm": "reduction_server", "reducers": 2}, environ={})
    algos = Algorithms(cfg, None, 0, 4, 10.0, None, "g")
    send = algos.channel("fused", lambda device: Transport())
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    meta = torch.empty(1000, device="meta")  # stands for a CUDA tensor: not on CPU
    channel = algos._channels[0]
    assert channel.pick(meta, opts) == FALLBACK
    assert channel.pick(torch.ones(3), opts) == "reduction_server"
    opts.reduceOp = ReduceOp.BAND
    assert channel.pick(torch.ones(3, dtype=torch.int32), opts) == FALLBACK
    opts.reduceOp = ReduceOp.SUM
    reset_algorithm_stats()
    assert send(meta.device).allreduce([meta], opts) == "sent"
    counted = algorithm_stats()
    assert counted[FALLBACK]["messages"] == 1 and counted[FALLBACK]["bytes"] == 4000
    assert "reduction_server" not in counted


def channels_connect_at_once(rank, world, groups):
    """Rank body: on fresh hierarchical groups, a tensor for the solo channel and small ones
    for the fused channel at once: both channels create their host and leader groups
    concurrently, each rank in its own order. Every list completes with the right sums."""
    import torch
    import torch.distributed as dist

    for i in range(groups):
        pg = dist.new_group(backend="gradientflow",
                            pg_options={"algorithm": "hierarchical", "host": _host(rank)})
        big = torch.full((2 * 10**6,), float(rank + i))  # 8 MB: at least solo_threshold
        small = [torch.full((100,), float(rank * j)) for j in range(1, 4)]
        works = [dist.all_reduce(t, group=pg, async_op=True) for t in [*small, big]]
        for w in works:
            w.wait()
        assert torch.equal(big, torch.full_like(big, 6.0 + 4 * i)), f"rank {rank}: list {i}"
        for j, t in enumerate(small, 1):
            assert torch.equal(t, torch.full_like(t, 6.0 * j)), f"rank {rank}: list {i}"
    return True


def test_channels_creating_hierarchy_groups_at_once_do_not_wait_for_each_other(pools):
    # Each channel's groups meet through a store connection of its own: on a shared one, a
    # rank's waiting channel held it while the peers waited for that rank's other channel.
    assert all(pools(WORLD).run(channels_connect_at_once, 4, timeout=TIMEOUT,
                                pg_timeout_s=60.0))
