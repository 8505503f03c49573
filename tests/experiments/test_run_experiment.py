"""experiments/imagenet/run_experiment.py: time to accuracy, run order, ranks' watchdog, lock."""
from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments" / "imagenet"
sys.path.insert(0, str(HERE))  # run_experiment.py imports its siblings as the script does

import run_experiment as rx  # noqa: E402


def _log(top1: list, train_s: float = 10.0) -> list:
    return [{"epoch": e, "val_top1": t, "train_time_s": train_s + e} for e, t in enumerate(top1)]


def _fill(logs: dict) -> None:
    """Give every epoch record the fields summarise() reads besides top-1 and time."""
    for log in (r for runs in logs.values() for r in runs):
        for record in log:
            record.update(val_top5=100.0, wire_bytes=1, steps=1, dense_bytes=1,
                          wire_bytes_per_step=1.0, dense_bytes_per_step=1.0, images_per_s=1.0,
                          comm_s=0.0, train_loss=0.1, val_loss=0.1)


def test_time_to_target_sums_training_time_up_to_the_first_epoch_at_the_target():
    log = _log([50.0, 96.9, 97.0, 96.0, 98.0])
    assert rx.time_to_top1(log, 97.0) == pytest.approx(10 + 11 + 12)
    assert rx.time_to_top1(log, 50.0) == pytest.approx(10)
    assert rx.time_to_top1(log, 98.5) is None
    assert rx.epoch_at_top1(log, 97.0) == 2 and rx.epoch_at_top1(log, 98.5) is None


def test_speedup_is_per_seed_and_of_the_means_of_the_runs_that_reached_the_target():
    up = rx.speedups([300.0, 200.0, 250.0], [100.0, None, 50.0])
    assert up["per_seed"] == [3.0, None, 5.0]
    assert up["of_means"] == pytest.approx(250.0 / 75.0)
    assert up["reached"] == 2
    assert rx.speedups([300.0], [None])["of_means"] is None


def test_summary_and_table_give_the_ratio_against_ddp_on_gloo(tmp_path):
    logs = {"ddp-gloo": [_log([90, 97, 98], 30.0)] * 2, "csc-default": [_log([96, 97.5, 98], 10.0)]
            * 2}
    _fill(logs)
    metas = {k: [{"loadavg_before": [3.0, 0, 0], "loadavg_after": [4.5, 0, 0]}] * 2
             for k in logs}
    summary = rx.summarise(logs, target=97.0, metas=metas)
    up = summary["csc-default"]["speedup_vs_baseline"]
    assert up["per_seed"] == [pytest.approx(61 / 21)] * 2
    assert summary["ddp-gloo"]["speedup_vs_baseline"]["of_means"] == pytest.approx(1.0)
    text = rx.markdown(summary, 3, [0, 1], 2, "gradientflow", "cmd", link_gbps=1.0)
    assert "emulated 1 Gbps switch" in text
    assert "against DDP gloo dense FP32" in text  # no "dense" ran: the delta's reference says so
    row = next(line for line in text.splitlines()
               if line.startswith("| GradientFlow CSC 1% default | 21 @1"))
    assert "2.90x, 2.90x" in row and "3.0-4.5" in row
    assert summary["csc-default"]["run_speedup_vs_baseline"] == pytest.approx(93 / 33)
    untimed = rx.markdown(summary, 3, [0, 1], 2, "gradientflow", "cmd", timed=False)
    assert "Accuracy only" in untimed and "speed-up vs DDP gloo" not in untimed



def test_the_no_communication_limit_bounds_the_speedup_over_dense_convergence():
    logs = {"ddp-gloo": [_log([90, 97, 98], 30.0), _log([90, 96, 97], 30.0)],
            "nocomm": [_log([50, 60, 70], 5.0), _log([50, 60, 70], 7.0)]}
    _fill(logs)
    metas = {k: [{"loadavg_before": [1.0, 0, 0], "loadavg_after": [1.0, 0, 0]}] * 2
             for k in logs}
    summary = rx.summarise(logs, target=97.0, metas=metas)
    bound = rx.speedup_bound(summary)
    # DDP reached at epoch 1 (61 s) and epoch 2 (93 s); the limit's same epochs: 11 s and 24 s.
    assert bound["per_seed"] == [pytest.approx(61 / 11), pytest.approx(93 / 24)]
    assert bound["of_means"] == pytest.approx(77 / 17.5)
    assert bound["s_per_epoch"] == pytest.approx(7.5)  # median of 6, 7, 8, 9 (epochs 1 on)
    text = rx.markdown(summary, 3, [0, 1], 2, "gradientflow", "cmd", link_gbps=1.0)
    assert f"{77 / 17.5:.2f}x less time" in text
    # Its ranks do not average: no time-to-target row of its own.
    assert not any(line.startswith("| no communication") and "@" in line
                   for line in text.splitlines())
    assert rx.speedup_bound({"ddp-gloo": summary["ddp-gloo"]}) is None

def test_runs_go_seed_by_seed_so_that_load_drift_hits_every_setting():
    assert rx.run_order(["a", "b"], [0, 1]) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_a_finished_run_is_kept_only_for_the_same_link_and_epochs(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "k-seed0.jsonl").write_text(
        "\n".join(json.dumps(r) for r in _log([1, 2])) + "\n")
    assert not rx.finished(tmp_path, "k", 0, 2, 1.0)  # no meta file: not one of ours
    (tmp_path / "logs" / "k-seed0.meta.json").write_text(json.dumps({"link_gbps": 1.0}))
    assert rx.finished(tmp_path, "k", 0, 2, 1.0)
    assert not rx.finished(tmp_path, "k", 0, 2, None)
    assert not rx.finished(tmp_path, "k", 0, 3, 1.0)


@pytest.mark.parametrize("value", ["0", "-1", "fast"])
def test_link_rate_must_be_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as exc:
        rx.main(["--link-gbps", value, "--no-run"])
    assert exc.value.code == 2
    assert "--link-gbps" in capsys.readouterr().err


def test_ddp_gloo_runs_on_gloo_whatever_the_default_transport():
    assert rx.TRANSPORT["ddp-gloo"] == "gloo"
    assert "--selection" in rx.SETTINGS["csc-pool"][1]
    assert set(rx.DEFAULT_SETTINGS) <= set(rx.SETTINGS)


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_watchdog_names_the_failed_rank_and_stops_waiting_for_the_others():
    procs = [_proc("import time; time.sleep(60)"), _proc("import sys; sys.exit(3)")]
    try:
        assert rx.wait_ranks(procs, timeout=60, grace=0.5) == (1, "exited with code 3")
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_watchdog_times_out_and_returns_none_when_every_rank_succeeds():
    ok = [_proc("pass"), _proc("pass")]
    assert rx.wait_ranks(ok, timeout=60) is None
    slow = [_proc("import time; time.sleep(60)")]
    try:
        assert rx.wait_ranks(slow, timeout=0.5) == (0, "timed out after 0 s")
    finally:
        slow[0].kill()
        slow[0].wait(timeout=10)


def test_the_lock_is_held_during_the_block_and_released_after(tmp_path):
    lock = tmp_path / "timing.lock"
    with rx.held(lock):
        with open(lock) as fh, pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_every_run_records_when_where_which_commit_and_each_ranks_cpu(tmp_path):
    """A tiny real run (one rank, loopback): the meta file carries the provenance fields."""
    import prepare

    data = prepare.prepare(tmp_path / "digits", size=16, limit=40)
    common = [str(data), "-a", "resnet18", "--image-size", "16", "--num-classes", "10",
              "-b", "8", "--augment", "none", "--steps-per-epoch", "2", "-j", "0",
              "--no-checkpoint"]
    rx.run_one("dense", 0, 1, tmp_path / "out", 1, "gloo", 200, common=common)
    meta = rx.read_meta(tmp_path / "out", "dense", 0)
    assert meta["started_utc"] <= meta["ended_utc"] and meta["ended_utc"].endswith("+00:00")
    assert meta["host"] and meta["commit"] != "" and meta["wall_s"] > 0
    assert len(meta["rank_cpu_s"]) == 1 and meta["cpu_s"] == pytest.approx(
        sum(meta["rank_cpu_s"]), abs=0.1) and meta["cpu_s"] > 0
    assert len(meta["loadavg_before"]) == 3 and len(meta["loadavg_after"]) == 3
    last = [r for r in rx.read_log(tmp_path / "out" / "logs" / "dense-seed0.jsonl")
            if "thread_cpu_s" in r][-1]
    assert last["thread_cpu_s"]["MainThread"] > 0  # where the rank's CPU went, by thread


def test_cpu_by_thread_names_python_threads_and_folds_their_numbers():
    import threading
    import time

    import provenance

    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:  # 0.3 s of CPU on this thread
            pass
        spun.set()
        done.wait(10)  # alive (and so listed) until read

    th = threading.Thread(target=spin, name="12-engine")
    th.start()
    try:
        assert spun.wait(10)
        assert provenance.thread_cpu_seconds().get("N-engine", 0.0) >= 0.25  # 10 ms ticks
    finally:
        done.set()
        th.join(10)


def test_a_run_that_read_the_test_set_once_is_summarised_by_it():
    logs = {"dense": [_log([50.0, 60.0]), _log([55.0, 65.0])]}
    _fill(logs)
    logs["dense"][0][-1].update(test_top1=58.0, test_top5=90.0)  # --report-test
    s = rx.summarise(logs)["dense"]
    assert (s["top1_min"], s["top1_max"]) == (58.0, 65.0)  # the other run predates it
    assert s["top5_mean"] == pytest.approx(95.0)
