"""One registry entry per method: a newly registered one is usable from config, hook, optimizer."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gradientflow.compression import (CompressionConfig, Compressor, Options, available, lookup,
                                      register_compressor, registry)
from gradientflow.engine.stages import drive_lockstep


@pytest.fixture
def toy(monkeypatch):
    """Register a toy method (a dense average that counts its calls); forget it afterwards."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_BY_NAME", dict(registry._BY_NAME))

    @dataclasses.dataclass(frozen=True)
    class ToyOptions(Options):
        scale: float = 1.0  # what the toy multiplies the average by

        def __post_init__(self):
            if not self.scale > 0:
                raise ValueError(f"CompressionConfig: scale={self.scale!r} must be > 0")

    @register_compressor("toy", options=ToyOptions, aliases=("toy-alias",))
    class Toy(Compressor):
        calls = 0

        def reduce(self, flat, layout, *, loss_scale=1.0):
            layout.check(flat, "Toy.reduce")
            type(self).calls += 1
            self.stats.add_bucket(numel=flat.numel())
            flat.div_(self.world_size / self.config.scale)
            return (yield from self._stage(flat))

    return Toy


def test_builtin_entries_hold_compressor_state_and_names():
    import gradientflow.hooks as hooks

    assert set(available()) >= {"csc", "fp16", "none"}
    assert lookup("csc").state is hooks.CSCState and lookup("csc").hook is hooks.csc_hook
    assert lookup("fp16").state is hooks.FP16State
    assert lookup("none").dense and not lookup("csc").dense
    assert lookup("powersgd").options.names()[0] == "rank"
    with pytest.raises(ValueError, match="not registered"):
        lookup("topk")


def test_a_registered_method_is_usable_from_config_hook_and_optimizer(toy):
    import gradientflow.hooks as hooks
    import gradientflow.optim as gfo

    cfg = CompressionConfig(method="toy-alias")
    assert cfg.method == "toy" and "toy" in available()

    # The hook: register() builds the generic state for it; two simulated ranks average.
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    states = [hooks.CompressionState(None, cfg, world_size=2, rank=r) for r in range(2)]

    class Bucket:
        def __init__(self, params, grads):
            self._p, self._b = params, torch.cat([g.reshape(-1) for g in grads])

        def index(self):
            return 0

        def buffer(self):
            return self._b

        def parameters(self):
            return self._p

        def is_last(self):
            return True

    grads = [[torch.full(p.shape, float(r + 1)) for p in m.parameters()]
             for r, m in enumerate(models)]
    outs = drive_lockstep([s._stages(Bucket(list(m.parameters()), g))
                           for s, m, g in zip(states, models, grads)])
    assert all(torch.allclose(o, torch.full_like(o, 1.5)) for o in outs)
    assert toy.calls == 2 and states[0].stats()["steps"] == 1

    # The optimizer (one process, no group): by name, through the toy compressor.
    model = torch.nn.Linear(3, 2)
    opt = gfo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="toy")
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert toy.calls == 3


def test_a_method_registers_its_own_options_checked_where_they_are_declared(toy):
    assert CompressionConfig(method="toy", scale=2.0).scale == 2.0
    assert CompressionConfig(method="toy").scale == 1.0
    with pytest.raises(ValueError, match=r"scale=0 must be > 0"):
        CompressionConfig(method="toy", scale=0)
    with pytest.raises(ValueError, match=r"method 'toy' has no option 'density'.*\['scale'\]"):
        CompressionConfig(method="toy", density=0.1)


def test_register_refuses_options_that_are_not_an_options_dataclass():
    with pytest.raises(TypeError, match="options must be a dataclass subclass"):
        register_compressor("bad", options=dict)


def test_register_refuses_a_taken_name(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("toy")(type("Other", (toy,), {}))
    with pytest.raises(ValueError, match="alias 'toy-alias'"):
        register_compressor("other", aliases=("toy-alias",))(type("Other", (toy,), {}))
