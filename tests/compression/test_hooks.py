"""The hook states: names bound from the model, layouts from buckets, checkpointable, pickle without
the group."""

from __future__ import annotations

import pickle

import pytest
import torch

from gradientflow.compression import CompressionConfig
from gradientflow.engine.stages import drive_lockstep
from gradientflow.hooks import CompressionState, CSCState, FP16State, csc_hook, fp16_hook, register


class Bucket:
    """The part of DDP's GradBucket a hook uses."""

    def __init__(self, index, params, last, grads):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last


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
        per_rank.append(
            [Bucket(0, params[4:], False, grads[4:]), Bucket(1, params[:4], True, grads[:4])]
        )
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
    bad = Bucket(0, list(m.parameters())[:1], True, [torch.zeros(7)])
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
    state = register(ddp, CompressionConfig(method="csc", density=0.1))
    assert isinstance(state, CSCState) and ddp.hooks == [(state, csc_hook)]
    assert set(state._names.values()) == {n for n, _ in ddp.module.named_parameters()}
    s2 = register(FakeDDP(_model()), CompressionConfig(method="none"))
    assert type(s2) is CompressionState


def test_epoch_drives_the_warmup_and_stats_report_it():
    models = [_model()]
    s = CSCState(None, density=0.05, chunk_size=16, warmup_unit="epoch", warmup_period=1)
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


def test_momentum_moves_from_the_optimizer_into_the_compressor():
    """register(..., optimizer=opt) / optimizer=: momentum is applied once, by the compressor."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.95, nesterov=True)
    s = CSCState(None, density=0.05, optimizer=opt)
    assert s.config.momentum == 0.95 and s.config.nesterov and s.config.momentum_correction
    assert all(g["momentum"] == 0.0 and not g["nesterov"] for g in opt.param_groups)
    _sgd_step(model, opt)  # no guard: the optimizer was bound
    again = CSCState(None, density=0.05, optimizer=opt)  # a second binding finds the value
    assert again.config.momentum == 0.95
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum to move: plain EF
    assert not CSCState(None, optimizer=plain).config.momentum_correction
    with pytest.raises(ValueError, match=r"momentum=0.9\) but SGD has momentum=0.8"):
        CSCState(None, CompressionConfig(momentum=0.9),
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.8))
    with pytest.raises(ValueError, match="no 'momentum' setting"):
        CSCState(None, optimizer=torch.optim.Adam(model.parameters()))
    adam = CSCState(None, CompressionConfig(momentum_correction=False),
                    optimizer=torch.optim.Adam(model.parameters()))
    assert not adam.config.momentum_correction
    assert FP16State(None, optimizer=torch.optim.Adam(model.parameters())).config.method == "fp16"


def test_unbound_momentum_optimizer_step_raises_saying_what_to_change():
    model = _model()
    s = CSCState(None, density=0.05)
    s.bind_parameter_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match=r"optimizer=opt"):
        _sgd_step(model, opt)
    _sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # momentum-free: fine
    _sgd_step(_model(), torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9))  # not ours
    off = CSCState(None, density=0.05, momentum_correction=False)
    off.bind_parameter_names(model)
    del s
    import gc
    gc.collect()  # the guard dies with its state
    _sgd_step(model, opt)
