"""Autotune: every rank applies the same settings at the same step under load, results stay
exact, a mismatch raises on every rank, the log and the settings file."""
from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from harness import RankFailure

# Rank 0's study needs optuna (the `autotune` extra); the config tests do not.
needs_optuna = pytest.mark.skipif(importlib.util.find_spec("optuna") is None,
                                  reason="optuna is not installed (pip install .[autotune])")

def narrow_params():
    """Ranges far narrower than the real ones, so that the cut, the routes (solo or fused)
    and the number of segments really change between steps of the small programs below."""
    from gradientflow.autotune import Param

    return [Param("fusion_threshold", 64, 64 * 1024), Param("solo_threshold", 256, 16 * 1024),
            Param("cycle_time_ms", 0.1, 5.0, integer=False),
            Param("fusion_segments", 1, 4, log=False)]


def retune_under_load(rank, world, n_examples):
    """Rank body: Hypothesis programs of allreduces, one program per step, a retune after
    each; returns each step's config and the tuner's summary."""
    import random

    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.autotune import Tuner
    from gradientflow.backend import backend_of

    backend = backend_of()
    tuner = Tuner(params=narrow_params(), trials=max(2, n_examples // 2), steps=1, warmup=0,
                  confirm=1, seed=3)
    seen = []
    op_step = st.tuples(st.sampled_from(["float32", "float64", "int32"]), st.integers(1, 3000),
                        st.booleans())

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), program=st.lists(op_step, min_size=1, max_size=30))
    def prop(seed, program):
        rng = random.Random(seed * 7919 + rank)  # each rank waits at its own points
        cfg = backend.config
        seen.append([cfg.fusion_threshold, cfg.solo_threshold, cfg.cycle_time_ms,
                     cfg.fusion_segments, backend.engine.config == cfg])
        pending = []
        for i, (dtype, n, sync) in enumerate(program):
            dt = getattr(torch, dtype)
            xs = [(torch.arange(n) % 11 + 3 * r + i).to(dt) for r in range(world)]
            want = sum(x.double() for x in xs).to(dt)
            t = xs[rank].clone()
            if sync:
                dist.all_reduce(t)
                assert torch.equal(t, want), (i, "sync")
            else:
                pending.append((dist.all_reduce(t, async_op=True), t, want, i))
            if pending and rng.random() < 0.3:
                w, t2, want2, j = pending.pop(rng.randrange(len(pending)))
                w.wait()
                assert torch.equal(t2, want2), (j, "async")
        for w, t2, want2, j in pending:
            w.wait()
            assert torch.equal(t2, want2), (j, "async")
        tuner.step()

    prop()
    return {"seen": seen, "history": tuner.history, "done": tuner.done,
            "summary": tuner.summary}


@needs_optuna
@pytest.mark.parametrize("world", [2, 3])
def test_settings_change_under_load_the_same_on_every_rank(pools, world):
    n = 24
    out = pools(world).run(retune_under_load, n, timeout=240)
    for r in range(1, world):
        assert out[r]["seen"] == out[0]["seen"], f"rank {r} used other settings than rank 0"
        assert out[r]["history"] == out[0]["history"], f"rank {r} applied other settings"
    assert all(s[4] for s in out[0]["seen"]), "the engine's config is not the backend's"
    # The settings really changed under load, and tuning finished within the examples.
    assert len({tuple(s[:4]) for s in out[0]["seen"]}) >= 5
    assert out[0]["done"] and out[0]["summary"] is not None
    assert all(o["done"] for o in out)


def allreduce_steps(tuner, n, world):
    """`n` steps of one checked allreduce each, marked on `tuner` (None: none)."""
    import torch
    import torch.distributed as dist

    for _ in range(n):
        t = torch.ones(4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(world)))
        if tuner is not None:
            tuner.step()


def mismatched_tuners(rank, world):
    from gradientflow.autotune import AutotuneMismatch, Tuner

    tuner = Tuner(trials=3, steps=1, warmup=0, confirm=rank)  # rank 1 differs
    try:
        allreduce_steps(tuner, 2, world)
    except AutotuneMismatch as exc:
        return str(exc)
    return None


@needs_optuna
def test_different_tuner_arguments_raise_on_every_rank(pools):
    msgs = pools(2).run(mismatched_tuners, timeout=120)
    for r, msg in enumerate(msgs):
        assert msg is not None, f"rank {r} did not raise"
        assert f"rank {r}:" in msg and "rank 0: trial 0" in msg and "rank 1: trial 0" in msg


def failing_search(rank, world):
    from gradientflow.autotune import Tuner

    tuner = Tuner(trials=3, steps=1, warmup=0)
    if rank == 0:
        tuner._decide = lambda *_: 1 / 0  # the study breaks on rank 0 only
    try:
        allreduce_steps(tuner, 3, world)
    except RuntimeError as exc:
        # The group still works: the failure was agreed, not a broken exchange.
        allreduce_steps(None, 1, world)
        return str(exc), tuner.done
    return None, tuner.done


@needs_optuna
def test_a_failing_search_on_rank_0_raises_on_every_rank(pools):
    for r, (msg, done) in enumerate(pools(2).run(failing_search, timeout=120)):
        assert msg is not None and done, f"rank {r} did not raise"
        assert f"rank {r}: rank 0's search failed at trial 0" in msg
        assert ("ZeroDivisionError" in msg) == (r == 0)


def mismatched_steps(rank, world):
    import torch
    import torch.distributed as dist

    from gradientflow.autotune import Tuner

    tuner = Tuner(trials=3, steps=2, warmup=0, confirm=0)
    if rank == 1:
        tuner.step()  # one step ahead: its exchange meets rank 0's allreduce
    for _ in range(4):
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(world)))
        tuner.step()


@needs_optuna
def test_a_rank_a_step_ahead_fails_every_rank_not_a_hang(pools):
    with pytest.raises(RankFailure) as info:
        pools(2).run(mismatched_steps, timeout=120, pg_timeout_s=20)
    text = str(info.value)
    assert "failed on ranks [0, 1]" in text, text
    # Both name the collectives that met: the exchange and rank 0's allreduce.
    assert text.count("collective mismatch at sequence number") >= 2, text
    assert "all_gather float64" in text, text


def tune_and_log(rank, world, log_path, out_path):
    """Rank body: the config's autotune (optimizer hook) over a small model's steps."""
    import torch
    import torch.distributed as dist

    from gradientflow.autotune import tuner_of
    from gradientflow.backend import backend_of

    tuner = tuner_of()
    assert tuner is not None and tuner._hook is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    other = register_optimizer_step_post_hook(lambda *_: marks.append(1))  # runs after ours
    steps = 0
    while not tuner.done:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(steps * 10 + rank))
        model(x).square().mean().backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
        for w in works:
            w.wait()
        opt.step()
        opt.zero_grad()
        steps += 1
        assert steps < 200
    other.remove()
    assert len(marks) == steps
    cfg = backend_of().config
    return {"steps": steps, "config": [cfg.fusion_threshold, cfg.solo_threshold,
                                       cfg.cycle_time_ms, cfg.fusion_segments]}


def load_tuned(rank, world):
    from gradientflow.autotune import tuner_of
    from gradientflow.backend import backend_of

    tuner = tuner_of()
    cfg = backend_of().config
    return {"done": tuner.done, "loaded": tuner.loaded_from, "hook": tuner._hook is not None,
            "config": [cfg.fusion_threshold, cfg.solo_threshold, cfg.cycle_time_ms,
                       cfg.fusion_segments]}


@needs_optuna
def test_env_autotune_logs_every_trial_and_a_later_run_loads_the_choice(pools, tmp_path):
    log_path, out_path = str(tmp_path / "tune.jsonl"), str(tmp_path / "tuned.json")
    env = {"GRADIENTFLOW_AUTOTUNE": "1", "GRADIENTFLOW_AUTOTUNE_LOG": log_path,
           "GRADIENTFLOW_AUTOTUNE_OUT": out_path, "GRADIENTFLOW_AUTOTUNE_TRIALS": "4",
           "GRADIENTFLOW_AUTOTUNE_STEPS": "2", "GRADIENTFLOW_AUTOTUNE_WARMUP": "1"}
    out = pools(2).run(tune_and_log, log_path, out_path, env=env, timeout=180)
    assert out[0] == out[1]
    # 4 searched trials, then 2 race rounds of the defaults and the 2 best searched settings:
    # 10 trials of 3 steps (+1: the first step starts the clock).
    assert out[0]["steps"] == (4 + 2 * 3) * 3 + 1
    lines = [json.loads(x) for x in open(log_path)]
    trials, final = lines[:-1], lines[-1]
    assert [t["event"] for t in trials] == ["trial"] * len(trials)
    assert [t["trial"] for t in trials] == list(range(len(trials)))
    assert trials[0]["kind"] == "default" and {t["kind"] for t in trials[1:4]} == {"search"}
    race = trials[4:]
    assert [t["kind"] for t in race] == ["race"] * 6
    # each round measures every finalist once, the defaults (candidate 0) among them
    assert sorted((t["round"], t["candidate"]) for t in race) == [
        (r, c) for r in range(2) for c in range(3)]
    assert all(t["settings"] == final["finalists"][t["candidate"]] for t in race)
    for t in trials:
        assert len(t["samples_s"]) == 2 and len(t["rank_scores_s"]) == 2
        assert t["score_s"] == max(t["rank_scores_s"]) > 0
    assert final["event"] == "final"
    assert set(final["settings"]) == {"fusion_threshold", "solo_threshold", "cycle_time_ms",
                                      "fusion_segments"}
    assert final["gain"] == pytest.approx(1 / final["ratio_to_defaults"] - 1)
    chosen_at = final["finalists"].index(final["settings"])
    ratios = {int(c): v for c, v in final["race_ratios"].items()}
    assert ratios[0] == [1.0, 1.0]  # the defaults against themselves
    medians = {c: statistics.median(v) for c, v in ratios.items()}
    # the lowest median wins, unless it beats the defaults by less than the margin
    from gradientflow.autotune.search import MARGIN
    if chosen_at:
        assert medians[chosen_at] == min(medians.values()) <= 1 - MARGIN
    else:
        assert min(medians.values()) > 1 - MARGIN or min(medians.values()) == 1.0
    assert set(final["importance"]) == set(final["settings"])
    chosen = [final["settings"][k] for k in ("fusion_threshold", "solo_threshold",
                                             "cycle_time_ms", "fusion_segments")]
    assert out[0]["config"] == chosen
    doc = json.load(open(out_path))
    assert doc["settings"] == final["settings"] and doc["autotune"]["gain"] == final["gain"]
    # A later run with the file and autotune still on: the tuned values, no new search.
    env2 = {"GRADIENTFLOW_AUTOTUNE": "1", "GRADIENTFLOW_CONFIG": out_path}
    again = pools(2).run(load_tuned, env=env2, timeout=60)
    for r in again:
        assert r == {"done": True, "loaded": out_path, "hook": False, "config": chosen}


def test_config_file_round_trip_and_precedence(tmp_path):
    from gradientflow.config import Config, read_config_file, write_config_file

    path = str(tmp_path / "c.json")
    tuned = {"fusion_threshold": 8 * 2**20, "solo_threshold": 2**20, "cycle_time_ms": 1.5,
             "fusion_segments": 3}
    write_config_file(path, tuned, {"autotune": {"gain": 0.1}})
    assert read_config_file(path) == {"gradientflow_config": 1, "settings": tuned,
                                      "autotune": {"gain": 0.1}}
    cfg = Config.resolve(environ={"GRADIENTFLOW_CONFIG": path})
    assert {k: getattr(cfg, k) for k in tuned} == tuned and cfg.config_file == path
    assert Config.resolve({"config_file": path}, environ={}).fusion_segments == 3
    # Environment above the file, explicit options above both, defaults below.
    env = {"GRADIENTFLOW_CONFIG": path, "GRADIENTFLOW_CYCLE_TIME_MS": "7"}
    cfg = Config.resolve({"fusion_segments": 1}, environ=env)
    assert (cfg.cycle_time_ms, cfg.fusion_segments, cfg.solo_threshold) == (7.0, 1, 2**20)
    assert cfg.sync_fusion_limit == Config().sync_fusion_limit


@pytest.mark.parametrize("doc, words", [
    ({"gradientflow_config": 1, "settings": {"fusion_treshold": 1}}, "fusion_treshold"),
    ({"gradientflow_config": 1, "settings": {"autotune": True}}, "'autotune'"),
    ({"gradientflow_config": 1, "settings": {"fusion_segments": 99}}, "fusion_segments"),
    ({"settings": {}}, "not a gradientflow settings file"),
])
def test_bad_config_file_names_the_file_and_the_entry(tmp_path, doc, words):
    from gradientflow.config import Config

    path = str(tmp_path / "bad.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(ValueError) as info:
        Config.resolve(environ={"GRADIENTFLOW_CONFIG": path})
    assert path in str(info.value) and words in str(info.value)
    with pytest.raises(ValueError, match="cannot be read"):
        Config.resolve(environ={"GRADIENTFLOW_CONFIG": str(tmp_path / "missing.json")})


def test_unknown_autotune_variable_is_refused():
    from gradientflow.config import Config

    with pytest.raises(ValueError, match="GRADIENTFLOW_AUTOTUNE_TRIAL"):
        Config.resolve(environ={"GRADIENTFLOW_AUTOTUNE_TRIAL": "3"})
    with pytest.raises(ValueError, match="autotune_sampler"):
        Config.resolve({"autotune_sampler": "random"}, environ={})


def test_space_never_tunes_density_and_round_trips_values():
    from gradientflow.autotune import space

    with pytest.raises(ValueError, match="density"):
        space.params_of(["density"])
    ps = space.params_of(None)
    vals = {"fusion_threshold": 3 * 2**20 + 1, "solo_threshold": 2**20, "cycle_time_ms": 0.3,
            "fusion_segments": 2}
    assert space.decode(ps, space.encode(ps, vals)) == vals
    assert space.decode(ps, [1e12, 0, 1e9, 7])["fusion_segments"] == 4


def reconfigure_only_when_quiet(rank, world):
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of
    from gradientflow.errors import EngineError

    backend = backend_of()
    engine = backend.engine
    t = torch.ones(5)
    # Holding the engine's (reentrant) lock keeps its thread from taking the deferred op.
    with engine.lock:
        work = dist.all_reduce(t, async_op=True)
        try:
            engine.reconfigure(backend.config.replace(fusion_segments=1))
            raised = None
        except EngineError as exc:
            raised = str(exc)
    work.wait()
    assert torch.equal(t, torch.full((5,), float(world)))
    backend.reconfigure(backend.config.replace(fusion_segments=1, fusion_threshold=64))
    assert engine.config.fusion_segments == 1 and engine.queue._threshold == 64
    xs = [torch.full((20,), float(i)) for i in range(4)]  # now each is its own eager op
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for i, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        assert torch.equal(x, torch.full((20,), float(i * world)))
    return raised


def test_reconfigure_refuses_while_ops_are_queued(pools):
    for r, msg in enumerate(pools(2).run(reconfigure_only_when_quiet, timeout=60)):
        assert msg is not None and f"rank {r}: reconfigure()" in msg and "drain()" in msg


def test_block_score_drops_the_slow_half_and_the_race_keeps_defaults_within_the_margin():
    from gradientflow.autotune.tuner import block_score

    assert block_score([1.0, 9.0, 2.0, 50.0]) == 1.5  # two bursts do not move it
    assert block_score([3.0]) == 3.0 and block_score([2.0, 4.0, 9.0]) == 3.0


@needs_optuna
@pytest.mark.parametrize("ratios, chosen", [((0.99, 0.98), 0), ((0.9, 0.95), 1),
                                             ((1.2, 0.9), 0), ((0.95, 0.9), 1)])
def test_race_picks_the_lowest_median_ratio_beyond_the_margin(ratios, chosen):
    """Two race rounds of the defaults and one candidate: the candidate's times are the
    defaults' times scaled by `ratios` (the defaults' own time moves between rounds)."""
    from gradientflow.autotune.search import Search
    from gradientflow.autotune.space import params_of

    ps = params_of(["cycle_time_ms"])
    search = Search(ps, {"cycle_time_ms": 3.0}, trials=2, seed=0, sampler="tpe", rounds=2,
                    finalists=1)
    search.record(0.2, [0.2], [])  # the defaults' trial
    search.next()
    search.record(0.1, [0.1], [])  # the searched one: a lucky low score
    plan = []
    while (s := search.next()) is not None:
        plan.append(s)
        kind, settings, cand = search._current
        rnd = sum(r.get("candidate") == cand for r in search.records)
        base = [1.0, 3.0][rnd]
        search.record(base * (ratios[rnd] if cand else 1.0), [0.0], [])
    assert len(plan) == 4
    summary = search.summary()
    assert summary["settings"] == summary["finalists"][chosen]


def test_algorithm_is_a_choice_only_where_the_topology_offers_one():
    from gradientflow.autotune import space

    assert space.algorithm_choices(1, 4, 0) == ("ring",)  # one host: nothing to choose
    assert space.algorithm_choices(4, 1, 0) == ("ring",)  # one rank per host: no hierarchy
    assert space.algorithm_choices(2, 4, 0) == ("ring", "auto", "hierarchical")
    assert space.algorithm_choices(1, 4, 2) == ("ring", "auto", "reduction_server")
    p = space.with_choices(space.PARAMS["algorithm"], space.algorithm_choices(2, 4, 2))
    assert p.choices == ("ring", "auto", "hierarchical", "reduction_server")
    ps = (p, space.PARAMS["chunk_size"])
    vals = {"algorithm": "hierarchical", "chunk_size": 2048}
    assert space.decode(ps, space.encode(ps, vals)) == vals
    assert space.decode(ps, [9.0, 1e9]) == {"algorithm": "reduction_server", "chunk_size": 4096}
