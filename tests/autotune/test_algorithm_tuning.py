"""Autotune switches the collective algorithm where there is a choice (4 ranks as 2 hosts x 2):
every rank runs the same algorithm at every step and every allreduce stays exact."""
from __future__ import annotations

import importlib.util

import pytest

WORLD = 4


def tune_algorithm(rank, world):
    """Rank body: integer-valued allreduces (fused and solo sizes) each step, a tuner step
    after each; returns the algorithm in force at every step and the bytes per algorithm."""
    import torch
    import torch.distributed as dist

    from gradientflow.algorithms import algorithm_stats, reset_algorithm_stats
    from gradientflow.autotune import Param, Tuner
    from gradientflow.backend import backend_of

    group = dist.new_group(backend="gradientflow", pg_options={"host": f"host{rank // 2}"})
    backend = backend_of(group)
    # ring against hierarchical (auto picks ring on loopback's cost model): fitted to the
    # topology, both stay
    tuner = Tuner(group, params=[Param("algorithm", choices=("ring", "hierarchical"))],
                  trials=4, steps=1, warmup=0, confirm=1, seed=0)
    assert [p.choices for p in tuner.params] == [("ring", "hierarchical")]
    reset_algorithm_stats()
    used = []
    step = 0
    while not tuner.done:
        used.append(backend.algorithms.name)
        sizes = [3, 70_000, 1_100_000, 257]  # 1.1 M floats: above the 4 MB solo threshold
        xs = [torch.full((n,), float(rank + 1 + i + step)) for i, n in enumerate(sizes)]
        works = [dist.all_reduce(x, group=group, async_op=True) for x in xs]
        for i, (w, x) in enumerate(zip(works, xs)):
            w.wait()
            want = float(sum(r + 1 + i + step for r in range(world)))
            assert torch.equal(x, torch.full_like(x, want)), (
                f"rank {rank}: step {step} tensor {i} under {used[-1]}")
        tuner.step()
        step += 1
    stats = algorithm_stats()
    return {"used": used, "algorithms": sorted(k for k, v in stats.items() if v)}


@pytest.mark.skipif(importlib.util.find_spec("optuna") is None, reason="optuna is not installed")
def test_the_algorithm_switches_alike_on_every_rank_and_results_stay_exact(pools):
    out = pools(WORLD).run(tune_algorithm, timeout=300)
    assert all(o["used"] == out[0]["used"] for o in out), [o["used"] for o in out]
    # it really switched (the seeded sampler draws hierarchical), and messages really took it
    assert set(out[0]["used"]) == {"ring", "hierarchical"}, out[0]["used"]
    assert out[0]["algorithms"] == ["hierarchical", "ring"], out[0]
