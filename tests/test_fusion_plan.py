"""The cut of an agreed batch into messages (a pure function: no processes)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow.engine.fusion import FusableOp, plan_messages

KEYS = [("cpu", torch.float32, 0), ("cpu", torch.float16, 0), ("cpu", torch.float32, 3)]


def _ops(specs):
    ops = []
    for seq, (numel, k) in enumerate(specs):
        key = KEYS[k]
        ops.append(FusableOp(seq, torch.empty(numel, dtype=key[1]), key, key[2], None))
    return ops


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 2)), max_size=60),
       threshold=st.integers(4, 1200), solo=st.integers(0, 1500))
def test_plan_keeps_every_op_once_within_the_limits(specs, threshold, solo):
    ops = _ops(specs)
    plan = plan_messages(ops, threshold, solo)
    cut = min(solo, threshold) if solo > 0 else threshold
    # Every op exactly once, each message of one key, in issue order inside a message.
    seqs = sorted(op.seq for m in plan for op in m.ops)
    assert seqs == list(range(len(ops)))
    for m in plan:
        assert {op.key for op in m.ops} == {m.key}
        assert [op.seq for op in m.ops] == sorted(op.seq for op in m.ops)
        assert m.nbytes == sum(op.nbytes for op in m.ops)
        if any(op.nbytes >= cut for op in m.ops):
            assert len(m.ops) == 1  # a big tensor goes alone, in place
        else:
            assert m.nbytes <= threshold
    # Per key, fused messages follow issue order, and so do solo ones.
    for key in KEYS:
        for solo_kind in (True, False):
            firsts = [m.ops[0].seq for m in plan
                      if m.key == key and (m.ops[0].nbytes >= cut) == solo_kind]
            assert firsts == sorted(firsts)
    # A pure function of the batch: every rank cuts the same messages in the same order.
    again = plan_messages(_ops(specs), threshold, solo)
    assert [[op.seq for op in m.ops] for m in again] == [[op.seq for op in m.ops] for m in plan]


def test_solo_tensors_do_not_close_the_fused_message():
    # 100-byte tensors around 4000-byte ones: with solo at 1000 bytes the small ones share one
    # message; the big ones go alone, in the order they came.
    ops = _ops([(25, 0), (1000, 0), (25, 0), (1000, 0), (25, 0)])  # fp32: 100 / 4000 bytes
    plan = plan_messages(ops, threshold=10_000, solo_bytes=1000)
    assert [[op.seq for op in m.ops] for m in plan] == [[1], [3], [0, 2, 4]]
    # Default (0): the fusion threshold is the solo limit, so all five fuse.
    assert [[op.seq for op in m.ops] for m in plan_messages(ops, 10_000)] == [[0, 1, 2, 3, 4]]


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 2),
                                st.one_of(st.none(), st.integers(0, 20))), max_size=60),
       threshold=st.integers(4, 1200), solo=st.integers(0, 1500))
def test_priority_orders_the_batch_it_is_given(specs, threshold, solo):
    # The optimizer's partitions carry a priority (lower first, the first layer 0): the batch
    # one round agrees is taken in that order, ops without one first, each group in issue order.
    ops = _ops([(n, k) for n, k, _ in specs])
    for op, (_, _, prio) in zip(ops, specs):
        op.priority = prio
    plan = plan_messages(ops, threshold, solo)
    seqs = sorted(op.seq for m in plan for op in m.ops)
    assert seqs == list(range(len(ops)))
    order = sorted(ops, key=lambda op: (-1 if op.priority is None else op.priority, op.seq))
    rank = {op.seq: i for i, op in enumerate(order)}
    for m in plan:  # inside a message, and across the solo messages of one key
        assert [rank[op.seq] for op in m.ops] == sorted(rank[op.seq] for op in m.ops)
    cut = min(solo, threshold) if solo > 0 else threshold
    for key in KEYS:
        firsts = [rank[m.ops[0].seq] for m in plan if m.key == key and m.ops[0].nbytes >= cut]
        assert firsts == sorted(firsts)
    # A priority enters the fingerprint the round compares: ranks that gave the same op
    # different priorities (a different order) are refused, not paired.
    a, b = _ops([(4, 0)]) + _ops([(4, 0)])
    a.priority, b.priority = 0, 1
    assert a.fingerprint != b.fingerprint and _ops([(4, 0)])[0].fingerprint != a.fingerprint


def test_the_first_layer_leaves_first_among_solo_partitions():
    # Three 4000-byte partitions issued in backward order (2, 1, 0) and agreed together: with
    # priorities they leave 0, 1, 2; without, as issued.
    ops = _ops([(1000, 0)] * 3)
    assert [m.ops[0].seq for m in plan_messages(ops, 10_000, 1000)] == [0, 1, 2]
    for op, prio in zip(ops, (2, 1, 0)):
        op.priority = prio
    assert [m.ops[0].priority for m in plan_messages(ops, 10_000, 1000)] == [0, 1, 2]
