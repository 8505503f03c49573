"""Compression under FSDP2 and HSDP through gradientflow.hooks.register, on CPU ranks.

FSDP2 on 2 ranks and HSDP on 4 (2 replicas x 2 shards): at density 1 on an FP32 wire the run
equals plain FSDP2 on gloo; at 1% the replicas stay identical and the loss falls; a DCP round
trip of model, optimizer and compression state resumes exactly; bad input is refused at
registration with a sentence.
"""
from __future__ import annotations

import pytest
import torch

from gradientflow.hooks.fsdp_checks import HOOKS  # noqa: E402

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not all(hasattr(fsdp.FSDPModule, h) for h in HOOKS):  # pragma: no cover
    pytest.skip(f"torch {torch.__version__}'s FSDP2 lacks a hook registration calls",
                allow_module_level=True)

STEPS = 80  # the exactness run; the model is tiny so it takes seconds
DIM = 32
OUT = 5  # uneven over 2 shards: FSDP pads the head's rows, and so do the layouts


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, DIM), torch.nn.ReLU(),
                               torch.nn.Linear(DIM, DIM), torch.nn.ReLU(),
                               torch.nn.Linear(DIM, OUT))


def _teacher(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, OUT, generator=g)
    return torch.tanh(x @ w)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, _teacher(x)


def _shard(model, mesh=None, **kw) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _mesh(world: int, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _config(**kw):
    from gradientflow.compression import CompressionConfig

    base = dict(chunk_size=16, min_numel=0, warmup_densities=())
    if kw.get("method", "csc") != "csc":
        base = {}  # CSC's options: the other methods have none of them
    base.update(kw)
    return CompressionConfig(**base)


def _step(model, opt, rank: int, step: int) -> float:
    x, y = _batch(rank, step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def train(rank, world, hsdp: bool, cfg: dict | None, steps: int, lr: float = 0.05):
    """Rank body: `steps` SGD steps of the tiny model, plain (cfg None) or registered with
    CompressionConfig(**cfg); the full parameters, this rank's shards and the losses."""
    import gradientflow.hooks as hooks

    model = _shard(_model(), _mesh(world, hsdp))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = hooks.register(model, _config(**cfg), optimizer=opt) if cfg is not None else None
    losses = [_step(model, opt, rank, s) for s in range(steps)]
    local = [p.to_local().detach().clone() for p in model.parameters()]
    state_bytes = shard_bytes = 0
    if state is not None:  # the compressors' state, against one FP32 copy of the shard
        state_bytes = state.state_bytes()
        shard_bytes = sum(u.shard_layout.numel * 4 for u in state.units)
    return {"full": _full(model), "local": local, "losses": losses,
            "stats": state.stats() if state is not None else None,
            "state_bytes": state_bytes, "shard_bytes": shard_bytes}


EXACT = dict(method="csc", density=1.0, wire_dtype="fp32", dense_wire_dtype="fp32")


@pytest.mark.parametrize("world,hsdp,cfg", [
    (2, False, EXACT),
    (4, True, EXACT),
    (4, True, dict(method="none")),
], ids=["fsdp2-csc", "hsdp-csc", "hsdp-none"])
def test_density_one_on_an_fp32_wire_equals_plain_fsdp_on_gloo(pools, world, hsdp, cfg):
    want = pools(world).run(train, hsdp, None, STEPS, backend="gloo", timeout=240)
    got = pools(world).run(train, hsdp, cfg, STEPS, timeout=240)
    for rank, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(g["full"], w["full"])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} parameter {i}: {m}")


def test_hsdp_csc_at_one_percent_keeps_replicas_identical_and_the_loss_falls(pools):
    runs = pools(4).run(train, True, dict(method="csc", density=0.01), 60, 0.1, timeout=240)
    # ranks (replica, shard): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    for a, b in ((0, 2), (1, 3)):
        for i, (x, y) in enumerate(zip(runs[a]["local"], runs[b]["local"])):
            assert torch.equal(x, y), f"ranks {a} and {b} (replicas) differ in parameter {i}"
    losses = runs[0]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"
    replicate = runs[0]["stats"]["replicate"]
    assert replicate["steady"] and replicate["ratio"] > 5, replicate
    for rank, run in enumerate(runs):  # the residual beside the shard, no spare: one copy
        assert run["state_bytes"] == run["shard_bytes"] > 0, (
            f"rank {rank}: {run['state_bytes']} bytes of compression state for a "
            f"{run['shard_bytes']}-byte FP32 shard (one copy is the goal)")


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)], ids=["fsdp2", "hsdp"])
def test_fp16_and_csc_train_and_replicas_agree(pools, world, hsdp):
    for cfg in (dict(method="fp16"), dict(method="csc", density=0.01)):
        runs = pools(world).run(train, hsdp, cfg, 40, 0.1, timeout=240)
        for a, b in ((0, 1),) if not hsdp else ((0, 2), (1, 3)):
            for i, (x, y) in enumerate(zip(runs[a]["full"], runs[b]["full"])):
                assert torch.equal(x, y), f"{cfg}: ranks {a} and {b} differ in parameter {i}"
        losses = runs[0]["losses"]
        assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), f"{cfg}: loss did not fall: {losses}"


def follow_rates(rank, world, hsdp: bool):
    """Rank body: the residuals' learning rates after the optimizer's rate changes."""
    import gradientflow.hooks as hooks

    model = _shard(_model(), _mesh(world, hsdp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hooks.register(model, _config(method="csc", density=0.05), optimizer=opt)
    for s in range(2):
        _step(model, opt, rank, s)
    for g in opt.param_groups:
        g["lr"] = 0.025
    _step(model, opt, rank, 2)
    return {f"{u.name}/{k}": sorted(set(c.residual_lr.values())) + [len(c.residual_lr)]
            for u in state.units for k, c in u.compressors().items()}


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)], ids=["fsdp2", "hsdp"])
def test_residuals_follow_the_optimizers_learning_rate(pools, world, hsdp):
    for rank, rates in enumerate(pools(world).run(follow_rates, hsdp, timeout=240)):
        assert rates, rank
        for where, (*lrs, count) in rates.items():
            assert lrs == [0.025] and count > 0, (rank, where, lrs)


def test_fp16_wire_at_fsdp2_reduce_scatter_is_close_to_fp32(pools):
    want = pools(2).run(train, False, None, 10, backend="gloo", timeout=240)
    got = pools(2).run(train, False, dict(method="fp16"), 10, timeout=240)
    for a, b in zip(got[0]["full"], want[0]["full"]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


# ---------------------------------------------------------------- checkpoints
def dcp_round_trip(rank, world, hsdp: bool, cfg: dict, ckpt_dir: str, before: int, after: int):
    """Rank body: `before` steps, a DCP save of model + optimizer + compression, `after` steps;
    then a load and the same `after` steps again. Returns both continuations."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gradientflow.hooks as hooks

    model = _shard(_model(), _mesh(world, hsdp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hooks.register(model, _config(**cfg), optimizer=opt)
    for s in range(before):
        _step(model, opt, rank, s)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "compression": state}, checkpoint_id=ckpt_dir)
    blob = state.state_dict()["gradientflow_fsdp"]  # what was saved, for the test to read
    for s in range(before, before + after):
        _step(model, opt, rank, s)
    first = _full(model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "compression": state}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for s in range(before, before + after):
        _step(model, opt, rank, s)
    again = _full(model)
    # The control: model and optimizer loaded, the compression state not: it must show.
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for s in range(before, before + after):
        _step(model, opt, rank, s)
    return {"first": first, "again": again, "without": _full(model), "blob": blob}


def dcp_load_elsewhere(rank, world, hsdp: bool, cfg: dict, ckpt_dir: str):
    """Rank body: load a checkpoint saved on another mesh; the warnings and a step's loss."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gradientflow.hooks as hooks

    model = _shard(_model(), _mesh(world, hsdp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hooks.register(model, _config(**cfg), optimizer=opt)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "compression": state}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(sd, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    blob = state.state_dict()["gradientflow_fsdp"]
    return {"warnings": [str(w.message) for w in caught], "blob": blob,
            "loss": _step(model, opt, rank, 99)}


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)], ids=["fsdp2", "hsdp"])
def test_dcp_round_trip_resumes_exactly(pools, tmp_path, world, hsdp):
    cfg = dict(method="csc", density=0.05)
    runs = pools(world).run(dcp_round_trip, hsdp, cfg, str(tmp_path / "ckpt"), 6, 4,
                            timeout=240)
    for rank, r in enumerate(runs):
        for i, (a, b) in enumerate(zip(r["again"], r["first"])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {rank} parameter {i}: {m}")
        assert any(not torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                   for a, b in zip(r["without"], r["first"])), \
            "resuming without the compression state gave the same run: the test shows nothing"


def _residual_mass(blob: bytes) -> dict:
    """{(unit, parameter): the residuals' share of the averaged gradient} of a checkpoint."""
    import io

    from gradientflow.hooks.fsdp_reshard import _mass

    saved = torch.load(io.BytesIO(blob), weights_only=False)
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    units = {u for entry in saved["ranks"] for u in entry["units"]}
    return {(u, n): m for u in units for n, m in _mass(saved, u, shapes)[0].items()}


def test_dcp_load_on_another_mesh_reshards_residuals_keeping_their_sum(pools, tmp_path):
    cfg = dict(method="csc", density=0.05)
    ckpt = str(tmp_path / "ckpt")
    saved = pools(4).run(dcp_round_trip, True, cfg, ckpt, 3, 0, timeout=240)
    want = _residual_mass(saved[0]["blob"])
    assert sum(float(m.abs().sum()) for m in want.values()) > 0
    # HSDP 2 x 2 (CSC on the replicate all-reduce) -> FSDP2 on 2 ranks (CSC on the reduce-scatter)
    runs = pools(2).run(dcp_load_elsewhere, False, cfg, ckpt, timeout=240)
    for rank, r in enumerate(runs):
        text = " ".join(r["warnings"])
        assert "resharded" in text and "no gradient is lost" in text, (rank, r["warnings"])
        got = _residual_mass(r["blob"])
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-9,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
        assert r["loss"] == r["loss"]  # finite: training continues
    # Another method cannot take the residuals: dropped, and the warning says what it costs.
    runs = pools(2).run(dcp_load_elsewhere, False, dict(method="fp16"), ckpt, timeout=240)
    for rank, r in enumerate(runs):
        text = " ".join(r["warnings"])
        assert "dropped" in text and "steps of unsent gradient" in text, (rank, r["warnings"])


# ---------------------------------------------------------------- bad input
def test_a_torch_without_the_hooks_is_refused_with_the_version_that_has_them(monkeypatch):
    from gradientflow.hooks import fsdp_checks

    class OldFSDPModule:  # a torch whose FSDP2 has the all-reduce hook only
        set_all_reduce_hook = None

    monkeypatch.setattr(fsdp_checks, "_fsdp_module_class", lambda: OldFSDPModule)
    with pytest.raises(ValueError, match=r"lacks FSDPModule\.set_custom_reduce_scatter.*2\.14"):
        fsdp_checks.find_groups(torch.nn.Linear(2, 2))


def refusals(rank, world):
    """Rank body: each bad setup's error sentence (None where registration went through)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    import gradientflow.hooks as hooks

    mesh = _mesh(world, False)
    out = {}

    def attempt(key, build, cfg=None):
        try:
            model = build()
            hooks.register(model, cfg or _config(method="csc", density=0.01))
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)

    attempt("offload", lambda: _shard(_model(), mesh, offload_policy=CPUOffloadPolicy(
        pin_memory=False)))
    attempt("mixed", lambda: _shard(_model(), mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)))
    attempt("mixed_fp32_reduce", lambda: _shard(_model(), mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))

    def several_groups():
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                       ShardPlacementResult)
        from torch.distributed.tensor import Shard

        # the biases on a mesh of their own process group: a second parameter group
        other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
        info = FSDPMeshInfo(other, shard_mesh_dim=0)

        def place(p):
            return ShardPlacementResult(Shard(0), info) if p.ndim == 1 else None

        return _shard(_model(), mesh, shard_placement_fn=place)

    attempt("several_groups", several_groups)

    def no_all_reduce():
        model = _shard(_model(), _mesh(world, False))
        model[0].set_gradient_divide_factor(3.0)
        return model

    attempt("divide_factor", no_all_reduce)
    attempt("momentum_correction", lambda: _shard(_model(), mesh),
            _config(method="csc", momentum_correction=True))

    def accumulate():  # works: returns the losses of an accumulated step
        model = _shard(_model(), mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hooks.register(model, _config(method="csc", density=1.0, wire_dtype="fp32",
                                      dense_wire_dtype="fp32"), optimizer=opt)
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = _batch(rank, micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return _full(model)

    out["accumulated"] = accumulate()
    return out


def plain_accumulate(rank, world):
    """Rank body: the same accumulated step, plain FSDP2 on gloo."""
    model = _shard(_model(), _mesh(world, False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        x, y = _batch(rank, micro)
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return _full(model)


def test_bad_input_is_refused_with_a_sentence_and_accumulation_works(pools):
    runs = pools(2).run(refusals, timeout=240)
    want_acc = pools(2).run(plain_accumulate, backend="gloo", timeout=240)
    for rank, out in enumerate(runs):
        assert "CPUOffloadPolicy" in out["offload"] and f"rank {rank}" in out["offload"]
        assert "reduce_dtype=torch.float32" in out["mixed"]
        assert out["mixed_fp32_reduce"] is None  # bf16 compute, fp32 reduction: works
        assert "one mesh" in out["several_groups"]
        assert "divide_factor" in out["divide_factor"]
        assert "momentum_correction=False" in out["momentum_correction"]
        for a, b in zip(out["accumulated"], want_acc[rank]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
