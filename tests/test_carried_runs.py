"""Asynchronous broadcasts issued back to back share one round (jobs.CarriedRun).

The queue gathers a run of carried broadcasts from one root (queue.OrderedQueue._carried);
a caller waiting on one runs it on its own thread (take_carried), otherwise the engine thread
does once something follows, somebody waits, or the first lingered. Ranks may gather runs of
different lengths (one waited sooner): the round agrees the shorter, the rest goes next, and
every result is gloo's.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from gradientflow.config import Config
from gradientflow.engine import queue as queue_mod
from gradientflow.engine.checks import CARRIED, CARRY_BYTES, Check, packing
from gradientflow.engine.fusion import FusableOp
from gradientflow.engine.jobs import CarriedRun, EagerOp, JobParts
from gradientflow.engine.queue import OrderedQueue
from gradientflow.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(60)  # a future the pool never settles fails, not hangs


def _queue() -> OrderedQueue:
    return OrderedQueue(Config.resolve({}, environ={}), lambda msg: None, lambda: False)


def _bcast(seq: int, numel: int = 4, root: int = 0, when: float = 1.0, sent=None) -> EagerOp:
    t = torch.zeros(numel)
    chk = Check(seq, ("broadcast", t.dtype, (numel,), root, None), payload=t, route=CARRIED)
    return EagerOp(seq, "broadcast", lambda: (sent.append(seq) if sent is not None else None),
                   [t], torch.futures.Future(), check=chk, carry=when)


def test_a_run_lingers_then_goes_whole(monkeypatch):
    now = {"t": 10.0}
    monkeypatch.setattr(queue_mod.time, "monotonic", lambda: now["t"])
    queue = _queue()
    queue.issued.extend([_bcast(0, when=10.0), _bcast(1, when=10.0)])
    job, delay = queue.next_job()
    assert job is None and delay == pytest.approx(queue_mod.CARRY_LINGER_S)
    now["t"] += queue_mod.CARRY_LINGER_S
    job, _ = queue.next_job()
    assert isinstance(job, CarriedRun) and [op.seq for op in job.ops] == [0, 1]
    assert not job.inline and not queue.agreed and not queue.issued


def test_a_run_goes_at_once_when_waited_on_or_followed():
    queue = _queue()
    queue.issued.extend([_bcast(0), _bcast(1)])
    queue.wanted_upto = 0  # somebody waits on the first
    job, _ = queue.next_job()
    assert [op.seq for op in job.ops] == [0, 1]
    queue = _queue()
    t = torch.ones(4)
    queue.issued.append(_bcast(0))
    queue.push_fused(FusableOp(1, t, ("cpu", t.dtype, 0), 0), waited=False)
    job, _ = queue.next_job()  # an allreduce behind it: nothing more will join the run
    assert isinstance(job, CarriedRun) and [op.seq for op in job.ops] == [0]


def test_a_run_is_cut_at_another_root_and_at_the_carry_limit():
    queue = _queue()
    queue.issued.extend([_bcast(0), _bcast(1, root=1), _bcast(2)])
    job, _ = queue.next_job()
    assert [op.seq for op in job.ops] == [0]
    big = CARRY_BYTES // 4 // 2  # two of these fill the room; a third would not fit
    queue = _queue()
    queue.issued.extend([_bcast(0, big), _bcast(1, big), _bcast(2, 8)])
    job, _ = queue.next_job()
    assert [op.seq for op in job.ops] == [0, 1]
    assert packing([op.check.payload for op in job.ops])[1] <= CARRY_BYTES


def test_a_waiting_caller_takes_the_run_unless_the_engine_is_busy():
    queue = _queue()
    queue.issued.extend([_bcast(3), _bcast(4)])
    queue.busy = True
    assert queue.take_carried(3) is None
    queue.busy = False
    job = queue.take_carried(3)
    assert job.inline and [op.seq for op in job.ops] == [3, 4]
    assert queue.take_carried(4) is None  # gone


class _Rounds:
    """carry() agreeing the counts the test gives, one per round, or raising."""

    def __init__(self, answers) -> None:
        self.answers = list(answers)
        self.seen: list = []

    def carry(self, checks, waited=False):
        self.seen.append([c.seq for c in checks])
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        for c in checks[:answer]:
            c.summed = True
        return answer


def _parts(rounds):
    cv = threading.Condition(threading.RLock())
    refused: list = []
    failed: list = []
    parts = JobParts(0, cv, SimpleNamespace(wanted_upto=-1), rounds, None, None, None,
                     lambda dev: None, lambda tensor: False, set(),
                     lambda exc: failed.append(exc) or exc,
                     lambda n, err, seqs: refused.append((n, seqs)))
    return parts, refused, failed


def test_a_shorter_agreed_run_sends_the_rest_in_the_next_round():
    """Another rank gathered fewer: the round agrees 1 of 3, then 2 go in the next."""
    sent: list = []
    ops = [_bcast(s, sent=sent) for s in (5, 6, 7)]
    rounds = _Rounds([1, 2])
    parts, refused, failed = _parts(rounds)
    CarriedRun(ops, inline=True).run(parts)
    assert rounds.seen == [[5, 6, 7], [6, 7]] and sent == [5, 6, 7]
    assert all(op.fut.done() for op in ops) and not parts.checking
    assert not refused and not failed


def test_a_refused_run_fails_only_its_ops_and_the_rest_goes_on():
    err = CollectiveMismatchError("rank 1 broadcast another size")
    err.refused = 1
    sent: list = []
    ops = [_bcast(s, sent=sent) for s in (0, 1)]
    parts, refused, failed = _parts(_Rounds([err, 1]))
    CarriedRun(ops, inline=True).run(parts)
    assert refused == [(0, [0])] and sent == [1] and not failed
    with pytest.raises(Exception, match="another size"):
        ops[0].fut.wait()
    assert ops[1].fut.wait() == ops[1].outputs


def test_a_failed_round_fails_the_group_and_every_op():
    ops = [_bcast(s) for s in (0, 1)]
    parts, _, failed = _parts(_Rounds([RuntimeError("peer died")]))
    with pytest.raises(RuntimeError):
        CarriedRun(ops).run(parts)
    assert len(failed) == 1 and not parts.checking
    for op in ops:
        with pytest.raises(Exception, match="peer died"):
            op.fut.wait()


# --------------------------------------------------------------------------- on two ranks
SHAPES = [(), (3,), (20,), (1024,), (2400,), (9, 7)]
DTYPES = ["float32", "int64", "float64", "bfloat16", "uint8"]


def runs_match_gloo(rank, world, n_examples):
    """Rank body: runs of 1-4 broadcasts, each async or not, from one root or two, each rank
    waiting early on its own random calls (so the ranks gather runs of different lengths),
    some Works only asked for their future: every result is gloo's, made twice (the second
    has room in its round). A run of async broadcasts that both ranks wait on only at its end
    takes one round when its room is kept."""
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gradientflow.backend import backend_of

    from gradientflow.engine import queue as queue_mod

    gloo = dist.new_group(backend="gloo")
    stats = backend_of().engine.stats
    one_round = {"runs": 0}
    call = st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.booleans(),
                     st.sampled_from([0, 0, 1]))

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), calls=st.lists(call, min_size=1, max_size=4),
           early=st.booleans())
    def prop(seed, calls, early):
        ids = [None] * world
        dist.all_gather_object(ids, (seed, calls, early), group=gloo)
        assert all(i == ids[0] for i in ids), f"ranks run different examples: {ids}"
        g = torch.Generator().manual_seed(seed * 3 + rank)
        for repeat in range(2):
            xs = []
            for dtype, shape, _, _ in calls:
                x = torch.randint(0, 100, shape, generator=g).to(getattr(torch, dtype))
                xs.append(x)
            theirs = [x.clone() for x in xs]
            checks = stats.checks
            works = []
            for i, (x, (_, _, async_op, root)) in enumerate(zip(xs, calls)):
                work = dist.broadcast(x, src=root, async_op=async_op)
                # Each rank waits early on its own calls: the runs they gather differ.
                if async_op and early and torch.rand(1, generator=g).item() < 0.5:
                    work.wait()
                elif async_op:
                    works.append((i, work))
            for i, work in works:
                if i % 2:
                    work.get_future().wait()  # no Work.wait(): the run goes by itself
                else:
                    work.wait()
            for x, (_, _, _, root) in zip(theirs, calls):
                dist.broadcast(x, src=root, group=gloo)
            for i, (ours, want) in enumerate(zip(xs, theirs)):
                assert torch.equal(ours, want), (
                    f"rank {rank}: call {i} of {calls} (repeat {repeat}) differs from gloo")
            lone = (not early and len(calls) > 1 and all(c[2] for c in calls)
                    and len({c[3] for c in calls}) == 1 and packing(xs)[1] <= CARRY_BYTES)
            if repeat == 1 and lone:
                assert stats.checks - checks == 1, (
                    f"rank {rank}: {calls} took {stats.checks - checks} rounds, not one")
                one_round["runs"] += 1

    # A run splits where a caller is descheduled longer than the linger between two calls:
    # long enough here that a loaded machine does not split the runs the test counts.
    linger, queue_mod.CARRY_LINGER_S = queue_mod.CARRY_LINGER_S, 0.05
    try:
        prop()
        for repeat in range(2):  # and one such run for certain
            xs = [torch.full((300,), float(rank)), torch.full((5,), rank, dtype=torch.int64)]
            checks = stats.checks
            for work in [dist.broadcast(x, src=1, async_op=True) for x in xs]:
                work.wait()
            assert xs[0].eq(1).all() and xs[1].eq(1).all(), f"rank {rank}: not rank 1's"
        assert stats.checks - checks == 1, f"rank {rank}: {stats.checks - checks} rounds"
        one_round["runs"] += 1
    finally:
        queue_mod.CARRY_LINGER_S = linger
    return one_round


def test_runs_of_carried_broadcasts_are_gloo_bit_for_bit(pools):
    seen = pools(2).run(runs_match_gloo, 30, timeout=240)
    assert seen[0]["runs"] >= 2, seen[0]


def ddp_buffers_in_one_round(rank, world):
    """Rank body: DDP with BatchNorm on a gradientflow group broadcasts its float statistics
    and its int64 counters before each forward: one round a step once the room is kept, and
    the buffers are rank 0's, as under gloo."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradientflow.backend import backend_of
    from gradientflow.engine import queue as queue_mod

    torch.manual_seed(rank)  # different buffers per rank: the broadcast must fix them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
    ddp = DDP(model)
    stats = backend_of().engine.stats
    rounds = []
    linger, queue_mod.CARRY_LINGER_S = queue_mod.CARRY_LINGER_S, 0.05  # as in runs_match_gloo
    try:
        for step in range(4):
            x = torch.randn(32, 8)
            before = stats.checks
            out = ddp(x)  # the buffer broadcast runs first
            rounds.append(stats.checks - before)
            out.sum().backward()
        ddp.eval()
        ddp(torch.randn(32, 8))  # the broadcast again; evaluation changes no statistic
    finally:
        queue_mod.CARRY_LINGER_S = linger
    mine = torch.cat([b.float().reshape(-1) for b in model.buffers()])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=dist.new_group(backend="gloo"))
    assert torch.equal(every[0], every[1]), f"rank {rank}: buffers differ between ranks"
    assert rounds[-1] == 1, f"rank {rank}: rounds in the forwards {rounds}"
    return rounds


def test_ddp_buffers_are_broadcast_in_one_round(pools):
    pools(2).run(ddp_buffers_in_one_round, timeout=120)
