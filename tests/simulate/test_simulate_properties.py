"""Physical properties of the cost model, checked over random clusters and methods."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradientflow.simulate import Cluster, Method, bytes_sent, load, plan, preset, simulate
from gradientflow.simulate.collectives import GBIT, allreduce_time
from gradientflow.simulate.step import message_cost

MODELS = {m: load(m) for m in ("alexnet", "resnet50", "bert-base")}
SETTINGS = settings(max_examples=40, deadline=None)

clusters = st.builds(
    Cluster, gpus=st.integers(1, 1024), gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    inter_gbps=st.floats(1, 400), intra_gbps=st.floats(10, 4800),
    inter_latency_us=st.floats(0, 50), intra_latency_us=st.floats(0, 10))
methods = st.builds(
    Method, algorithm=st.sampled_from(["ring", "hierarchical", "reduction_server"]),
    transport=st.sampled_from(["gpu", "host"]),
    fusion_threshold=st.sampled_from([0, 2**20, 25 * 2**20, 128 * 2**20]),
    solo_threshold=st.sampled_from([0, 4 * 10**6]), cycle_ms=st.sampled_from([1.0, math.inf]),
    fp16=st.booleans(), csc_density=st.one_of(st.none(), st.floats(0.0005, 1.0)),
    chunk_size=st.sampled_from([64, 1024, 32768]), overlap=st.booleans(),
    priority=st.booleans(), forward_gating=st.booleans())
models = st.sampled_from(sorted(MODELS))


def _inversion(model, cl, method) -> float:
    """How much slower a faster network may make a step: one message's priority inversion.

    FIFO keeps its order whatever the link speed, so it is monotone. Non-preemptive priority
    is not (Graham's list-scheduling anomaly): once messages finish sooner, a low-priority one
    may start just before a high-priority one becomes ready and hold the link for its whole
    duration. That delay is at most one message, the longest on the slower network.
    """
    if not method.priority or cl.gpus == 1:
        return 0.0
    compute = model.batch / model.throughput
    backward = compute * (1 - model.forward_fraction)
    return max((message_cost(cl, method, m)[0] for m in plan(model, method, backward)),
               default=0.0)


@SETTINGS
@given(models, clusters, methods, st.floats(1.01, 10))
@example("bert-base",  # a priority inversion: 3% more bandwidth, 0.03% slower
         Cluster(gpus=266, gpus_per_node=1, inter_gbps=128.0, intra_gbps=10.0,
                 inter_latency_us=0.5, intra_latency_us=0.0),
         Method(algorithm="hierarchical", transport="gpu", fusion_threshold=0,
                solo_threshold=0, cycle_ms=1.0, fp16=True, csc_density=None, chunk_size=64,
                overlap=True, priority=True, forward_gating=True), 1.03125)
def test_more_bandwidth_is_never_slower(model, cl, method, factor):
    faster = dataclasses.replace(cl, inter_gbps=cl.inter_gbps * factor,
                                 intra_gbps=cl.intra_gbps * factor)
    slow = simulate(MODELS[model], cl, method).step_s
    assert simulate(MODELS[model], faster, method).step_s <= slow * (1 + 1e-9) + _inversion(
        MODELS[model], cl, method)


@SETTINGS
@given(models, clusters, methods, st.floats(0.0, 0.99))
def test_less_latency_is_never_slower(model, cl, method, shrink):
    quicker = dataclasses.replace(cl, inter_latency_us=cl.inter_latency_us * shrink,
                                  intra_latency_us=cl.intra_latency_us * shrink)
    slow = simulate(MODELS[model], cl, method).step_s
    assert simulate(MODELS[model], quicker, method).step_s <= slow * (1 + 1e-9) + _inversion(
        MODELS[model], cl, method)


@SETTINGS
@given(models, clusters, methods, st.floats(0.0005, 1.0))
def test_csc_never_sends_more_bytes_than_dense(model, cl, method, density):
    dense = dataclasses.replace(method, csc_density=None)
    csc = dataclasses.replace(method, csc_density=density)
    m = MODELS[model]
    assert simulate(m, cl, csc).wire_bytes <= simulate(m, cl, dense).wire_bytes * (1 + 1e-12)


@SETTINGS
@given(models, clusters, methods)
def test_fp16_never_sends_more_bytes_than_fp32(model, cl, method):
    m = MODELS[model]
    half = simulate(m, cl, dataclasses.replace(method, fp16=True)).wire_bytes
    assert half <= simulate(m, cl, dataclasses.replace(method, fp16=False)).wire_bytes


@SETTINGS
@given(models, clusters, methods)
def test_speedup_is_at_most_linear_and_step_covers_compute(model, cl, method):
    r = simulate(MODELS[model], cl, method)
    assert r.step_s >= r.compute_s * (1 - 1e-12)
    assert 0 <= r.exposed_comm_s <= r.comm_s * (1 + 1e-9) + 1e-12  # hiding never adds time
    assert 0 < r.speedup <= cl.gpus * (1 + 1e-9)
    assert r.scaling_efficiency == pytest.approx(r.speedup / cl.gpus)
    assert r.epoch_time_s == pytest.approx(MODELS[model].dataset / (cl.gpus * r.batch) * r.step_s)
    if cl.gpus == 1:
        assert r.speedup == pytest.approx(1.0) and r.wire_bytes == 0


@SETTINGS
@given(models, clusters, methods)
def test_overlap_is_never_slower_without_gating(model, cl, method):
    method = dataclasses.replace(method, forward_gating=False)
    m = MODELS[model]
    on = simulate(m, cl, dataclasses.replace(method, overlap=True)).step_s
    assert on <= simulate(m, cl, dataclasses.replace(method, overlap=False)).step_s * (1 + 1e-9)


@SETTINGS
@given(st.integers(2, 2048), st.floats(1, 1e10), st.floats(1, 400), st.floats(0, 50))
def test_ring_moves_2_n_minus_1_over_n_and_costs_alpha_beta(n, nbytes, gbps, lat):
    cl = Cluster(gpus=n, gpus_per_node=1, inter_gbps=gbps, intra_gbps=gbps,
                 inter_latency_us=lat)
    ring = Method(algorithm="ring")
    assert bytes_sent(cl, ring, nbytes) == pytest.approx(2 * (n - 1) / n * nbytes)
    b = cl.link_efficiency * gbps * GBIT
    expect = 2 * (n - 1) * (lat * 1e-6 + nbytes / n / b)
    assert allreduce_time(cl, ring, nbytes) == pytest.approx(expect)


@SETTINGS
@given(models, st.integers(2, 512), st.sampled_from([0, 2**20, 128 * 2**20]))
def test_dense_ring_sends_2_n_minus_1_over_n_of_the_gradient(model, n, threshold):
    m = MODELS[model]
    cl = Cluster(gpus=n, gpus_per_node=1)
    method = Method(fusion_threshold=threshold, fp16=False, csc_density=None)
    r = simulate(m, cl, method)
    assert r.wire_bytes == pytest.approx(2 * (n - 1) / n * m.grad_bytes)
    # fusion keeps every element exactly once, in backward order
    msgs = plan(m, method, 0.1)
    assert sum(x.numel for x in msgs) == m.numel
    assert [x.ready for x in msgs] == sorted(x.ready for x in msgs)


@SETTINGS
@given(st.integers(2, 128), st.sampled_from([1, 2, 4, 8]), st.floats(1e3, 1e10))
def test_reduction_server_halves_the_inter_node_bytes(nodes, g, nbytes):
    cl = Cluster(gpus=nodes * g, gpus_per_node=g)
    rs, ring = preset("reduction_server"), preset("ring")
    assert bytes_sent(cl, rs, nbytes) <= bytes_sent(cl, ring, nbytes) * (1 + 1e-12)
    big = Cluster(gpus=nodes * g, gpus_per_node=g, intra_gbps=1e6)  # intra-node phases free
    ratio = allreduce_time(big, ring, 1e12) / allreduce_time(big, rs, 1e12)
    assert ratio == pytest.approx(2 * (nodes * g - 1) / (nodes * g), rel=0.02)


def test_reduction_server_latency_does_not_grow_with_nodes():
    rs = preset("reduction_server")
    t = [allreduce_time(Cluster(gpus=8 * n, gpus_per_node=8), rs, 8) for n in (2, 16, 128)]
    assert max(t) == pytest.approx(min(t))
    ring = preset("ring")
    r = [allreduce_time(Cluster(gpus=8 * n, gpus_per_node=8), ring, 8) for n in (2, 16, 128)]
    assert r[0] < r[1] < r[2]


def test_bad_configurations_name_the_field():
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster(gpus_per_node=0)
    with pytest.raises(ValueError, match="algorithm"):
        Method(algorithm="tree")
    with pytest.raises(ValueError, match="csc_density"):
        Method(csc_density=0.0)
    with pytest.raises(ValueError, match="unknown model"):
        load("vgg16")


@SETTINGS
@given(models, clusters, methods)
def test_priority_changes_the_step_only_through_forward_gating(model, cl, method):
    # one channel that never idles while work is ready finishes at the same time in any order
    method = dataclasses.replace(method, forward_gating=False)
    m = MODELS[model]
    fifo = simulate(m, cl, dataclasses.replace(method, priority=False)).step_s
    assert simulate(m, cl, dataclasses.replace(method, priority=True)).step_s == pytest.approx(fifo)
