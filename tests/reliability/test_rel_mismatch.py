"""Collective mismatch: every rank raises a sentence naming both ranks, the sequence number and
both fingerprints; by default from the check-ins, with GRADIENTFLOW_DEBUG before the transport."""
from __future__ import annotations

import re

import pytest

FAST = {"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"}


def mismatched_program(rank, world, case):
    """Rank body: one good call, then `case`'s disagreement; returns the error text."""
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError

    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 4
    try:
        # Repeat the call: a disagreement that does not hang the transport (SUM vs MAX, two
        # roots) is found within a couple of check-in intervals, and a later call raises.
        end = time.monotonic() + 8  # detection takes a couple of 0.2 s intervals
        while time.monotonic() < end:
            # 80 KB: above sync_fusion_limit, so synchronous calls go eagerly (no round); the
            # small case goes through the engine's agreement round, which checks it there.
            x = torch.ones(5 if case.endswith("small") else 20_000)
            if case == "op":
                dist.all_reduce(x) if rank == 0 else dist.broadcast(x, src=0)
            elif case == "root":
                dist.broadcast(x, src=rank)
            elif case.startswith("reduce_op"):
                dist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
            elif case == "order":
                if rank == 0:
                    dist.all_reduce(x)
                    dist.broadcast(x, src=0)
                else:
                    dist.broadcast(x, src=0)
                    dist.all_reduce(x)
            dist.barrier()
    except CollectiveMismatchError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the group failed earlier with the mismatch
        if isinstance(exc.__cause__, CollectiveMismatchError) or "collective mismatch" in str(exc):
            return str(exc)
        raise
    return "no error"


@pytest.mark.parametrize("case", ["op", "root", "reduce_op", "order"])
def test_mismatch_is_named_on_every_rank(pools, case):
    msgs = pools(2).run(mismatched_program, case, env=FAST, pg_timeout_s=10, timeout=90)
    for rank, msg in enumerate(msgs):
        assert "callback" not in msg, msg
        assert "collective mismatch" in msg, (rank, msg)
        assert re.search(r"sequence number \d+", msg), msg
        assert "rank 0 issued" in msg and "rank 1 issued" in msg, msg
        assert len(re.findall(r"fingerprint [0-9a-f]{8}", msg)) == 2, msg
    if case == "reduce_op":
        assert "SUM" in msgs[0] and "MAX" in msgs[0], msgs[0]
    if case == "root":
        assert "root 0" in msgs[0] and "root 1" in msgs[0], msgs[0]


def debug_mismatch(rank, world, case):
    """Rank body (GRADIENTFLOW_DEBUG=1): refused before the transport, group still usable."""
    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError

    if case == "shape":
        x = torch.ones(5 + rank)
    elif case == "dtype":
        x = torch.ones(5, dtype=torch.float32 if rank == 0 else torch.float64)
    else:  # an async allreduce beside a sync one: fused path on one rank, eager on the other
        x = torch.ones(5)
    try:
        if case == "async":
            dist.all_reduce(x, async_op=True).wait() if rank == 0 else dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)
    except CollectiveMismatchError as exc:
        msg = str(exc)
    else:
        return "no error"
    # Nothing reached the transport: the group still works.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 3, t
    return msg


@pytest.mark.parametrize("case", ["shape", "dtype", "async"])
def test_debug_refuses_mismatch_before_transport(pools, case):
    msgs = pools(2).run(debug_mismatch, case, env={"GRADIENTFLOW_DEBUG": "1"}, pg_timeout_s=10,
                        timeout=90)
    for msg in msgs:
        assert "collective mismatch" in msg and "GRADIENTFLOW_DEBUG" in msg, msg
        assert "rank 0" in msg and "rank 1" in msg, msg
        assert len(re.findall(r"fingerprint [0-9a-f]{8}", msg)) >= 2, msg
    if case == "shape":
        assert "(5,)" in msgs[0] and "(6,)" in msgs[0], msgs[0]
    if case == "dtype":
        assert "float32" in msgs[0] and "float64" in msgs[0], msgs[0]


def chain_divergence(rank, world):
    """Rank body: a reduce-op mismatch far older than the detailed history is still found."""
    import torch

    from gradientflow.backend import backend_of

    insp = backend_of().inspector
    x = torch.ones(3)
    for i in range(300):  # recorded only: the chain, not the transport, is under test
        op = 2 if (i == 10 and rank == 1) else 0
        insp.record(i, "all_reduce", x, None, op, None)
    insp.publish(False, 0.0)
    backend_of()._store.set(f"published/{rank}", "1")
    backend_of()._store.wait([f"published/{1 - rank}"])
    err = insp.find_mismatch(insp.read_peers())
    return str(err)


def test_chain_finds_a_mismatch_older_than_the_history(pools):
    msgs = pools(2).run(chain_divergence, env={"GRADIENTFLOW_INSPECT_INTERVAL_S": "0"},
                        pg_timeout_s=10, timeout=60)
    for msg in msgs:
        assert "collective mismatch" in msg and "fingerprint chains" in msg, msg
        assert "at or before sequence number 63" in msg, msg


def test_small_sync_mismatch_is_named_by_the_round(pools):
    msgs = pools(2).run(mismatched_program, "reduce_op_small", env=FAST, pg_timeout_s=10,
                        timeout=90)
    for msg in msgs:
        assert "collective mismatch" in msg and "sequence number" in msg, msg
        assert "SUM" in msg and "MAX" in msg, msg
        assert "Got the following error" not in msg, msg


# Collectives whose size mismatch makes gloo abort a process ("Received data size doesn't
# match expected size": std::terminate in gloo's I/O thread, no Python error), or, for
# broadcast and scatter, silently truncates the receiver's data. n differs by one element.
FATAL_SIZE_MISMATCH = {
    "all_reduce": lambda dist, torch, n, w: dist.all_reduce(torch.ones(n)),
    "reduce": lambda dist, torch, n, w: dist.reduce(torch.ones(n), dst=0),
    "broadcast": lambda dist, torch, n, w: dist.broadcast(torch.ones(n), src=0),
    "all_gather": lambda dist, torch, n, w: dist.all_gather(
        [torch.empty(n) for _ in range(w)], torch.ones(n)),
    "all_gather_into_tensor": lambda dist, torch, n, w: dist.all_gather_into_tensor(
        torch.empty(w * n), torch.ones(n)),
    "gather": lambda dist, torch, n, w: dist.gather(
        torch.ones(n), [torch.empty(n) for _ in range(w)] if dist.get_rank() == 0 else None, dst=0),
    "scatter": lambda dist, torch, n, w: dist.scatter(
        torch.empty(n), [torch.ones(n) for _ in range(w)] if dist.get_rank() == 0 else None, src=0),
    "reduce_scatter": lambda dist, torch, n, w: dist.reduce_scatter(
        torch.empty(n), [torch.ones(n) for _ in range(w)]),
    "reduce_scatter_tensor": lambda dist, torch, n, w: dist.reduce_scatter_tensor(
        torch.empty(n), torch.ones(w * n)),
    "all_to_all_single": lambda dist, torch, n, w: dist.all_to_all_single(
        torch.empty(w * n), torch.ones(w * n)),
    "all_to_all": lambda dist, torch, n, w: dist.all_to_all(
        [torch.empty(n) for _ in range(w)], [torch.ones(n) for _ in range(w)]),
}


def debug_size_mismatches(rank, world):
    """Rank body (GRADIENTFLOW_DEBUG=1): every eager collective above with one element more on
    rank 1 is refused on every rank before gloo sees it; the group stays usable throughout."""
    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError

    msgs = {}
    for name, call in FATAL_SIZE_MISMATCH.items():
        try:
            call(dist, torch, 20_000 + rank, world)  # 80 KB: the eager path
            msgs[name] = "no error"
        except CollectiveMismatchError as exc:
            msgs[name] = str(exc)
        t = torch.ones(20_000)
        dist.all_reduce(t)
        assert t[0].item() == world, (name, t[0].item())
    return msgs


# With a 64 KB solo threshold the 80 KB allreduce takes the solo channel (no round: the
# debug check is what stands between a size mismatch there and gloo's abort).
@pytest.mark.parametrize("solo", ["4MB", "64KB"])
def test_debug_refuses_every_fatal_size_mismatch_on_every_rank(pools, solo):
    results = pools(2).run(debug_size_mismatches, env={"GRADIENTFLOW_DEBUG": "1",
                                                       "GRADIENTFLOW_SOLO_THRESHOLD": solo},
                           pg_timeout_s=10, timeout=90)
    for rank, msgs in enumerate(results):
        assert msgs.keys() == FATAL_SIZE_MISMATCH.keys()
        for name, msg in msgs.items():
            assert "collective mismatch" in msg and "GRADIENTFLOW_DEBUG" in msg, (rank, name, msg)
            assert name in msg and "rank 0" in msg and "rank 1" in msg, (rank, name, msg)
            assert "80000" in msg or "(20000,)" in msg, (rank, name, msg)


# ---------------------------------------------------------------------------------------
# The default path (no GRADIENTFLOW_DEBUG): every collective, every way two ranks can differ,
# every dtype Horovod takes, refused on every rank before the transport (group still usable).
SAME_WIDTH = {"float32": "int32", "int32": "float32", "int16": "float16", "float16": "int16",
              "int64": "float64", "float64": "int64", "uint8": "int8", "int8": "uint8"}
ROOTED = {"reduce", "broadcast", "gather", "scatter"}
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
COLLECTIVES = sorted(FATAL_SIZE_MISMATCH)


def _call(dist, torch, name, shape, dt, root, op, w):
    """The collective `name` on tensors of `shape` and `dt`, with `root` and reduce `op`."""
    one = (lambda: torch.ones(shape, dtype=dt)) if dt != torch.bool else (
        lambda: torch.ones(shape, dtype=dt))
    rows = (w * shape[0],) + tuple(shape[1:])
    me = dist.get_rank()
    calls = {
        "all_reduce": lambda: dist.all_reduce(one(), op=op),
        "reduce": lambda: dist.reduce(one(), dst=root, op=op),
        "broadcast": lambda: dist.broadcast(one(), src=root),
        "all_gather": lambda: dist.all_gather([one() for _ in range(w)], one()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(rows, dtype=dt), one()),
        "gather": lambda: dist.gather(one(), [one() for _ in range(w)] if me == root else None,
                                      dst=root),
        "scatter": lambda: dist.scatter(one(), [one() for _ in range(w)] if me == root else None,
                                        src=root),
        "reduce_scatter": lambda: dist.reduce_scatter(one(), [one() for _ in range(w)], op=op),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            one(), torch.ones(rows, dtype=dt), op=op),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(rows, dtype=dt),
                                                            torch.ones(rows, dtype=dt)),
        "all_to_all": lambda: dist.all_to_all([one() for _ in range(w)],
                                              [one() for _ in range(w)]),
    }
    return calls[name]()


def default_mismatches(rank, world, dtypes):
    """Rank body: for each dtype and collective, rank 1 differs in one thing at a time (size,
    same-width dtype, dimensions of the same size, root, reduce op); returns every error text
    by (dtype, collective, kind)."""
    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError

    sum_, max_ = dist.ReduceOp.SUM, dist.ReduceOp.MAX
    msgs = {}
    for name in dtypes:
        dt, other = getattr(torch, name), getattr(torch, SAME_WIDTH[name])
        for coll in COLLECTIVES:
            kinds = {"size": ((4 + rank, 6), dt, 0, sum_),
                     "dtype": ((4, 6), dt if rank == 0 else other, 0, sum_)}
            if coll != "all_to_all":  # its per-rank tensors may have any shapes of that size
                kinds["dims"] = ((4, 6) if rank == 0 else (4, 3, 2), dt, 0, sum_)
            if coll in ROOTED:
                kinds["root"] = ((4, 6), dt, rank, sum_)
            if coll in REDUCING:
                kinds["op"] = ((4, 6), dt, 0, sum_ if rank == 0 else max_)
            for kind, (shape, t, root, op) in kinds.items():
                if coll == "all_to_all_single" and kind == "size":
                    shape = (4, 6 + rank)  # rows may differ there: the row size may not
                try:
                    _call(dist, torch, coll, shape, t, root, op, world)
                    msgs[(name, coll, kind)] = "no error"
                except CollectiveMismatchError as exc:
                    msgs[(name, coll, kind)] = str(exc)
                t = torch.ones(3)
                dist.all_reduce(t)  # nothing was sent: the group is usable
                assert t.tolist() == [world] * 3, (name, coll, kind, t)
    return msgs


@pytest.mark.parametrize("dtypes", [["float32", "int16", "uint8", "float64"],
                                    ["int32", "float16", "int8", "int64"]])
def test_default_path_refuses_every_mismatch_of_every_collective(pools, dtypes):
    results = pools(2).run(default_mismatches, dtypes, pg_timeout_s=20, timeout=300)
    for rank, msgs in enumerate(results):
        assert len(msgs) >= len(dtypes) * (len(COLLECTIVES) * 3 - 1)
        for (name, coll, kind), msg in msgs.items():
            where = (rank, name, coll, kind)
            assert "collective mismatch" in msg, (where, msg)
            assert coll in msg and "rank 0" in msg and "rank 1" in msg, (where, msg)
            assert "before any data moved" in msg, (where, msg)
        for coll in COLLECTIVES:
            msg = msgs[(dtypes[0], coll, "dtype")]
            assert dtypes[0] in msg and SAME_WIDTH[dtypes[0]] in msg, (coll, msg)


def cross_stream_mismatch(rank, world):
    """Rank body: a solo allreduce (above the solo threshold) on rank 0 where rank 1 queues
    a deferred one: the two wait in rounds of different streams; the check-ins find it."""
    import torch
    import torch.distributed as dist

    from gradientflow.errors import CollectiveMismatchError, EngineError

    n = 1_250_000 if rank == 0 else 250_000  # 5 MB: solo; 1 MB: deferred
    try:
        dist.all_reduce(torch.ones(n), async_op=True).wait()
    except CollectiveMismatchError as exc:
        return str(exc)
    except EngineError as exc:
        return f"engine: {exc}"
    return "no error"


def test_a_mismatch_across_the_solo_and_agreement_streams_is_found(pools):
    msgs = pools(2).run(cross_stream_mismatch, env=FAST, pg_timeout_s=30, timeout=120)
    for rank, msg in enumerate(msgs):
        assert "collective mismatch" in msg, (rank, msg)
        assert "(1250000,)" in msg and "(250000,)" in msg, (rank, msg)


def test_a_mismatch_the_inspector_named_first_keeps_its_names():
    """When the inspector fails the group with the same mismatch while a round gathers every
    rank's view (which the fault then ends), the round's error is the inspector's, which names
    every rank's call, not a sentence without them."""
    from gradientflow.engine.checks import Check, signature
    from gradientflow.engine.rounds import Rounds
    from gradientflow.errors import CollectiveMismatchError
    from gradientflow.observability.stats import GroupStats

    class Failed:
        def allgather(self, *args):
            raise RuntimeError("the group was failed")

    named = CollectiveMismatchError("rank 0 issued broadcast root 0, rank 1 issued root 1")
    rounds = Rounds(0, 2, Failed(), GroupStats())
    chk = Check(1, signature("broadcast", None, [], 0, None))
    rounds.fault = lambda: None
    plain = rounds._mismatch([chk], 2, (1, 2), True)
    assert plain is not named and "rank 1 issued" not in str(plain)
    rounds.fault = lambda: named
    assert rounds._mismatch([chk], 2, (1, 2), True) is named
