"""The hook states: names bound from the model, layouts from buckets, checkpointable, pickle without
the group."""

from __future__ import annotations

import pickle

import pytest
import torch

from compression_helpers import FakeBucket
from gradientflow.compression import CompressionConfig
from gradientflow.engine.stages import drive_lockstep
from gradientflow.hooks import CompressionState, CSCState, FP16State, csc_hook, fp16_hook, register


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 50), torch.nn.BatchNorm1d(50), torch.nn.Linear(50, 3)
    )


def _step(states, models, seed):
    gen = torch.Generator().manual_seed(seed)
    per_rank = []
    for m in models:
        params = list(m.parameters())
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        per_rank.append([FakeBucket(0, params[4:], False, grads[4:]),
                         FakeBucket(1, params[:4], True, grads[:4])])
    outs = []
    for b in range(2):
        outs.append(drive_lockstep([s._stages(per_rank[r][b]) for r, s in enumerate(states)]))
    return outs


def test_state_validates_at_construction():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        CSCState(None, density=2.0)
    with pytest.raises(ValueError, match="either config or"):
        CSCState(None, CompressionConfig(), density=0.1)
    with pytest.raises(ValueError, match="this state is for 'csc'"):
        CSCState(None, CompressionConfig(method="fp16"))
    assert FP16State(None).config.method == "fp16"
    with pytest.raises(TypeError, match="CSCState"):
        csc_hook(FP16State(None), None)
    with pytest.raises(TypeError, match="FP16State"):
        fp16_hook(CSCState(None), None)


def test_names_come_from_the_model_and_survive_pickle():
    models = [_model() for _ in range(2)]
    states = [CSCState(None, world_size=2, rank=r, density=0.2, chunk_size=16, warmup_densities=())
              for r in range(2)]
    for s, m in zip(states, models):
        s.bind_parameter_names(m)
    for t in range(3):
        _step(states, models, t)
    sd = states[0].state_dict()
    assert set(sd["memory"]["residual"]) == {n for n, _ in models[0].named_parameters()}
    assert sd["step"] == 3 and states[0].stats()["steps"] == 3
    states[0].process_group = object()  # a process group cannot be pickled: __getstate__ drops it
    clone = pickle.loads(pickle.dumps(states[0]))
    assert clone.process_group is None
    assert set(clone.state_dict()["memory"]["residual"]) == set(sd["memory"]["residual"])


def test_unbound_names_are_first_appearance_and_stable():
    models = [_model()]
    a = CSCState(None, density=0.2, chunk_size=16, warmup_densities=())
    _step([a], models, 0)
    b = CSCState(None, density=0.2, chunk_size=16, warmup_densities=())
    _step([b], models, 0)
    assert set(a.state_dict()["memory"]["residual"]) == set(b.state_dict()["memory"]["residual"])
    assert "param0" in a.state_dict()["memory"]["residual"]


def test_bucket_that_its_parameters_do_not_describe_is_refused():
    m = _model()
    s = CSCState(None)
    bad = FakeBucket(0, list(m.parameters())[:1], True, [torch.zeros(7)])
    with pytest.raises(ValueError, match="add up to"):
        s._stages(bad)


def test_non_float32_model_is_refused_at_registration():
    m = _model().double()
    with pytest.raises(ValueError, match="float32"):
        CSCState(None).bind_parameter_names(m)


def test_register_binds_names_and_registers_the_hook():
    class FakeDDP:
        def __init__(self, module):
            self.module = module
            self.process_group = None
            self.hooks = []

        def register_comm_hook(self, state, hook):
            self.hooks.append((state, hook))

    ddp = FakeDDP(_model())
    state = register(ddp, CompressionConfig(method="csc", density=0.1, min_numel=0))
    assert isinstance(state, CSCState) and ddp.hooks == [(state, csc_hook)]
    assert set(state._names.values()) == {n for n, _ in ddp.module.named_parameters()}
    s2 = register(FakeDDP(_model()), CompressionConfig(method="none"))
    assert type(s2) is CompressionState


def test_epoch_drives_the_warmup_and_stats_report_it():
    models = [_model()]
    s = CSCState(None, density=0.05, chunk_size=16, warmup_unit="epoch", warmup_period=1,
                 min_numel=0)
    with pytest.raises(RuntimeError, match="set_epoch"):
        _step([s], models, 0)  # refused on the caller's thread, before any bucket is reduced
    s.set_epoch(0)
    _step([s], models, 0)
    assert s.stats()["density_in_force"] == 1.0
    s.set_epoch(10)
    _step([s], models, 1)
    st = s.stats()
    assert st["density_in_force"] == 0.05 and st["steady_steps"] == 1 and st["steps"] == 2
    assert st["steady"]["ratio"] > st["average"]["ratio"] > 1


def test_state_takes_kernel_threads_from_its_groups_config(monkeypatch):
    """The group's own Config (its pg_options) sets the kernels' threads, not the environment."""
    import dataclasses

    import gradientflow.backend.registry as registry
    from gradientflow import kernels
    from gradientflow.config import Config

    cfg = dataclasses.replace(Config.resolve({}), kernel_threads=1)
    monkeypatch.setattr(registry, "config_of", lambda group=None: cfg)
    seen = []
    monkeypatch.setattr(kernels, "set_num_threads", seen.append)
    CSCState(None, density=0.5)
    assert seen == [1]


def test_steps_drive_the_default_warmup_without_set_epoch():
    models = [_model()]
    s = CSCState(None, density=0.05, chunk_size=16)
    seen = []
    for t in range(s.config.warmup_length + 1):
        _step([s], models, t)
        seen.append(s.stats()["density_in_force"])
    p = s.config.warmup_period
    assert seen[0] == 1.0 and seen[p] == 0.25 and seen[-1] == 0.05


def _sgd_step(model, opt):
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def _hook_step(state, model, seed=0):
    """One backward's gradients through `state` (one rank, two buckets) into p.grad."""
    (out0, out1) = _step([state], [model], seed)
    params = list(model.parameters())
    for bucket_params, out in ((params[4:], out0[0]), (params[:4], out1[0])):
        off = 0
        for p in bucket_params:
            p.grad = out[off:off + p.numel()].view_as(p).clone()
            off += p.numel()


def test_the_compressor_follows_the_optimizers_momentum():
    """register(..., optimizer=opt) / optimizer=: momentum and weight decay are applied once,
    by the compressor, with the values the optimizer's groups hold at each step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.95, nesterov=True,
                          weight_decay=1e-3)
    s = CSCState(None, density=0.05, optimizer=opt, momentum_correction=True)
    s.bind_parameter_names(model)
    assert s.config.momentum == 0.95 and s.config.nesterov and s.config.momentum_correction
    # The groups keep the user's settings (schedulers and checkpoints see them) ...
    assert all(g["momentum"] == 0.95 and g["nesterov"] and g["weight_decay"] == 1e-3
               for g in opt.param_groups)
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([(g["momentum"], g["weight_decay"]) for g in o.param_groups]))
    _hook_step(s, model)
    opt.step()
    # ... and hold 0 only while the optimizer's own step runs.
    assert seen == [[(0.0, 0.0)]] and opt.param_groups[0]["momentum"] == 0.95
    assert not opt.state or all("momentum_buffer" not in st for st in opt.state.values())
    with pytest.raises(RuntimeError, match="did not reduce"):
        _sgd_step(model, opt)  # no backward through the compressor since the last step
    _hook_step(s, model, seed=1)
    opt.param_groups[0]["momentum"] = 0.9  # a scheduler stepped before the optimizer
    with pytest.raises(RuntimeError, match=r"changed between backward\(\) and step\(\).*0.95 -> "
                                           r"0.9.*scheduler.step\(\) after optimizer.step\(\)"):
        opt.step()
    assert opt.param_groups[0]["momentum"] == 0.9  # a refused step leaves the groups alone
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum to follow: plain EF
    assert not CSCState(None, optimizer=plain, momentum_correction=True).config.momentum_correction
    assert FP16State(None, optimizer=torch.optim.Adam(model.parameters())).config.method == "fp16"


def test_what_the_compressor_cannot_follow_is_refused_naming_the_fix():
    model = _model()
    params = list(model.parameters())

    class LARSLike(torch.optim.SGD):  # its own step: the compressor cannot reproduce it
        def step(self, closure=None):
            return super().step(closure)

    class Renamed(torch.optim.SGD):  # SGD's own step under another name: followed
        pass

    fix = r"momentum_correction=False"
    refused = {
        "does not step as torch.optim.SGD": torch.optim.Adam(params),
        "does not step as torch.optim.SGD.*own step": LARSLike(params, lr=0.1, momentum=0.9),
        "dampening=0.1": torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1),
        r"different \(momentum, nesterov\) settings": torch.optim.SGD(
            [{"params": params[:2], "momentum": 0.5}, {"params": params[2:]}], lr=0.1,
            momentum=0.9),
    }
    for what, opt in refused.items():
        with pytest.raises(ValueError, match=f"{what}.*{fix}"):
            CSCState(None, density=0.05, optimizer=opt, momentum_correction=True)
    with pytest.raises(ValueError, match=r"momentum=0.9\) but SGD has momentum=0.8"):
        CSCState(None, CompressionConfig(momentum=0.9, momentum_correction=True),
                 optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.8))
    assert CSCState(None, optimizer=Renamed(params, lr=0.1, momentum=0.9),
                    momentum_correction=True).config.momentum == 0.9
    adam = CSCState(None, CompressionConfig(momentum_correction=False,
                                            allow_adaptive_optimizer=True),
                    optimizer=torch.optim.Adam(params))
    assert not adam.config.momentum_correction
    # Per-group momenta that a scheduler makes differ are refused at the step that sees them.
    opt = torch.optim.SGD([{"params": params[:4]}, {"params": params[4:]}], lr=0.1, momentum=0.9)
    s = CSCState(None, density=0.05, optimizer=opt, momentum_correction=True)
    s.bind_parameter_names(model)
    opt.param_groups[1]["momentum"] = 0.8
    with pytest.raises(ValueError, match="different.*settings"):
        _hook_step(s, model)


def test_the_default_leaves_momentum_to_the_optimizer_and_follows_its_rates():
    """Momentum correction off (the default): the optimizer applies its own momentum and weight
    decay, and each residual is still kept in its group's learning-rate units."""
    model = _model()
    opt = torch.optim.SGD([{"params": list(model.parameters())[:4], "lr": 0.1},
                           {"params": list(model.parameters())[4:], "lr": 0.02}],
                          momentum=0.9, weight_decay=1e-3)
    s = CSCState(None, density=0.05, optimizer=opt)
    s.bind_parameter_names(model)
    assert not s.config.momentum_correction
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([(g["momentum"], g["weight_decay"]) for g in o.param_groups]))
    _hook_step(s, model)
    opt.step()
    assert seen == [[(0.9, 1e-3), (0.9, 1e-3)]]  # the user's settings during its own step
    assert all("momentum_buffer" in st for st in opt.state.values())
    rates = s.compressor.residual_lr
    assert set(rates.values()) == {0.1, 0.02} and len(rates) == len(list(model.parameters()))
    opt.param_groups[0]["lr"] = 0.05  # a decay: what waits keeps its update
    _hook_step(s, model, seed=1)
    assert set(s.compressor.residual_lr.values()) == {0.05, 0.02}


def test_a_newer_binding_replaces_the_older_one():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    old = CSCState(None, density=0.05, optimizer=opt, momentum_correction=True)
    old.bind_parameter_names(model)
    new = CSCState(None, density=0.05, optimizer=opt, momentum_correction=True)
    new.bind_parameter_names(model)
    assert new.config.momentum == 0.9  # the groups still say 0.9
    _hook_step(new, model)
    opt.step()
    with pytest.raises(RuntimeError, match="bound to another compression state"):
        _hook_step(old, model)


def test_unbound_momentum_optimizer_step_raises_saying_what_to_change():
    model = _model()
    s = CSCState(None, density=0.05, momentum_correction=True)
    s.bind_parameter_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match=r"momentum=0.9 again.*optimizer=opt"):
        _sgd_step(model, opt)
    with pytest.raises(RuntimeError, match=r"weight_decay=0.01 after the velocity.*optimizer=opt"):
        _sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01))
    with pytest.raises(RuntimeError, match=r"Adam would step on the velocity.*optimizer=opt"):
        _sgd_step(model, torch.optim.Adam(model.parameters()))
    _sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # momentum-free: fine
    _sgd_step(_model(), torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9))  # not ours
    off = CSCState(None, density=0.05, momentum_correction=False)
    off.bind_parameter_names(model)
    del s
    import gc
    gc.collect()  # the guard dies with its state
    _sgd_step(model, opt)


def test_csc_refuses_adam_family_optimizers_naming_what_works_unless_allowed():
    """CSC beside Adam/AdamW (and subclasses, and a ZeRO wrapping one) is refused at
    registration with what works; allow_adaptive_optimizer=True, another method, SGD, or no
    optimizer at all (nothing to decide) are accepted."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class FakeDDP:
        def __init__(self, module):
            self.module, self.process_group, self.hooks = module, None, []

        def register_comm_hook(self, state, hook):
            self.hooks.append((state, hook))

    model = _model()
    params = list(model.parameters())

    class MyAdamW(torch.optim.AdamW):
        pass

    class FakeZero(ZeroRedundancyOptimizer):  # only what the check reads: the local optimizer
        def __init__(self, optim):
            self.optim = optim

    works = r"method='fp16'.*density=1.0.*SGD with momentum.*allow_adaptive_optimizer=True"
    for opt in (torch.optim.Adam(params), torch.optim.AdamW(params), MyAdamW(params),
                FakeZero(torch.optim.AdamW(params))):
        ddp = FakeDDP(_model())
        with pytest.raises(ValueError, match=rf"rank 0.*'csc' at density 0.01 with "
                                             rf"{type(opt).__name__}.*{works}"):
            register(ddp, CompressionConfig(method="csc", density=0.01), optimizer=opt)
        assert ddp.hooks == []  # nothing registered
        with pytest.raises(ValueError, match=works):
            CSCState(None, density=0.05, optimizer=opt)
    adamw = torch.optim.AdamW(params)
    ddp = FakeDDP(_model())
    allowed = register(ddp, CompressionConfig(method="csc", allow_adaptive_optimizer=True),
                       optimizer=adamw)
    assert isinstance(allowed, CSCState) and ddp.hooks == [(allowed, csc_hook)]
    assert allowed.config.allow_adaptive_optimizer
    assert register(FakeDDP(_model()), CompressionConfig(method="fp16"),
                    optimizer=adamw).config.method == "fp16"
    assert register(FakeDDP(_model()), CompressionConfig(method="csc")).config.method == "csc"
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert not register(FakeDDP(_model()), optimizer=sgd).config.allow_adaptive_optimizer
    with pytest.raises(ValueError, match="allow_adaptive_optimizer=1 must be True or False"):
        CompressionConfig(method="csc", allow_adaptive_optimizer=1)
