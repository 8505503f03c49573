"""Bad input: each case gets a correct result or a clear error; none hangs or corrupts a tensor."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness import RankFailure, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("var,value", [
    ("GRADIENTFLOW_INSPECT_INTERVAL_S", "-1"), ("GRADIENTFLOW_INSPECT_INTERVAL_S", "often"),
    ("GRADIENTFLOW_STALL_WARNING_S", "1e9"), ("GRADIENTFLOW_STALL_ABORT_S", "soon"),
    ("GRADIENTFLOW_DEBUG", "maybe"), ("GRADIENTFLOW_FUSION_THRESHOLD", "-3MB"),
    ("GRADIENTFLOW_STALL_WARNNG_S", "5"),
])
def test_invalid_environment_is_a_sentence(var, value):
    from gradientflow.config import Config

    with pytest.raises(ValueError) as info:
        Config.resolve(environ={var: value})
    msg = str(info.value)
    assert var in msg or var.lower().replace("gradientflow_", "") in msg, msg


def invalid_env_at_init(rank, world):  # never runs: init fails first
    return "initialised"


def test_invalid_environment_fails_init_on_every_rank(pools):
    with pytest.raises(RankFailure) as info:
        pools(2).run(invalid_env_at_init, env={"GRADIENTFLOW_INSPECT_INTERVAL_S": "-1"},
                     pg_timeout_s=10, timeout=60)
    text = str(info.value)
    assert "ranks [0, 1]" in text and "GRADIENTFLOW_INSPECT_INTERVAL_S" in text, text[:2000]
    assert "did not answer" not in text


WORLD_SCRIPT = textwrap.dedent("""
    import datetime, sys, torch.distributed as dist
    import gradientflow
    rank, port, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    try:
        dist.init_process_group("gradientflow", init_method="tcp://127.0.0.1:" + port, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=10))
    except Exception as exc:
        print("ERROR", exc)
        sys.exit(3)
    print("initialised")
""")


def test_mismatched_world_sizes_are_refused(tmp_path):
    script = tmp_path / "world.py"
    script.write_text(WORLD_SCRIPT)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTFLOW_")}
    env["PYTHONPATH"] = ROOT
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(w)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, w in ((0, 2), (1, 3))]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung on mismatched world sizes")
        outs.append(out)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 3, (r, out)
        assert (
            "mismatched world sizes" in out and "world_size=2" in out and "world_size=3" in out
        ), out


def bad_inputs(rank, world):
    """Rank body: every bad input in turn; after each, a sentinel and the group are intact."""
    import torch
    import torch.distributed as dist

    sentinel = torch.arange(6, dtype=torch.float32)
    keep = sentinel.clone()
    out = {}

    def check_group():
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 4, t
        assert torch.equal(sentinel, keep)

    def expect_error(name, fn, *words):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            msg = str(exc)
            missing = [w for w in words if w not in msg]
            out[name] = "ok" if not missing else f"error lacks {missing}: {msg}"
        else:
            out[name] = "no error"
        check_group()

    # A strided view and a sparse COO SUM are reduced as gloo reduces them (the view in place;
    # tests/conformance compares every collective with gloo).
    view = torch.ones(4, 4).t()
    dist.all_reduce(view)
    out["non_contiguous"] = "ok" if bool((view == world).all()) else f"wrong: {view}"
    check_group()
    sparse = torch.eye(3).to_sparse()
    dist.all_reduce(sparse)
    dense = sparse.to_dense()
    out["sparse"] = "ok" if torch.equal(dense, world * torch.eye(3)) else f"wrong: {dense}"
    check_group()
    expect_error("mixed_devices", lambda: dist.all_gather(
        [torch.empty(3), torch.empty(3, device="meta")], torch.ones(3)), "device")
    expect_error("avg_int", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32),
                                                    op=dist.ReduceOp.AVG), "AVG", "integer")
    expect_error("band_float", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
                 "bitwise")
    expect_error("max_complex", lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64),
                                                        op=dist.ReduceOp.MAX), "complex")
    expect_error("bad_root", lambda: dist.broadcast(torch.ones(3), src=5), "rank 5")

    # Zero-size tensors: every path returns at once with an empty result.
    z = torch.ones(0)
    dist.all_reduce(z)
    dist.all_reduce(z, async_op=True).wait()
    dist.broadcast(z, src=0)
    outs = [torch.ones(0) for _ in range(world)]
    dist.all_gather(outs, z)
    out["zero_size"] = "ok" if all(o.numel() == 0 for o in outs) else "wrong"
    check_group()

    # NaN and Inf propagate (sync, and async through the fused path).
    for async_op in (False, True):
        t = torch.tensor([float("nan"), float("inf"), 1.0, -float("inf") if rank else 2.0])
        w = dist.all_reduce(t, async_op=async_op)
        if async_op:
            w.wait()
        got = t.tolist()
        ok = (
            got[0] != got[0]
            and got[1] == float("inf")
            and got[2] == 2.0
            and got[3] == -float("inf")
        )
        out[f"nan_inf_async={async_op}"] = "ok" if ok else f"wrong {got}"
    check_group()
    return out


def test_bad_inputs_get_results_or_sentences(pools):
    results = pools(2).run(bad_inputs, pg_timeout_s=10, timeout=120)
    for r in results:
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, bad


def very_large(rank, world, numel):
    """Rank body: a 300 MB allreduce; returns the checks rather than the tensor."""
    import torch
    import torch.distributed as dist

    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t)
    ok = bool((t == 3.0).all())
    del t
    # The group is still fine afterwards.
    u = torch.ones(2)
    dist.all_reduce(u)
    return ok and u.tolist() == [2.0, 2.0]


def test_very_large_tensor(pools):
    assert pools(2).run(very_large, 75_000_000, pg_timeout_s=60, timeout=180) == [True, True]


def destroy_in_flight(rank, world):
    """Rank body: destroy the group with a queued async allreduce; its wait raises clearly."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 1:
        return "idle"
    w = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never joins
    t0 = time.monotonic()
    dist.destroy_process_group()
    try:
        w.wait()
    except Exception as exc:  # noqa: BLE001
        return [time.monotonic() - t0, str(exc)]
    return [time.monotonic() - t0, "no error"]


def test_destroy_with_operations_in_flight(pools):
    res = pools(2).run(destroy_in_flight, pg_timeout_s=10, timeout=60)
    took, msg = res[0]
    assert "destroyed" in msg and "wait on every Work" in msg, msg
    assert took < 8, took
