"""Stall inspector, peer failure and timeouts: a missing rank is named; nothing hangs."""
from __future__ import annotations

import json
import os

import pytest

from harness import RankFailure


def _store():
    from gradientflow.backend import backend_of

    return backend_of()._store


def _wait_for(pred, limit_s):
    """Poll `pred` until true or `limit_s` passed (the condition is set by another thread)."""
    import threading
    import time

    end = time.monotonic() + limit_s
    ev = threading.Event()
    while not pred():
        if time.monotonic() > end:
            return False
        ev.wait(0.02)
    return True


def late_joiner(rank, world):
    """Rank body: rank 1 joins an all_reduce only after rank 0 has logged the stall warning."""
    import threading

    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    store = _store()
    insp = backend_of().inspector
    if rank == 0:
        # The main thread blocks in the collective; a helper releases rank 1 once warned.
        def release():
            _wait_for(lambda: insp.warnings, 20)
            store.set("go", "1")

        threading.Thread(target=release, daemon=True).start()
    else:
        store.wait(["go"])
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 3
    return list(insp.warnings)


def test_stall_warning_names_the_missing_rank(pools):
    env = {"GRADIENTFLOW_STALL_WARNING_S": "0.5", "GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"}
    warnings = pools(2).run(late_joiner, env=env, pg_timeout_s=20, timeout=60)
    assert warnings[0], warnings
    w = warnings[0][0]
    assert "ranks [1] have not joined it" in w and "all_reduce" in w, w
    assert "sequence number" in w, w


def never_joins(rank, world):
    """Rank body: rank 1 never issues the collective; rank 0 aborts after stall_abort_s."""
    import time

    import torch
    import torch.distributed as dist

    store = _store()
    if rank == 1:
        store.wait(["released"])
        try:  # the group was failed by rank 0: the next call says so
            dist.all_reduce(torch.ones(2))
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return "no error"
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as exc:  # noqa: BLE001
        store.set("released", "1")
        return f"{time.monotonic() - t0:.2f} {exc}"
    store.set("released", "1")
    return "no error"


def test_stall_abort_fails_the_group_on_every_rank(pools):
    env = {"GRADIENTFLOW_STALL_WARNING_S": "0.4", "GRADIENTFLOW_STALL_ABORT_S": "1.0",
           "GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"}
    msgs = pools(2).run(never_joins, env=env, pg_timeout_s=20, timeout=60)
    took, text = msgs[0].split(" ", 1)
    assert float(took) < 8, msgs[0]  # well inside the 20 s group timeout
    assert "stalled" in text and "ranks [1] have not joined it" in text, text
    assert "stalled" in msgs[1] and "failed by rank 0" in msgs[1], msgs[1]


def timeout_case(rank, world, case):
    """Rank body: rank 1 never joins; rank 0 must raise at the group timeout, not hang."""
    import time

    import torch
    import torch.distributed as dist

    store = _store()
    if rank == 1:
        store.wait(["released"], __import__("datetime").timedelta(seconds=30))
        return "rank 1"
    t0 = time.monotonic()
    try:
        if case == "sync":
            dist.all_reduce(torch.ones(1000))
        elif case == "async_fused":
            dist.all_reduce(torch.ones(10), async_op=True).wait()
        elif case == "broadcast":
            dist.broadcast(torch.ones(10), src=0, async_op=True).wait()
            dist.all_reduce(torch.ones(10))
    except Exception as exc:  # noqa: BLE001
        took = time.monotonic() - t0
        store.set("released", "1")
        return [took, str(exc)]
    store.set("released", "1")
    return [time.monotonic() - t0, "no error"]


@pytest.mark.parametrize("case", ["sync", "async_fused", "broadcast"])
def test_group_timeout_is_honoured(pools, case):
    res = pools(2).run(timeout_case, case, pg_timeout_s=3, timeout=60,
                       env={"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"})
    took, msg = res[0]
    assert msg != "no error"
    assert 2.5 < took < 8.0, (took, msg)  # the 3 s timeout, not the 30 min default
    assert "gradientflow" in msg or "Timed out" in msg, msg


def killed_mid_training(rank, world, out_dir, kill_step):
    """Rank body: DDP training; rank 1 SIGKILLs itself at `kill_step`; rank 0 must raise."""
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    t_last = time.time()
    try:
        for step in range(10_000):
            if rank == 1 and step == kill_step:
                with open(os.path.join(out_dir, "killed"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            ddp(torch.randn(8, 32)).sum().backward()
            opt.step()
            if step % 5 == 0:
                dist.all_reduce(torch.ones(1))
            t_last = time.time()
    except Exception as exc:  # noqa: BLE001
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump({"t": time.time(), "last_step_t": t_last, "msg": str(exc)}, f)
        raise
    return "finished"


def test_peer_killed_mid_training_is_detected(pools, tmp_path):
    with pytest.raises(RankFailure) as info:
        pools(2).run(killed_mid_training, str(tmp_path), 20, pg_timeout_s=10, timeout=60,
                     env={"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"})
    text = str(info.value)
    assert "rank 1: died" in text, text[:2000]
    with open(tmp_path / "rank0.json") as f:
        r0 = json.load(f)
    killed = float((tmp_path / "killed").read_text())
    assert r0["t"] - killed < 10.0, (r0, killed)  # within the group timeout
    assert "did not answer" not in text


def dies_between_calls(rank, world, out_dir):
    """Rank body: rank 1 dies after checking in; rank 0's next call names it as dead."""
    import signal

    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    insp = backend_of().inspector
    t = torch.ones(20_000)  # above sync_fusion_limit: the eager path, waited on in slices
    dist.all_reduce(t)
    store = _store()
    if rank == 1:
        store.wait(["seen"])
        os.kill(os.getpid(), signal.SIGKILL)
    # Rank 0 has read rank 1's check-in (its pid and host) before rank 1 dies.
    assert _wait_for(lambda: insp.read_peers().get(1) is not None, 20)
    store.set("seen", "1")
    try:
        for _ in range(100):
            dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001
        with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    return "no error"


def test_dead_peer_is_named(pools, tmp_path):
    with pytest.raises(RankFailure):
        pools(2).run(dies_between_calls, str(tmp_path), pg_timeout_s=10, timeout=60,
                     env={"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2"})
    msg = (tmp_path / "rank0.txt").read_text()
    assert msg.startswith("PeerFailureError") and "Rank(s) [1] died" in msg, msg


def dies_with_fused_allreduces(rank, world, out_dir, case):
    """Rank body: rank 1 dies while rank 0's fused async allreduces are queued (its agreement
    round has no partner) or in flight (rank 1 issued them too, then died); every Work rank 0
    waits on must fail naming rank 1 as dead."""
    import signal
    import time

    import torch
    import torch.distributed as dist

    from gradientflow.backend import backend_of

    insp = backend_of().inspector
    dist.all_reduce(torch.ones(20_000))  # both ranks check in (pid, host) on the eager path
    store = _store()
    assert _wait_for(lambda: insp.read_peers().get(1 - rank) is not None, 20)
    store.set(f"seen/{rank}", "1")
    store.wait([f"seen/{1 - rank}"])
    tensors = [torch.full((1000,), float(rank)) for _ in range(40)]  # 4 KB each: deferred
    if rank == 1:
        if case == "in_flight":
            # Agree the batch with rank 0, send its first message of ten, and die at the
            # second's launch, after agreeing it: rank 0's second message is then in flight
            # with no partner, whatever the timing (waiting for "one message sent" from out
            # here raced: all ten could finish first, and rank 0 saw no error).
            engine = backend_of().engine
            launch = engine.messages.launch

            def launch_then_die(msg, seg, buf):
                if engine.stats.messages >= 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                launch(msg, seg, buf)

            engine.messages.launch = launch_then_die
            for t in tensors:
                dist.all_reduce(t, async_op=True)
            backend_of().flush()
            _wait_for(lambda: False, 20)  # the engine thread kills this process
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    errors, works = [], []
    try:  # the group may fail while rank 0 is still issuing: the next call then says why
        for t in tensors:
            works.append(dist.all_reduce(t, async_op=True))
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{type(exc).__name__}: {exc}")
    for w in works:
        try:
            w.wait()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump({"took": time.monotonic() - t0, "errors": errors}, f)
    return "done"


@pytest.mark.parametrize("case", ["queued", "in_flight"])
def test_dead_peer_is_named_by_fused_allreduces(pools, tmp_path, case):
    # 16 KB: the forty 4 KB allreduces go as ten fused messages.
    env = {"GRADIENTFLOW_INSPECT_INTERVAL_S": "0.2", "GRADIENTFLOW_FUSION_THRESHOLD": "16384"}
    with pytest.raises(RankFailure) as info:
        pools(2).run(dies_with_fused_allreduces, str(tmp_path), case, pg_timeout_s=10,
                     timeout=60, env=env)
    assert "rank 1: died" in str(info.value) and "rank 0" not in str(info.value), str(info.value)
    with open(tmp_path / "rank0.json") as f:
        r0 = json.load(f)
    # In flight, the first message completed before rank 1 died; the other nine must fail.
    assert r0["errors"], r0
    assert r0["took"] < 8.0, r0  # within the 10 s group timeout
    for msg in r0["errors"]:
        assert "Rank(s) [1] died" in msg, msg
