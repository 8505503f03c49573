"""One table of algorithms: a newly registered one (its entry, then what runs it attached) is
accepted by the config, routed by the channel, weighed by auto, offered by autotune and
modelled by the simulator."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gradientflow import algorithm_registry as registry
from gradientflow.algorithms import Algorithms
from gradientflow.config import Config


@pytest.fixture
def toy(monkeypatch):
    """Register "toy": ring under another name, free everywhere, offered on any topology."""
    monkeypatch.setattr(registry, "_TABLE", dict(registry._TABLE))
    sent = []

    class Handler:
        def __init__(self, channel):
            self.channel = channel

        def allreduce(self, device, tensors, opts):
            sent.append(tensors[0].numel())
            return "toy work"

    ring = registry.lookup("ring")
    algo = registry.register(registry.Algorithm(
        "toy", "ring by another name", cost=lambda *a: 0.0, simulate=ring.simulate,
        sim_bytes=ring.sim_bytes))
    registry.attach("toy", build=Handler, carries=lambda t, o: t.device.type == "cpu")
    return algo, sent


def test_the_builtin_table():
    assert registry.names() == ("ring", "hierarchical", "reduction_server", "auto")
    assert registry.simulated() == ("ring", "hierarchical", "reduction_server")
    assert registry.offered(2, 4, 2) == ("ring", "auto", "hierarchical", "reduction_server")
    assert registry.offered(1, 8, 0) == ("ring",)
    with pytest.raises(ValueError, match="'tree' is not registered; known: ring, hier"):
        registry.lookup("tree")


def test_a_registered_algorithm_is_usable_everywhere(toy):
    from gradientflow.algorithms.auto import choose
    from gradientflow.autotune import space
    from gradientflow.simulate.cluster import Cluster, Method
    from gradientflow.simulate.collectives import allreduce_time

    _, sent = toy
    cfg = Config.resolve({"algorithm": "toy"}, environ={})
    assert cfg.algorithm == "toy"
    algos = Algorithms(cfg, None, 0, 4, 10.0, None, "g")
    send = algos.channel("fused", lambda device: None)
    assert send(torch.device("cpu")).allreduce([torch.ones(5)], None) == "toy work"
    assert sent == [5]
    # a message it does not carry goes to ring, counted as the fallback
    assert algos._channels[0].pick(torch.empty(3, device="meta"), None) == "ring_fallback"
    assert choose(10**6, 4, None, 0) == "toy"  # cheapest by its own cost
    assert "toy" in space.algorithm_choices(1, 1, 0)
    cl = Cluster(gpus=16)
    assert allreduce_time(cl, Method(algorithm="toy"), 1e6) == allreduce_time(
        cl, dataclasses.replace(Method(), algorithm="ring"), 1e6)


def test_register_refuses_a_taken_name(toy):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        registry.register(registry.Algorithm("toy", "another"))
