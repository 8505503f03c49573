"""Completion of futures off the driving thread: batches settle every future, nothing blocks
them."""

from __future__ import annotations

import threading

import pytest
import torch

from gradientflow.engine import completion


def test_batch_settles_every_future_once_with_values_and_errors():
    pairs = [completion.new_future() for _ in range(5)]
    order: list[int] = []
    lock = threading.Lock()
    all_seen = threading.Event()
    for i, (_, public) in enumerate(pairs):
        def note(f, i=i):
            with lock:
                order.append(i)
                if len(order) == len(pairs):
                    all_seen.set()
        public.add_done_callback(note)
    err = RuntimeError("boom")
    completion.complete_all([(src, i if i != 3 else None, err if i == 3 else None)
                             for i, (src, _) in enumerate(pairs)])
    for i, (_, public) in enumerate(pairs):
        if i == 3:
            with pytest.raises(RuntimeError, match="boom"):
                public.wait()
        else:
            assert public.wait() == i
    # Each exactly once (in order unless a settle outlasts the hand-off time on a busy machine);
    # done-callbacks run just after the value is set, so wait for the last of them.
    assert all_seen.wait(30)
    assert sorted(order) == list(range(5))


def test_a_callback_blocked_on_a_later_future_of_its_batch_does_not_deadlock():
    # powerSGD-style: a callback waits on another collective's future. Here the awaited future
    # is settled later in the *same* batch: only the watchdog's hand-off can settle it.
    (src_a, pub_a), (src_b, pub_b) = completion.new_future(), completion.new_future()
    got = {}

    def waits_on_b(f):
        got["b"] = pub_b.wait()
        return f.value()

    chained = pub_a.then(waits_on_b)
    completion.complete_all([(src_a, "a", None), (src_b, "b", None)])
    done = threading.Event()
    chained.add_done_callback(lambda _f: done.set())
    assert done.wait(30), "the batch deadlocked behind a blocked callback"
    assert chained.value() == "a" and got["b"] == "b"


def test_single_item_batch_and_plain_complete():
    src, public = completion.new_future()
    completion.complete_all([(src, torch.ones(2), None)])
    assert torch.equal(public.wait(), torch.ones(2))
