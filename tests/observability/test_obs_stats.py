"""Stats: counters add up under concurrent threads; derived values follow their definitions."""
from __future__ import annotations

import threading

import pytest

from gradientflow.observability import stats as S


def test_counters_add_up_under_concurrent_threads():
    st = S.Stats()
    n_threads, per_thread = 8, 5000
    barrier = threading.Barrier(n_threads)

    def worker(i):
        barrier.wait()
        for k in range(per_thread):
            st.record_operation()
            st.record_message(tensors=3, wire_bytes=i + 1, dense_bytes=4 * (i + 1), seconds=1e-6)
            st.record_wait(1e-7)
            st.record_agreement(2e-7)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    snap = st.snapshot()
    total = n_threads * per_thread
    assert snap["operations"] == total
    assert snap["fused_operations"] == total
    assert snap["tensors_fused"] == 3 * total
    assert snap["wire_bytes"] == per_thread * sum(range(1, n_threads + 1))
    assert snap["dense_bytes"] == 4 * snap["wire_bytes"]
    assert snap["compression_ratio"] == 4.0
    assert snap["agreement_rounds"] == total and snap["waits"] == total
    assert snap["comm_time_s"] == pytest.approx(total * 1e-6)


def test_derived_values_follow_the_definitions():
    st = S.Stats()
    snap = st.snapshot()
    assert snap["compression_ratio"] is None and snap["overlap_fraction"] is None
    assert snap["wire_bytes_per_step"] is None and snap["density"] is None
    # A CSC bucket: the norm vector and the packed chunks are two messages on the wire.
    st.record_operation()
    st.record_message(tensors=10, wire_bytes=400, dense_bytes=0, seconds=0.001)          # norms
    st.record_message(tensors=0, wire_bytes=2_000, dense_bytes=400_000, seconds=0.003)   # chunks
    st.record_chunks(sent=1, total=100)
    st.record_codec_time(0.001)
    st.record_agreement(0.001)
    st.record_wait(0.0015)
    st.record_step(2)
    snap = st.snapshot()
    assert snap["fused_operations"] == 2 and snap["operations"] == 1
    assert snap["compression_ratio"] == pytest.approx(400_000 / 2_400)
    assert snap["density"] == pytest.approx(0.01)
    assert snap["busy_time_s"] == pytest.approx(0.006)
    assert snap["overlap_fraction"] == pytest.approx(1 - 0.0015 / 0.006)
    assert snap["wire_bytes_per_step"] == 1_200
    assert snap["tensors_per_message"] == 5
    st.record_wait(1.0)  # waited longer than the engine worked (queueing): clamped, not negative
    assert st.snapshot()["overlap_fraction"] == 0.0


def test_reset_and_module_functions():
    S.STATS.record_bytes(wire_bytes=8, dense_bytes=16)
    assert S.stats()["wire_bytes"] >= 8
    S.reset_stats()
    snap = S.stats()
    assert snap["wire_bytes"] == 0 and snap["dense_bytes"] == 0 and snap["steps"] == 0
    assert isinstance(snap["comm_time_s"], float)


def test_a_group_counts_its_own_and_adds_to_the_totals():
    totals = S.Stats()
    a, b = S.GroupStats(totals), S.GroupStats(totals)
    a.record_deferred()
    a.record_eager(fast=True)
    b.record_eager(fast=False)
    b.record_solo(nbytes=8_000_000, numel=2_000_000)
    a.record_stages()
    a.record_agreement(0.002, rounds=2)
    a.record_send(tensors=5)
    a.record_message(5, wire_bytes=1000, dense_bytes=1000, seconds=0.01)
    assert (a.deferred, a.eager, a.fast_path, a.rounds, a.messages, a.fused_tensors) == (
        1, 1, 1, 2, 1, 5)
    assert (b.eager, b.fast_path, b.solo_channel, b.messages) == (1, 0, 1, 1)
    assert a.snapshot()["round_s"] == pytest.approx(0.002)
    snap = totals.snapshot()
    assert snap["operations"] == 5  # deferred, 2 eager, solo, stages
    assert snap["agreement_rounds"] == 2
    assert snap["fused_operations"] == 2  # the solo message and the finished fused one
    assert snap["wire_bytes"] == 8_001_000
    assert snap["comm_time_s"] == pytest.approx(0.01)


def test_density_is_what_record_chunks_reports():
    import gradientflow

    gradientflow.reset_stats()
    assert gradientflow.stats()["density"] is None
    S.STATS.record_chunks(sent=3, total=100)  # what the compression layer reports per bucket
    S.STATS.record_chunks(sent=7, total=100)
    assert gradientflow.stats()["density"] == pytest.approx(0.05)
    gradientflow.reset_stats()
