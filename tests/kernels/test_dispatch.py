"""Dispatch, argument checks, and the threading layer (fork-safe and thread-safe)."""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gradientflow import kernels as K


def test_impl_torch_and_numba_agree_and_bad_impl_is_refused():
    g = torch.randn(100)
    a = K.chunk_norms(g.clone(), None, 10, impl="torch")
    b = K.chunk_norms(g.clone(), None, 10, impl="numba")
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="impl must be one of"):
        K.chunk_norms(g, None, 10, impl="cuda")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: K.chunk_norms(torch.ones(4, dtype=torch.float64), None, 2),
         "grad must be torch.float32"),
        (lambda: K.chunk_norms(torch.ones(4, 2)[:, 0], None, 2), "1-D contiguous"),
        (lambda: K.chunk_norms(torch.ones(4), None, 0), "chunk_size must be"),
        (lambda: K.chunk_norms(torch.ones(4), torch.ones(3), 2), "residual must have 4"),
        (lambda: K.chunk_norms(torch.ones(4), None, 2, "l3"), "norm must be one of"),
        (lambda: K.chunk_norms(torch.ones(4), None, 2, momentum=torch.ones(4)), "both momentum"),
        (lambda: K.pack_chunks(torch.ones(4), torch.tensor([0]), 2, 1.0, torch.int8), "wire_dtype"),
        (lambda: K.pack_chunks(torch.ones(4), torch.tensor([5]), 2, 1.0, torch.float16),
         r"\[0, 2\)"),
        (lambda: K.pack_chunks(torch.ones(4), torch.tensor([0.0]), 2, 1.0, torch.float16), "int64"),
        (lambda: K.unpack_update(torch.ones(4), None, torch.ones(3), None, torch.tensor([0]), 2,
                                 1.0, 1.0, out=torch.ones(4)), "packed_reduced must have 2"),
        (lambda: K.set_num_threads(0), "set_num_threads"),
        (lambda: K.cast_feedback(torch.ones(4), torch.ones(3), 0.5, torch.float16, 2.0),
         "cast_feedback: residual must have 4"),
        (lambda: K.cast_feedback(torch.ones(4), None, 0.5, torch.float16, 2.0,
                                 out=torch.empty(4, dtype=torch.bfloat16)),
         "out must be torch.float16"),
        (lambda: K.cast_feedback(torch.ones(4), None, 0.5, torch.int8, 2.0), "wire_dtype"),
        (lambda: K.upcast_finite(torch.ones(4, dtype=torch.int16), 1.0, out=torch.empty(4)),
         "upcast_finite: x must be one of"),
        (lambda: K.upcast_finite(torch.ones(4), 1.0, out=torch.empty(3)), "out must have 4"),
    ],
)
def test_bad_arguments_are_refused_with_a_sentence(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_meta_tensors_fall_back_to_torch_and_numba_is_refused():
    g = torch.empty(8, device="meta")
    assert K.chunk_norms(g, None, 4).device.type == "meta"
    with pytest.raises(ValueError, match="supports CPU and CUDA"):
        K.chunk_norms(g, None, 4, impl="numba")


def test_threads_per_rank_shares_the_cores():
    assert K.threads_per_rank(2, cores=2) == 1
    assert K.threads_per_rank(1, cores=2) == 2
    assert K.threads_per_rank(4, cores=2) == 1
    with pytest.raises(ValueError):
        K.threads_per_rank(0)


def test_set_num_threads_applies_in_the_launching_thread():
    K.chunk_norms(torch.ones(10), None, 2)
    before = K.get_num_threads()
    try:
        K.set_num_threads(1)
        seen = []

        def work():
            import numba

            K.chunk_norms(torch.ones(10), None, 2)
            seen.append(numba.get_num_threads())

        t = threading.Thread(target=work)
        t.start()
        t.join(timeout=60)
        assert seen == [1]
    finally:
        K.set_num_threads(before)


def test_concurrent_launches_from_many_threads_are_safe():
    """workqueue would abort here; TBB (or the lock on workqueue) must not."""
    x = torch.randn(200_000)
    expect = K.chunk_norms(x.clone(), None, 1000, impl="torch")
    errors = []

    def work():
        try:
            for _ in range(30):
                got = K.chunk_norms(x.clone(), None, 1000)
                torch.testing.assert_close(got, expect)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_threading_layer_is_tbb_on_linux():
    """The tbb wheel is a Linux dependency (pyproject.toml): without it the kernels fall back to
    workqueue and a lock, which serialises the ranks' communication threads."""
    want = "tbb" if sys.platform.startswith("linux") else "workqueue"
    assert K.threading_layer() == want


# A daemon thread (as the engine's) launches kernels with pauses between them, on one core: a
# TBB pool started by that thread made the interpreter's exit wait forever (numba issue 10556).
_EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
    import torch
    {import_cpu_on_main}
    def work():
        from gradientflow import kernels as K
        x, out = torch.randn(30000), torch.empty(30000, dtype=torch.float16)
        for _ in range(100):
            K.cast_scaled(x, 0.5, torch.float16, out=out, impl="numba")
            time.sleep(0.001)
    t = threading.Thread(target=work, daemon=True, name="0-engine")
    t.start()
    t.join()
    from gradientflow import kernels as K
    print("layer", K.threading_layer(), flush=True)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TBB and affinity: Linux")
@pytest.mark.parametrize("on_main, layer", [(True, "tbb"), (False, "workqueue")],
                         ids=["kernels-imported-on-main", "first-use-on-a-thread"])
def test_process_exits_after_kernels_ran_on_another_thread(on_main, layer):
    """Built or imported on the main thread, the kernels' pool is TBB and started there; first
    needed on another thread, it is workqueue. Either way the process exits."""
    script = _EXIT_SCRIPT.format(
        import_cpu_on_main="from gradientflow.kernels import cpu" if on_main else "")
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_THREADING_LAYER"}
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=90, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit within 90 s after its work: {exc.stdout!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"layer {layer}" in proc.stdout, proc.stdout


def test_forked_child_can_run_kernels_and_torch():
    """After a parallel kernel, a forked child must still run kernels (GNU OpenMP would kill it)."""
    script = textwrap.dedent(
        """
        import os, torch
        from gradientflow import kernels as K
        # impl="numba": the kernels themselves (auto may run the torch reference until they
        # are loaded, kernels/warm.py), whose threading layer must survive the fork.
        K.chunk_norms(torch.randn(100000), None, 100, impl="numba")
        torch.randn(1000).sum()
        pid = os.fork()
        if pid == 0:
            n = K.chunk_norms(torch.ones(100000), None, 100, impl="numba")
            ok = bool((n == 100).all()) and torch.ones(1000).sum().item() == 1000
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("layer", K.threading_layer(), "child", status)
        raise SystemExit(0 if status == 0 else 1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workqueue_layer_is_serialised_by_the_lock():
    """Without TBB, numba's workqueue layer aborts on concurrent launches: the lock prevents it."""
    script = textwrap.dedent(
        """
        import threading, torch
        from gradientflow import kernels as K
        x = torch.randn(300_000)
        expect = K.chunk_norms(x.clone(), None, 1000, impl="torch")
        assert K.threading_layer() == "workqueue", K.threading_layer()
        errors = []
        def work():
            try:
                for _ in range(20):
                    torch.testing.assert_close(K.chunk_norms(x.clone(), None, 1000), expect)
            except Exception as exc:
                errors.append(exc)
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        raise SystemExit(1 if errors else 0)
        """
    )
    env = dict(__import__("os").environ, NUMBA_THREADING_LAYER="workqueue")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cuda_module_imports_and_is_usable_exactly_when_torch_sees_a_gpu():
    """The lazily imported module loads everywhere; it runs kernels where torch has CUDA, and
    elsewhere says why not (the dispatch then names that reason)."""
    proc = subprocess.run(
        [sys.executable, "-c",
         "from gradientflow.kernels import cuda\n"
         "try:\n    cuda.check_available()\n"
         "except RuntimeError as e:\n    print('unavailable', e)\n"
         "else:\n    print('available')\n"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if torch.cuda.is_available():
        assert proc.stdout.startswith("available"), proc.stdout
    else:
        assert proc.stdout.startswith("unavailable numba.cuda.is_available() is False"), proc.stdout


def test_the_table_names_each_op_once_with_its_implementations():
    """Every op: a validator and a reference of its name, a numba CPU kernel, and a CUDA kernel
    exactly where OPS says; the public function has the validator's signature plus impl."""
    import inspect

    from gradientflow.kernels import checks, cpu, cuda, reference

    assert set(K.OPS) == set(reference.__all__) - {"nchunks_of"}
    for op, spec in K.OPS.items():
        assert spec.validate is getattr(checks, op) and spec.reference is getattr(reference, op)
        assert spec.cpu and callable(getattr(cpu, op))
        assert spec.cuda == (op in cuda.__all__), op
        public = inspect.signature(getattr(K, op))
        params = list(inspect.signature(spec.validate).parameters)
        assert list(public.parameters) == params + ["impl"], op
        assert getattr(K, op).__doc__ == spec.validate.__doc__


def test_dispatch_picks_numba_on_cpu_and_the_reference_elsewhere():
    cpu_dev, meta = torch.device("cpu"), torch.device("meta")
    from gradientflow.kernels import cpu, reference

    for op in K.OPS:
        assert K.implementation(op, "auto", cpu_dev) is getattr(cpu, op)
        assert K.implementation(op, "torch", cpu_dev) is getattr(reference, op)
        assert K.implementation(op, "auto", meta) is getattr(reference, op)


def test_forced_chunks_and_all_finite_agree_with_the_reference():
    norms = torch.tensor([3.0, float("nan"), 1.0, 5.0, 2.0])
    forced = torch.tensor([False, False, True, False, False])
    for impl in ("numba", "torch"):
        assert K.select_chunks(norms, 2, forced=forced, impl=impl).tolist() == [1, 2, 3]
        assert K.all_finite(norms, impl=impl) is False
        assert K.all_finite(torch.ones(3, dtype=torch.float16), impl=impl) is True


def test_a_scale_may_be_a_one_element_tensor():
    """A scale factor given as a one-element float32 tensor (a wire scale agreed on the device)
    computes what the number does; any other tensor is refused with the op and the argument."""
    from bits import assert_same_bits

    x = torch.randn(1000) * 100
    for impl in ("numba", "torch"):
        got = K.cast_scaled(x, torch.tensor([0.25]), torch.float16, impl=impl)
        assert_same_bits(got, K.cast_scaled(x, 0.25, torch.float16, impl="torch"))
    idx = torch.tensor([1, 3])
    packed = K.pack_chunks(x, idx, 100, torch.tensor([0.5]), torch.float32)
    assert_same_bits(packed, K.pack_chunks(x, idx, 100, 0.5, torch.float32, impl="torch"))
    for bad in (torch.tensor([0.5, 0.5]), torch.tensor([1], dtype=torch.int64),
                torch.tensor([0.5], dtype=torch.float64)):
        with pytest.raises(ValueError, match="cast_scaled: scale must be a number or a one-elem"):
            K.cast_scaled(x, bad, torch.float16)
