"""The engine thread's jobs run alone, on stand-in parts (engine/jobs.py's JobParts): no
engine, no group, no thread. What a job does with a round's answer is pinned down here."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from gradientflow.config import Config
from gradientflow.engine.fusion import FusableOp, Message
from gradientflow.engine.jobs import AgreeBatch, EagerOp, JobParts, StagesBatch
from gradientflow.engine.queue import OrderedQueue
from gradientflow.engine.stages import Final, StagesOp
from gradientflow.engine.streams import EngineStreams
from gradientflow.observability.stats import GroupStats
from gradientflow.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(60)  # a future the pool never settles fails, not hangs


class _Rounds:
    """A round that answers what the test says: a batch size, or a mismatch."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.seen: list = []

    def agree(self, candidates, waited=False):
        self.seen.append([op.seq for op in candidates])
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def check(self, chk, waited=True):
        self.seen.append(chk)
        if isinstance(self.answer, BaseException):
            raise self.answer


def _parts(rounds, queue=None):
    cv = threading.Condition(threading.RLock())
    refused: list = []
    failed: list = []
    parts = JobParts(0, cv, queue, rounds, None, None, None, lambda dev: None,
                     lambda tensor: False, set(),
                     lambda exc: failed.append(exc) or exc,
                     lambda n, err, seqs: refused.append((n, seqs)))
    return parts, refused, failed


def _queue_of(n: int) -> OrderedQueue:
    queue = OrderedQueue(Config.resolve({}, environ={}), lambda msg: None, lambda: False)
    for seq in range(n):
        t = torch.full((4,), float(seq))
        queue.push_fused(FusableOp(seq, t, ("cpu", t.dtype, 0), 0), waited=False)
    return queue


def test_agree_batch_takes_the_agreed_prefix_into_messages():
    queue = _queue_of(3)
    parts, refused, failed = _parts(_Rounds(2), queue)
    AgreeBatch(list(queue.issued)).run(parts)
    assert [op.seq for op in queue.issued] == [2]  # the third waits for the next round
    msgs = list(queue.agreed)
    assert all(isinstance(m, Message) for m in msgs)
    assert [op.seq for m in msgs for op in m.ops] == [0, 1]
    assert not refused and not failed


def test_agree_batch_refused_alike_hands_the_refusal_to_the_engine():
    queue = _queue_of(2)
    err = CollectiveMismatchError("ranks queued different allreduces")
    err.refused = 2
    rounds = _Rounds(err)
    parts, refused, failed = _parts(rounds, queue)
    AgreeBatch(list(queue.issued)).run(parts)
    assert refused == [(2, None)] and not failed
    assert len(queue.issued) == 2  # the engine's refuse (stood in for here) removes them


def test_eager_op_refused_completes_its_future_and_sends_nothing():
    err = CollectiveMismatchError("rank 1 called broadcast with another root")
    err.refused = 1
    sent = []
    parts, refused, failed = _parts(_Rounds(err), _queue_of(0))
    fut = torch.futures.Future()
    op = EagerOp(7, "broadcast", lambda: sent.append(1), [], fut,
                 check=SimpleNamespace(waited=True))
    op.run(parts)
    assert not sent and refused == [(0, [7])] and not failed and not parts.checking
    with pytest.raises(Exception, match="another root"):
        fut.wait()  # settled by the completion pool with the round's error


def test_no_batch_round_passes_an_eager_op_waiting_behind_a_blocked_message():
    """Rounds pair across ranks in the order they run: an eager op's round runs at its launch,
    so while it waits behind a message that has no free segment on this rank (another rank's
    may have one), the next batch's round must not start (a 4-rank soak met exactly this: the
    ranks with a free segment ran the broadcast's round, the others the next batch's)."""
    segments = {"free": False}
    queue = OrderedQueue(Config.resolve({}, environ={}),
                         lambda msg: (0, torch.empty(0)) if segments["free"] else None,
                         lambda: True)
    for seq in (0, 1):  # two ops: one packed message, which needs a segment
        t = torch.ones(4)
        queue.push_fused(FusableOp(seq, t, ("cpu", t.dtype, 0), 0), waited=True)
    job, _ = queue.next_job()
    assert isinstance(job, AgreeBatch)
    queue.take_batch(2)  # the message of ops 0-1, now waiting for a segment
    queue.issued.append(EagerOp(2, "broadcast", lambda: None, [], torch.futures.Future(),
                                check=SimpleNamespace(waited=False)))
    queue.push_fused(FusableOp(3, t.clone(), ("cpu", t.dtype, 0), 0), waited=True)
    job, delay = queue.next_job()
    assert job is None and delay is None, job  # op 3's round waits for op 2's
    assert [type(x).__name__ for x in queue.agreed] == ["Message", "EagerOp"]
    segments["free"] = True
    kinds = []
    for _ in range(3):
        job, _ = queue.next_job()
        kinds.append(type(job).__name__)
        if isinstance(job, AgreeBatch):
            break
    assert kinds == ["SendMessage", "EagerOp", "AgreeBatch"], kinds


class _Transport:
    """An allreduce of a world of two equal ranks (x2), remembering what it was handed."""

    def __init__(self) -> None:
        self.sent: list = []

    def allreduce(self, tensors, opts):
        self.sent.append(tensors[0].clone())
        tensors[0].mul_(2)
        return SimpleNamespace(wait=lambda: None)


def _two_stages(parts):
    """A fuser of one op: stage 1 sends the values, stage 2 (Final) them + 1."""
    x = parts[0].clone()
    x = yield x
    x = yield Final(x + 1)
    return [x]


@pytest.mark.parametrize("swapped", [True, False])
def test_stages_batch_sums_a_stage_the_swap_takes_without_the_transport(swapped):
    """JobParts.swap sums a stage in place (True) or leaves it to the transport's allreduce
    (False); either way every stage is summed once and the last one is unpacked after it."""
    transport, swaps = _Transport(), []

    def swap(t):
        swaps.append(t.clone())
        if swapped:
            t.mul_(2)
        return swapped

    parts = JobParts(0, threading.Condition(threading.RLock()), None, None,
                     SimpleNamespace(later=lambda fn: fn()), EngineStreams(), GroupStats(),
                     lambda dev: transport, swap, set(), lambda exc: exc,
                     lambda n, err, seqs: None)
    fut = torch.futures.Future()
    StagesBatch([StagesOp(0, "t", torch.ones(3), _two_stages, torch.device("cpu"), fut)]).run(
        parts)
    assert torch.equal(fut.wait(), torch.full((3,), 6.0))  # ((1 x 2) + 1) x 2
    assert len(swaps) == 2 and len(transport.sent) == (0 if swapped else 2)
