"""Lazy allreduce: random programs with ranks waiting at different points, memory, DDP hooks."""
from __future__ import annotations

import re

import pytest
import torch


def random_programs(rank, world, n_examples):
    """Rank body: Hypothesis programs of async allreduces mixed with other collectives.

    Every rank issues the same program but waits at its own points (drawn from the seed and
    the rank), the situation where a "flush when waited on" rule cuts different messages.
    """
    import random

    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    import gradientflow

    op_step = st.tuples(
        st.sampled_from(["ar", "ar", "ar", "ar", "sync_ar", "bcast", "flush", "ar_big"]),
        st.sampled_from(["float32", "float64", "float16", "int32"]),
        st.integers(1, 300),
        st.sampled_from(["SUM", "MAX", "MIN"]),
    )

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**30), program=st.lists(op_step, min_size=1, max_size=40))
    def prop(seed, program):
        rng = random.Random(seed * 7919 + rank)  # each rank its own wait points
        pending = []  # (work, tensor, expected)
        for i, (kind, dtype, n, op) in enumerate(program):
            dt = getattr(torch, dtype)
            if kind == "ar_big":
                n *= 40
            xs = [(torch.arange(n) % 7 + r + i).to(dt) for r in range(world)]
            if op == "SUM":
                want = sum(x.double() for x in xs).to(dt)
            elif op == "MAX":
                want = torch.stack(xs).max(0).values
            else:
                want = torch.stack(xs).min(0).values
            t = xs[rank].clone()
            rop = getattr(dist.ReduceOp, op)
            if kind in ("ar", "ar_big"):
                pending.append((dist.all_reduce(t, op=rop, async_op=True), t, want, i))
            elif kind == "sync_ar":
                dist.all_reduce(t, op=rop)
                assert torch.equal(t, want), (i, kind)
            elif kind == "bcast":
                dist.broadcast(t, src=i % world)
                assert torch.equal(t, xs[i % world]), (i, kind)
            elif kind == "flush":
                gradientflow.flush()
            # Wait on a random earlier op, at a point that differs between ranks.
            if pending and rng.random() < 0.3:
                j = rng.randrange(len(pending))
                w, tt, want_j, idx = pending.pop(j)
                w.wait()
                assert torch.equal(tt, want_j), (idx, "early wait")
        rng.shuffle(pending)
        for w, tt, want_j, idx in pending:
            if rng.random() < 0.5:
                w.wait()
            else:
                w.get_future().wait()
            assert torch.equal(tt, want_j), (idx, "final wait")

    prop()
    from gradientflow.backend import backend_of

    c = backend_of().engine.stats
    return {"rounds": c.rounds, "messages": c.messages, "fused": c.fused_tensors,
            "deferred": c.deferred, "solo_channel": c.solo_channel}


# A long cycle time makes rounds start only from waits, flushes, the threshold and other
# collectives, so messages really fuse; the default cycle exercises timer-started rounds.
# The 3-rank cases send tensors of 600 bytes and more alone, in place (the solo threshold),
# while the smaller ones around them fuse: at once on the solo channel, or (channel off, as
# for CUDA tensors) in their batch's round. In the others, the tensors of at least the
# threshold take the solo channel.
@pytest.mark.parametrize("world,threshold,cycle_ms,solo,channel", [
    (2, "2KB", "1000", "0", "1"), (3, "64KB", "1000", "600B", "1"),
    (3, "64KB", "1000", "600B", "0"), (4, "1500B", "1", "0", "1")])
def test_random_programs_with_different_wait_points(pools, world, threshold, cycle_ms, solo,
                                                    channel):
    res = pools(world).run(random_programs, {2: 60, 3: 30, 4: 25}[world],
                           env={"GRADIENTFLOW_FUSION_THRESHOLD": threshold,
                                "GRADIENTFLOW_SOLO_THRESHOLD": solo,
                                "GRADIENTFLOW_SOLO_CHANNEL": channel,
                                "GRADIENTFLOW_CYCLE_TIME_MS": cycle_ms}, timeout=400)
    r0 = res[0]
    assert r0["deferred"] > 0, r0
    assert all(r["rounds"] == r0["rounds"] for r in res), res  # rounds pair one-to-one
    assert all(r["solo_channel"] == r0["solo_channel"] for r in res), res
    assert (r0["solo_channel"] > 0) == (channel == "1"), r0


def solo_overtakes(rank, world):
    """Rank body: rank 0 waits on a deferred allreduce before it issues the solo one after it,
    while the other ranks issue the solo first: the solo channel must not need rank 0's send
    to finish the deferred op's round (no deadlock), and a barrier then makes both visible."""
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    want = world * (world + 1) / 2
    small = torch.full((10,), float(rank + 1))
    big = torch.full((2**23,), float(rank + 1))  # 32 MB: long on the wire, past the barrier
    w_small = dist.all_reduce(small, async_op=True)
    if rank == 0:
        w_small.wait()  # its round needs every rank's engine, none of their callers
        assert bool((small == want).all())
    w_big = dist.all_reduce(big, async_op=True)
    dist.barrier()  # gloo's barrier waits for what its group has in flight: both channels here
    visible = bool((small == want).all()) and bool((big == want).all())
    w_small.wait()
    w_big.wait()
    c = backend_of().engine.stats
    return visible, c.solo_channel, c.rounds


def test_solo_allreduce_overtakes_the_deferred_batch_without_deadlock(pools):
    res = pools(3).run(solo_overtakes, env={"GRADIENTFLOW_SOLO_THRESHOLD": "16KB",
                                            "GRADIENTFLOW_CYCLE_TIME_MS": "1000"}, timeout=60)
    assert res == [(True, 1, 1)] * 3, res


def fuse_many(rank, world, n):
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    ts = [torch.full((10,), float(rank + i)) for i in range(n)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    works[-1].wait()
    for w in works:
        w.wait()
    assert all(t[0].item() == sum(r + i for r in range(world)) for i, t in enumerate(ts))
    c = backend_of().engine.stats
    return c.rounds, c.messages


def test_many_small_allreduces_go_in_one_message(pools):
    res = pools(2).run(fuse_many, 50, env={"GRADIENTFLOW_CYCLE_TIME_MS": "1000"})
    assert res == [(1, 1), (1, 1)], res


def fused_loop_memory(rank, world, steps):
    """Rank body: RSS after `steps` fused steps must not grow past warm-up."""
    import torch
    import torch.distributed as dist

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    grads = [torch.randn(n) for n in (1000, 20, 5000, 300, 64, 7000) * 5]

    def step():
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for w in works:
            w.wait()

    for _ in range(50):
        step()
    before = rss_mb()
    for _ in range(steps):
        step()
    return rss_mb() - before


def test_thousand_fused_steps_do_not_grow_memory(pools):
    growth = pools(2).run(fused_loop_memory, 1000, timeout=400)
    assert max(growth) < 20.0, growth


def mismatched_order(rank, world):
    """Rank body: async allreduces of (3,) and (5,) issued in opposite orders; the error each
    rank's wait raised (None when none did)."""
    import torch
    import torch.distributed as dist

    a, b = torch.ones(3), torch.ones(5)
    order = [a, b] if rank == 0 else [b, a]
    works = [dist.all_reduce(t, async_op=True) for t in order]
    try:
        for w in works:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return str(exc)
    return None


def test_mismatched_async_order_is_reported_on_every_rank(pools):
    errors = pools(2).run(mismatched_order, timeout=120)
    for rank, text in enumerate(errors):
        assert text is not None, f"rank {rank}: no error for allreduces in different orders"
        assert f"rank {rank}: collective mismatch" in text, (rank, text)
        assert named_seq(text) == 0, (rank, text)  # the first call already differs
        assert "(3,)" in text and "(5,)" in text, (rank, text)


def wait_on_engine_thread(rank, world):
    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    engine = backend_of().engine

    def stage():
        t = torch.ones(2)
        yield t
        dist.all_reduce(torch.ones(1), async_op=True).wait()  # on the engine thread: refused
        return t

    fut = engine.stages("bad", stage(), torch.device("cpu"))
    try:
        fut.wait()
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


def test_wait_on_engine_thread_is_a_clear_error(pools):
    msgs = pools(2).run(wait_on_engine_thread, timeout=120)
    assert all("engine thread" in m for m in msgs), msgs


def powersgd_training(rank, world, bucket_cap_mb, iters):
    """Rank body: DDP + PyTorch's powerSGD_hook on gradientflow, past start_powerSGD_iter.

    Returns the allreduces the hook issued, in sequence order (seq, which tensor, shape), what
    each sent and got back by sequence number, the error training raised (None if none) and
    the final weights. The hook issues allreduces from future callbacks, in an order that can
    differ between ranks with several buckets.
    """
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradientflow.backend import backend_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = P.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                            start_powerSGD_iter=2, min_compression_rate=0.5)
    issue = backend_of().engine.issue
    issued, sent, got, lock = [], {}, {}, threading.Lock()

    class Recorded:
        """torch.distributed for the hook, its all_reduce recorded under a lock (so the
        record's order is the sequence order)."""

        def __getattr__(self, name):
            return getattr(dist, name)

        def all_reduce(self, t, *args, **kwargs):
            which = next((f"P{i}" for i, v in state.p_memory_dict.items() if v is t),
                         next((f"Q{i}" for i, v in state.q_memory_dict.items() if v is t), "U"))
            with lock:
                seq, before = issue.seq, t.clone()
                work = dist.all_reduce(t, *args, **kwargs)  # a refused call takes no number
                issued.append((seq, which, tuple(t.shape)))
                sent[seq] = before
            return Seen(work, seq)

    class Seen:
        """The Work the hook gets: its future first records the sum, before the hook's own
        callbacks scale or orthogonalize it in place."""

        def __init__(self, work, seq):
            self.work, self.seq = work, seq

        def get_future(self):
            def record(fut):
                got[self.seq] = fut.value()[0].clone()
                return fut.value()

            return self.work.get_future().then(record)

    hook_dist, P.dist = P.dist, Recorded()
    ddp.register_comm_hook(state, P.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    error = None
    try:
        for _ in range(iters):
            opt.zero_grad()
            ddp(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        error = str(exc)
    finally:
        P.dist = hook_dist
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return issued, sent, got, error, flat


def named_seq(text):
    """The sequence number a collective-mismatch error names (None if it names none)."""
    m = re.search(r"collective mismatch (?:at|in the async allreduces from) sequence number "
                  r"(\d+)", text)
    return None if m is None else int(m.group(1))


def check_powersgd_outcome(res):
    """What each rank got is right for the programs the ranks issued.

    Same descriptors in the same order: no error, and every allreduce's result is the sum of
    what the ranks sent under its sequence number. Also the same tensors (the hook's callbacks
    ran in one order everywhere): the same weights on every rank. Descriptors that differ at
    sequence number d: the allreduces before d that completed are sums as above, and every
    rank raised a collective mismatch naming d (the inspector), or the fused batch from
    s <= d that holds d (the agreement round, which lists the batch).
    """
    (issued0, sent0, got0, err0, w0), (issued1, sent1, got1, err1, w1) = res
    differ = [i for i, (a, b) in enumerate(zip(issued0, issued1)) if a[0] != b[0] or a[2] != b[2]]
    if differ:  # the first difference is in what was issued, not in the numbering
        i = differ[0]
        assert issued0[i][0] == issued1[i][0], (
            "sequence numbers differ", issued0[max(0, i - 3):i + 3], issued1[max(0, i - 3):i + 3])
    end = issued0[differ[0]][0] if differ else None
    for seq in sorted(set(sent0) & set(sent1)):
        if end is not None and seq >= end:
            break
        want = sent0[seq] + sent1[seq]
        for rank, got in enumerate((got0, got1)):
            if seq in got or end is None:  # with no mismatch every allreduce completes
                assert seq in got and torch.equal(got[seq], want), (rank, seq, got.get(seq))
    if not differ:
        assert err0 is None and err1 is None, (err0 or "")[:3000] + (err1 or "")[:3000]
        if [a[1] for a in issued0] == [a[1] for a in issued1]:
            assert float((w0 - w1).abs().max()) < 1e-5, float((w0 - w1).abs().max())
        return "match"
    d = end
    for rank, err in enumerate((err0, err1)):
        assert err is not None, (f"rank {rank}: no error; ranks differ at #{d}",
                                 issued0[differ[0]], issued1[differ[0]])
        s = named_seq(err)
        assert s is not None and s <= d, (rank, d, s, err[:3000])
        if "at sequence number" in err:
            assert s == d, (rank, d, err[:3000])
        elif "\n  rank 1: [" in err:
            assert f"'#{d} all_reduce" in err, (rank, d, err[:3000])
    return "mismatch"


# With a 1 KB solo threshold the bucket and the hook's P and Q go on the solo channel, whose
# futures complete on gloo's threads, and the hook's callbacks wait on the next allreduce there.
@pytest.mark.parametrize("solo", ["4MB", "1KB"])
def test_powersgd_one_bucket_trains(pools, solo):
    res = pools(2).run(powersgd_training, 100, 6, timeout=300,
                       env={"GRADIENTFLOW_SOLO_THRESHOLD": solo})
    (issued0, _, _, err0, w0), (issued1, _, _, err1, w1) = res
    assert err0 is None and err1 is None, (err0, err1)
    assert issued0 == issued1 and len(issued0) > 6, issued0  # one bucket: one order
    assert float((w0 - w1).abs().max()) < 1e-5, float((w0 - w1).abs().max())
    assert check_powersgd_outcome(res) == "match"


def test_powersgd_many_buckets_trains_or_reports_mismatch(pools):
    """Several buckets: the ranks may issue the hook's allreduces in different orders. Either
    way each rank must get the outcome its program calls for (check_powersgd_outcome)."""
    check_powersgd_outcome(pools(2).run(powersgd_training, 0.001, 6, timeout=300))


def groups_end_their_threads(rank, world, rounds):
    """Rank body: gradientflow groups with fused traffic, destroyed: their threads end with them."""
    import threading

    import torch
    import torch.distributed as dist

    def ours():
        return sorted(t.name for t in threading.enumerate()
                      if t.is_alive() and t.name.endswith(("-engine", "-reaper")))

    before = ours()
    reapers = 0
    for _ in range(rounds):
        g = dist.new_group(backend="gradientflow")
        works = [dist.all_reduce(torch.ones(100), group=g, async_op=True) for _ in range(10)]
        for w in works:
            w.wait()
        reapers += sum(t.name.endswith("-reaper") for t in threading.enumerate())
        dist.destroy_process_group(g)
    return before, ours(), reapers


def test_destroyed_groups_leave_no_engine_or_reaper_thread(pools):
    for before, after, reapers in pools(2).run(groups_end_their_threads, 3):
        assert reapers >= 3, reapers  # fused CPU messages did start a reaper in each group
        assert after == before, (before, after)


def callbacks_threads(rank, world, n):
    """Rank body: which threads run user callbacks on fused allreduces' futures.

    Futures handed out by get_future() before their message completes must be settled on the
    completion pool (where a blocked callback cannot stall the others), never on the engine's
    reaper; the Works nobody asked a future of get none (their ops are only marked done).
    Each callback blocks until the last one has run: on a single thread that would never finish.
    """
    import threading

    import torch
    import torch.distributed as dist

    ts = [torch.full((8,), float(rank + i)) for i in range(n)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    names, last_ran = [], threading.Event()

    def cb(fut, i):
        names.append(threading.current_thread().name)
        if i == n - 2:
            last_ran.set()
        else:
            assert last_ran.wait(30), "a blocked callback stalled the other completions"
        return fut.value()

    chained = [works[i].get_future().then(lambda f, i=i: cb(f, i)) for i in range(0, n - 1, 2)]
    for w in works:
        w.wait()
    for f in chained:
        f.wait()
    for i, t in enumerate(ts):
        assert t[0].item() == sum(r + i for r in range(world)), i
    return names


def test_chained_futures_complete_on_the_pool(pools):
    for names in pools(2).run(callbacks_threads, 12, env={"GRADIENTFLOW_CYCLE_TIME_MS": "1000"}):
        assert len(names) == 6 and not any("reaper" in n or "engine" in n for n in names), names


def lazy_futures(rank, world):
    """Rank body: a CPU fused op gets a torch Future only when something asks for one.

    Returns which ops got one; whether a future asked by get_future() after its op finished
    is already done, and its value; and every tensor's first element after the waits."""
    import torch
    from torch._C._distributed_c10d import AllreduceOptions

    from gradientflow.backend import backend_of

    eng = backend_of().engine
    opts = AllreduceOptions()
    ts = [torch.full((4,), float(rank + i)) for i in range(6)]
    works = [eng.allreduce([t], opts, t, opts.reduceOp, 16, True) for t in ts]
    eng.flush()
    works[-1].wait()
    for w in works:
        w.wait()
    made = [w._op.fut is not None for w in works]
    late = works[0].get_future()  # after completion: made now, already settled
    return made, late.done(), late.wait()[0].tolist(), [t[0].item() for t in ts]


def test_cpu_fused_ops_make_futures_only_on_demand(pools):
    for made, done, late, values in pools(2).run(lazy_futures):
        # Only the op waited on first may have blocked (and so made a future).
        assert not any(made[:-1]), made
        assert done and late == [1.0] * 4, (done, late)  # rank 0 + rank 1 for op 0
        assert values == [float(2 * i + 1) for i in range(6)], values
