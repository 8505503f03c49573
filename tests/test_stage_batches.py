"""Compressed (multi-stage) ops fused into agreed batches: the pure cut, the generic fuser, and
DDP's CSC buckets on gradientflow (collectives per step, equal results, mismatches)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gradientflow.engine.stages import Final, StagesOp, drive, fuse, plan_batches, unwrap
from harness import RankFailure


# ------------------------------------------------------------------ the pure parts
def _op(seq, nbytes, fuser="f", device="cpu", close=True):
    return StagesOp(seq, "t", None, fuser, torch.device(device), None, nbytes=nbytes,
                    close=close)


def _seqs(batches):
    return [[op.seq for op in b] for b in batches]


def test_plan_batches_cuts_by_threshold_fuser_and_device():
    ops = [_op(0, 10), _op(1, 10), _op(2, 10), _op(3, 10)]
    assert _seqs(plan_batches(ops, 0)) == [[0], [1], [2], [3]]  # fusion off: each alone
    assert _seqs(plan_batches(ops, 20)) == [[0, 1], [2, 3]]  # closed once it holds 20 bytes
    assert _seqs(plan_batches(ops, 25)) == [[0, 1, 2], [3]]
    assert _seqs(plan_batches(ops, 1000)) == [[0, 1, 2, 3]]
    mixed = [_op(0, 1), _op(1, 1, fuser="g"), _op(2, 1, fuser="g"), _op(3, 1, device="meta")]
    assert _seqs(plan_batches(mixed, 1000)) == [[0], [1, 2], [3]]


def test_a_stage_run_is_closed_by_the_call_sequence_not_the_cycle_time():
    """The run waits for its closing op or the threshold (cycle time 0 would round a run of
    deferred allreduces at once), then one round agrees it and it is cut into batches."""
    from types import SimpleNamespace

    from gradientflow.engine.jobs import AgreeBatch, StagesBatch
    from gradientflow.engine.queue import OrderedQueue

    cfg = SimpleNamespace(fusion_threshold=1000, solo_threshold=0, cycle_time_ms=0.0)
    q = OrderedQueue(cfg, lambda msg: None, lambda: False)
    q.push_stages(_op(0, 10, close=False))
    job, delay = q.next_job()
    assert job is None and delay is not None and delay > 4.0
    q.push_stages(_op(1, 10, close=True))
    job, _ = q.next_job()
    assert isinstance(job, AgreeBatch) and [o.seq for o in job.candidates] == [0, 1]
    q.take_batch(2)
    job, _ = q.next_job()
    assert isinstance(job, StagesBatch) and [o.seq for o in job.ops] == [0, 1]
    # the threshold closes a run too, and the batch ends where it is crossed
    for seq in (2, 3, 4):
        q.push_stages(_op(seq, 600, close=False))
    job, _ = q.next_job()
    assert isinstance(job, AgreeBatch) and len(job.candidates) == 3
    q.take_batch(3)
    assert [[o.seq for o in j.ops] for j in q.agreed] == [[2, 3], [4]]


def test_an_op_marked_close_ends_its_run_whatever_queued_behind_it():
    """Two ops each marked close, both queued before the engine looks: two runs, two rounds,
    two batches (which ops share a batch follows the calls, not how fast the engine came)."""
    from types import SimpleNamespace

    from gradientflow.engine.jobs import AgreeBatch, StagesBatch
    from gradientflow.engine.queue import OrderedQueue

    cfg = SimpleNamespace(fusion_threshold=1000, solo_threshold=0, cycle_time_ms=3.0)
    q = OrderedQueue(cfg, lambda msg: None, lambda: False)
    q.push_stages(_op(0, 10, close=True))
    q.push_stages(_op(1, 10, close=True))
    q.push_stages(_op(2, 10, close=False))
    for first in (0, 1):
        job, _ = q.next_job()
        assert isinstance(job, AgreeBatch) and [o.seq for o in job.candidates] == [first]
        q.take_batch(1)
        job, _ = q.next_job()
        assert isinstance(job, StagesBatch) and [o.seq for o in job.ops] == [first]
    job, delay = q.next_job()  # op 2's run waits for its close
    assert job is None and delay is not None


def _gen(values, stages, final):
    """A StageGen of `stages` stages over `values`: each stage sends the running tensor."""
    t = values.clone()
    for s in range(stages):
        last = final and s == stages - 1
        t = yield (Final(t) if last else t)
        t = t * 2 + s
    return t


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       stages=st.lists(st.integers(1, 3), min_size=5, max_size=5),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.float64]), min_size=5, max_size=5),
       ranks=st.integers(1, 3))
def test_fuse_equals_each_op_alone(sizes, stages, dtypes, ranks):
    """The fused StageGen gives every op what it gets alone, whatever the stage counts and
    dtypes; a stage is Final only if every op still running marked its own so."""
    def values(r, i):
        return torch.arange(sizes[i], dtype=dtypes[i]) + 10 * r + i

    def summed(t):  # a SUM over `ranks` identical ranks
        t.mul_(ranks)

    alone = [drive(_gen(values(0, i), stages[i], True), summed) for i in range(len(sizes))]
    yields = []

    def recording(t):
        yields.append(t.numel())
        summed(t)

    gen = fuse([_gen(values(0, i), stages[i], True) for i in range(len(sizes))])
    finals = []
    try:
        y = next(gen)
        while True:
            t, final = unwrap(y)
            finals.append(final)
            recording(t)
            y = gen.send(t)
    except StopIteration as stop:
        fused = stop.value
    for a, f in zip(alone, fused):
        assert torch.equal(a, f)
    # one collective per dtype per stage round, at most
    rounds = max(stages[: len(sizes)])
    assert len(yields) <= rounds * len({d for d in dtypes[: len(sizes)]})
    assert finals[-1] and not any(finals[:-1])


# ------------------------------------------------------------------ DDP on gradientflow
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def csc_ddp(rank, world, selection, steps=6):
    """Rank body: DDP with the CSC hook over several buckets; returns (parameters, collectives
    per step in steady state)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradientflow
    from gradientflow.hooks import CSCState, csc_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = CSCState(None, density=0.05, chunk_size=64, optimizer=opt, selection=selection,
                     warmup_densities=(1.0,), warmup_period=1)
    state.bind_parameter_names(model)
    ddp.register_comm_hook(state, csc_hook)
    gen = torch.Generator().manual_seed(7 + rank)
    per_step = []
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        before = gradientflow.stats()["fused_operations"] if dist.get_backend() != "gloo" else 0
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if dist.get_backend() != "gloo":
            per_step.append(gradientflow.stats()["fused_operations"] - before)
    return [p.detach().clone() for p in model.parameters()], per_step[2:]


@pytest.mark.parametrize("selection", ["bucket", "pool"])
def test_csc_buckets_fuse_into_two_collectives_per_step(pools, selection):
    """Every bucket of a step in one batch (the default threshold): 2 collectives per step, not
    2 per bucket; with fusion off each bucket makes its own 2. Per-bucket selection gives the
    same parameters fused or not, and as on gloo (where the hook runs each bucket alone)."""
    fused = pools(2).run(csc_ddp, selection, timeout=240)
    alone = pools(2).run(csc_ddp, selection, timeout=240,
                         env={"GRADIENTFLOW_FUSION_THRESHOLD": "0"})
    for rank in range(2):
        assert set(fused[rank][1]) == {2}, fused[rank][1]
        assert min(alone[rank][1]) >= 6, alone[rank][1]  # >= 3 buckets, 2 each
    if selection == "bucket":
        gloo = pools(2).run(csc_ddp, selection, backend="gloo", timeout=240)
        for a, b, c in zip(fused[0][0], alone[0][0], gloo[0][0]):
            assert torch.equal(a, b) and torch.equal(a, c)
    else:
        # The pool's quota is the batch's: fused, the chunks compete across buckets, so the
        # result differs from choosing per bucket, and is the same on both ranks.
        for a, b in zip(fused[0][0], fused[1][0]):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b) for a, b in zip(fused[0][0], alone[0][0]))


def mismatched_stages(rank, world):
    """Rank body: rank 0 submits stage ops of 16 and 32 dense bytes, rank 1 the other order."""
    import torch.distributed as dist

    from gradientflow.backend.api import submit_part
    from gradientflow.engine.stages import fuse

    def one(n):
        t = yield torch.ones(n)
        return t

    sizes = [16, 32] if rank == 0 else [32, 16]
    futs = [submit_part(dist.group.WORLD, i, one(n // 4), fuse, dense_bytes=n, close=(i == 1))
            for i, n in enumerate(sizes)]
    for f in futs:
        f.wait()


def _stage_mismatch(pools, fn) -> str:
    """Run `fn` on 2 ranks; require a stage-op mismatch error on both; return the report."""
    with pytest.raises(RankFailure) as info:
        pools(2).run(fn, timeout=120)
    text = str(info.value)
    assert "ranks [0, 1]" in text, text
    assert text.count("collective mismatch in the compressed (multi-stage) ops") >= 2, text
    return text


def test_mismatched_stage_ops_are_reported_on_every_rank(pools):
    _stage_mismatch(pools, mismatched_stages)


def different_densities(rank, world):
    """Rank body: the CSC hook at density 5% on rank 0 and 10% on rank 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradientflow.hooks import CSCState, csc_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.1)
    state = CSCState(None, density=0.05 * (rank + 1), chunk_size=64, warmup_densities=(),
                     momentum_correction=False)
    ddp.register_comm_hook(state, csc_hook)
    ddp(torch.randn(8, 64)).sum().backward()


def test_different_compression_settings_are_a_mismatch_not_a_hang(pools):
    assert "csc bucket (config" in _stage_mismatch(pools, different_densities)


def test_a_part_with_local_work_is_prepared_before_any_round():
    """The engine thread spends the wait for a run to close on the parts' local work."""
    from types import SimpleNamespace

    from gradientflow.engine.jobs import AgreeBatch, Prepare
    from gradientflow.engine.queue import OrderedQueue

    class Part:
        def __init__(self):
            self.calls = 0

        def prepare(self):
            self.calls += 1

    cfg = SimpleNamespace(fusion_threshold=1000, solo_threshold=0, cycle_time_ms=3.0)
    q = OrderedQueue(cfg, lambda msg: None, lambda: False)
    parts = [Part(), Part()]
    for seq, part in enumerate(parts):
        op = _op(seq, 10, close=seq == 1)
        op.part = part
        q.push_stages(op)
    engine = SimpleNamespace(stats=SimpleNamespace(record_codec_time=lambda s: None))
    for part in parts:
        job, _ = q.next_job()
        assert isinstance(job, Prepare) and job.op.part is part
        job.run(engine)
    job, _ = q.next_job()
    assert isinstance(job, AgreeBatch) and [p.calls for p in parts] == [1, 1]
