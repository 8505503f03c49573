"""Routing of an allreduce (engine/issue.py): SOLO, FUSED or EAGER from the call alone.

Every rank must route a call the same way, so the route may depend only on the call (device,
byte size, async_op) and the group's Config: these properties pin that down without a group.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientflow.config import Config
from gradientflow.engine.issue import EAGER, FUSED, SOLO, Issue, IssueParts

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def issue_for(solo_transports=object(), **options) -> Issue:
    """An Issue over no engine: route() reads only the Config and the solo channel."""
    lock = threading.RLock()
    parts = IssueParts(0, 1, "test", lock, threading.Condition(lock), None, None, None, None,
                       None, lambda what: None, lambda exc: exc)
    return Issue(parts, Config.resolve(options, environ={}), lambda d: None,
                 solo_transports, None)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 2**30), async_op=st.booleans(), cuda=st.booleans(),
       threshold=st.sampled_from([0, 1000, 2**20, 128 * 2**20]),
       solo=st.sampled_from([0, 500, 4 * 10**6]), channel=st.booleans(),
       sync_limit=st.sampled_from([0, 256, 2**20]))
def test_route_follows_the_rule(nbytes, async_op, cuda, threshold, solo, channel, sync_limit):
    issue = issue_for(fusion_threshold=threshold, solo_threshold=solo, solo_channel=channel,
                      sync_fusion_limit=sync_limit)
    route = issue.route(CUDA if cuda else CPU, nbytes, async_op)
    cut = min(solo, threshold) if solo > 0 else threshold
    if channel and threshold > 0 and not cuda and nbytes >= cut:
        assert route == SOLO
    elif nbytes < (threshold if async_op else min(threshold, sync_limit)):
        assert route == FUSED
    else:
        assert route == EAGER


def test_small_allreduces_route_alike_whatever_async_op():
    """Join pairs a synchronous allreduce on one rank with an async one on another."""
    issue = issue_for()
    for nbytes in (4, 255):
        assert issue.route(CPU, nbytes, True) == issue.route(CPU, nbytes, False) == FUSED
    assert issue.route(CPU, 4096, True) == FUSED
    assert issue.route(CPU, 4096, False) == EAGER


def test_no_solo_channel_without_its_transports():
    issue = issue_for(solo_transports=None)
    assert issue.route(CPU, 2**27 - 1, True) == FUSED
    assert issue.route(CPU, 2**27, True) == EAGER


@settings(max_examples=100, deadline=None)
@given(nbytes=st.integers(0, 2**30), async_op=st.booleans(),
       threshold=st.sampled_from([0, 1000, 2**20, 128 * 2**20]),
       priority=st.one_of(st.none(), st.integers(0, 1000)))
def test_a_prioritised_allreduce_is_deferred_below_the_threshold(nbytes, async_op, threshold,
                                                                 priority):
    """The optimizer's partitions carry a priority: deferred whatever their size below the
    fusion threshold, so that a round can order them; the rest of the rule is unchanged."""
    issue = issue_for(SimpleNamespace(get=lambda device: None), fusion_threshold=threshold)
    routed = []
    issue._fused = lambda tensor, reduce_op, waited, prio: routed.append(FUSED)
    issue._issue_solo = lambda *a: routed.append(SOLO)
    issue._issue = lambda *a, **k: routed.append(EAGER)
    t = torch.empty(0)
    issue.allreduce([t], None, t, None, nbytes, async_op, priority)
    if priority is not None and async_op and nbytes < threshold:
        assert routed == [FUSED]
    else:
        assert routed == [issue.route(CPU, nbytes, async_op)]
