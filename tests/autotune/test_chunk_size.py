"""The CSC chunk size changed between steps (autotune's setter) keeps every residual whole: no
gradient mass is lost, and the ranks of a DDP model stay identical while it is tuned."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gradientflow.engine.stages import drive_lockstep
from gradientflow.hooks import CSCState

SIZES = [2, 3, 8, 16, 64, 100]


class Bucket:
    """The part of DDP's GradBucket a hook uses: one bucket holding every parameter."""

    def __init__(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._params = params

    def index(self):
        return 0

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return True


def ranks(world: int, shapes, chunk_size: int, **kw) -> tuple[list[CSCState], list]:
    params = [torch.zeros(s) for s in shapes]
    states = []
    for r in range(world):
        st_ = CSCState(None, world_size=world, rank=r, density=0.2, chunk_size=chunk_size,
                       wire_dtype="fp32", warmup_densities=(), min_numel=0, **kw)
        st_.bind_parameter_names([(f"p{i}", p) for i, p in enumerate(params)])
        states.append(st_)
    return states, params


def residual_sum(states: list[CSCState], numel: int) -> torch.Tensor:
    """Every rank's residual, summed over ranks, flat in float64."""
    total = torch.zeros(numel, dtype=torch.float64)
    for s in states:
        res = s.state_dict()["memory"].get("residual", {})
        flat = [res[f"p{i}"].reshape(-1).double() for i in range(len(res))]
        if flat:
            total += torch.cat(flat)
    return total


def run(world, shapes, plan, seed, reset_at_switch=False):
    """Steps of every rank (plan: the chunk size of each step); returns the mass applied
    (the summed gradient the ranks received, times world) plus what the residuals still hold,
    and the mass the ranks fed in."""
    states, params = ranks(world, shapes, plan[0], momentum_correction=False)
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(seed)
    fed = torch.zeros(numel, dtype=torch.float64)
    applied = torch.zeros(numel, dtype=torch.float64)
    for t, c in enumerate(plan):
        if c != states[0].config.chunk_size:
            if reset_at_switch:  # the control: a compressor rebuilt without its state
                states = [CSCState(None, s.config, world_size=world, rank=r)
                          for r, s in enumerate(states)]
                for s in states:
                    s.bind_parameter_names([(f"p{i}", p) for i, p in enumerate(params)])
            for s in states:
                s.set_chunk_size(c)
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
        for g in grads:
            fed += torch.cat([x.reshape(-1) for x in g]).double()
        outs = drive_lockstep([states[r]._stages(Bucket(grads[r], params))
                               for r in range(world)])
        for o in outs[1:]:
            assert torch.equal(o, outs[0])  # every rank applies the same average
        applied += outs[0].double() * world
    return applied + residual_sum(states, numel), fed, states


shapes_st = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 40)), min_size=1, max_size=4)


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.integers(1, 3), shapes=shapes_st,
       plan=st.lists(st.sampled_from(SIZES), min_size=2, max_size=6), seed=st.integers(0, 999))
def test_changing_chunk_size_between_steps_loses_no_gradient_mass(world, shapes, plan, seed):
    """Sum over steps of what the ranks applied, plus what the residuals hold, equals the sum of
    every gradient fed in, whatever the chunk size does between steps (fp32 wire: only the
    float sums round)."""
    kept, fed, states = run(world, shapes, plan, seed)
    torch.testing.assert_close(kept, fed, rtol=1e-5, atol=1e-4 * len(plan) * world)
    assert all(s.config.chunk_size == plan[-1] == s.compressor.config.chunk_size
               for s in states)


def test_the_mass_check_fails_when_a_switch_drops_the_residual():
    """The control: rebuilding the compressor without its state at a switch loses mass."""
    kept, fed, _ = run(2, [(8, 40)], [16, 16, 64, 64], seed=1, reset_at_switch=True)
    assert (kept - fed).abs().max() > 1e-2


def test_the_setter_keeps_residual_momentum_and_schedule_exactly():
    # momentum correction on: the setter must keep the velocity as well as the residual
    states, params = ranks(1, [(6, 50), (30,)], 16, momentum_correction=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        drive_lockstep([states[0]._stages(Bucket([torch.randn(6, 50, generator=gen),
                                                  torch.randn(30, generator=gen)], params))])
    before = states[0].state_dict()
    states[0].set_chunk_size(64)
    after = states[0].state_dict()
    assert after["config"]["chunk_size"] == 64 and before["config"]["chunk_size"] == 16
    assert set(before["memory"]) == set(after["memory"]) >= {"residual", "momentum"}
    for slot, per_name in before["memory"].items():
        for name, t in per_name.items():
            assert torch.equal(after["memory"][slot][name], t), (slot, name)
    assert (after["step"], after["epoch"], after["stats"]) == (
        before["step"], before["epoch"], before["stats"])


def test_the_setter_refuses_mid_step_and_bad_sizes():
    states, params = ranks(1, [(6, 50)], 16)
    gen = states[0]._stages(Bucket([torch.randn(6, 50)], params))
    with pytest.raises(RuntimeError, match="between steps"):
        states[0].set_chunk_size(32)
    drive_lockstep([gen])
    with pytest.raises(ValueError, match="chunk_size"):
        states[0].set_chunk_size(0)


def ddp_tuned_chunk_size(rank, world):
    """Rank body: a DDP model under CSC whose chunk size autotune changes every step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradientflow import hooks
    from gradientflow.autotune import Param, Tuner
    from gradientflow.compression import CompressionConfig

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hooks.register(model, CompressionConfig(density=0.1, warmup_densities=()),
                           optimizer=opt)
    tuner = Tuner(params=[Param("chunk_size", 4, 512, target="compression")],
                  compression=state, trials=5, steps=1, warmup=0, confirm=1, seed=1)
    gen = torch.Generator().manual_seed(rank)
    sizes = []
    while not tuner.done:
        x = torch.randn(16, 20, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sizes.append(state.config.chunk_size)
        tuner.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(e, every[0]) for e in every), f"rank {rank}: parameters differ"
    return {"sizes": sizes, "final": state.config.chunk_size}


@pytest.mark.skipif(importlib.util.find_spec("optuna") is None, reason="optuna is not installed")
def test_ddp_ranks_stay_identical_while_the_chunk_size_is_tuned(pools):
    out = pools(2).run(ddp_tuned_chunk_size, timeout=240)
    assert out[0] == out[1]
    assert len(set(out[0]["sizes"])) > 2  # it really changed, several times


def train_with_env_autotune(rank, world):
    """Rank body as experiments/imagenet/train.py runs it: GRADIENTFLOW_AUTOTUNE=1 made the
    tuner with the group; the hook state is handed to it before the first step."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradientflow import autotune, hooks
    from gradientflow.compression import CompressionConfig

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Linear(300, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = hooks.register(model, CompressionConfig(density=0.1), optimizer=opt)
    tuner = autotune.tuner_of()
    tuner.tune_compression(state)
    steps = 0
    while not tuner.done and steps < 200:
        model(torch.randn(8, 20)).sum().backward()
        opt.step()  # the tuner's hook marks the step
        opt.zero_grad()
        steps += 1
    return {"done": tuner.done, "loaded": tuner.loaded_from, "chunk": state.config.chunk_size,
            "tuned": [p.name for p in tuner.params]}


@pytest.mark.skipif(importlib.util.find_spec("optuna") is None, reason="optuna is not installed")
def test_env_autotune_tunes_the_chunk_size_and_a_later_run_reloads_it(pools, tmp_path):
    from gradientflow.autotune import tuned_compression
    from gradientflow.config import read_config_file

    out_path = str(tmp_path / "tuned.json")
    env = {"GRADIENTFLOW_AUTOTUNE": "1", "GRADIENTFLOW_AUTOTUNE_OUT": out_path,
           "GRADIENTFLOW_AUTOTUNE_TRIALS": "4", "GRADIENTFLOW_AUTOTUNE_STEPS": "1",
           "GRADIENTFLOW_AUTOTUNE_WARMUP": "0"}
    first = pools(2).run(train_with_env_autotune, env=env, timeout=240)
    assert first[0] == first[1] and first[0]["done"] and "chunk_size" in first[0]["tuned"]
    saved = tuned_compression(out_path)
    assert saved == {"chunk_size": first[0]["chunk"]}
    assert "chunk_size" not in read_config_file(out_path)["settings"]  # not a Config field
    if saved["chunk_size"] == 1024:  # the defaults won: reload a size that is not one
        doc = json.load(open(out_path))
        doc["compression"]["chunk_size"] = saved["chunk_size"] = 4096
        json.dump(doc, open(out_path, "w"))
    env2 = {"GRADIENTFLOW_AUTOTUNE": "1", "GRADIENTFLOW_CONFIG": out_path}
    again = pools(2).run(train_with_env_autotune, env=env2, timeout=120)
    for r in again:
        assert r["loaded"] == out_path and r["chunk"] == saved["chunk_size"]


def test_a_method_without_chunks_gets_no_chunk_size_to_tune():
    """A PowerSGD state has no chunk size: it is left out of the default space, and asking
    for it says whose option it is."""
    from gradientflow.autotune.tuner import Tuner
    from gradientflow.compression import CompressionConfig

    class State:
        config = CompressionConfig(method="powersgd", rank=2)

    class Backend:
        def size(self):
            return 2

    assert "chunk_size" not in {p.name for p in Tuner._space(None, State(), Backend())}
    with pytest.raises(ValueError, match="method 'powersgd' has none"):
        Tuner._space(["chunk_size"], State(), Backend())
