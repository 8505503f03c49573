"""Fashion-MNIST, the two model shapes, the peers (torch's hooks, Horovod's launch) and the
comparison's report: experiments/imagenet/{prepare,models,train,hvd_launch,compare}.py."""
from __future__ import annotations

import argparse
import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments" / "imagenet"
sys.path.insert(0, str(HERE))  # the scripts import their siblings as they do when run

import compare  # noqa: E402
import hvd_launch  # noqa: E402
import models  # noqa: E402
import prepare  # noqa: E402
import run_experiment as rx  # noqa: E402
from test_train import SCRIPT, TIMEOUT, _env, train  # noqa: E402


def _idx(path: Path, n: int, images: bool) -> None:
    """A gzipped IDX file of n 28x28 images (pixel = index) or n labels (index mod 10)."""
    if images:
        head = struct.pack(">IIII", 2051, n, 28, 28)
        body = bytes(i % 256 for i in range(n) for _ in range(28 * 28))
    else:
        head, body = struct.pack(">II", 2049, n), bytes(i % 10 for i in range(n))
    with gzip.open(path, "wb") as f:
        f.write(head + body)


@pytest.fixture
def fashion_src(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in prepare.FASHION_FILES:
        _idx(src / f"{name}.gz", 12 if name.startswith("train") else 6, "images" in name)
    return src


def test_fashion_files_are_unpacked_where_torchvision_reads_them(fashion_src, tmp_path):
    out = prepare.prepare_fashion(tmp_path / "fm", fashion_src, install=False)
    raw = out / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(prepare.FASHION_FILES)
    cfg = train.resolve(train.parse_args([str(out), "-a", "alexnet_shaped", "-b", "4"]), env={})
    assert cfg.dataset == "fashion-mnist" and cfg.image_size == 28
    train_set, val_set, test_set = train.build_datasets(cfg)
    assert len(train_set) == 12 and len(val_set) == 6 and test_set is None
    x, y = val_set[3]
    # normalised as torchvision's class read it: pixel 3 everywhere, label 3, one channel
    assert x.shape == (1, 28, 28) and y == 3
    assert torch.allclose(x, torch.full_like(x, (3 / 255 - train.FASHION_MEAN) / train.FASHION_STD))
    torch.manual_seed(0)
    xa, _ = train_set[5]  # augmented: a shift of at most 2 pixels, zero-padded, maybe flipped
    assert xa.shape == (1, 28, 28) and (xa == train_set.x[5, 0, 0, 0]).float().mean() > 0.8
    # --val-split: 4 training images scored unaugmented each epoch, the test set kept apart
    cfg = train.resolve(train.parse_args([str(out), "-a", "alexnet_shaped", "-b", "4",
                                          "--val-split", "4"]), env={})
    train_set, val_set, test_set = train.build_datasets(cfg)
    assert len(train_set) == 8 and len(val_set) == 4 and len(test_set) == 6
    for i in range(4):
        x, y = val_set[i]
        pixel = val_set.indices[i]  # the image's index in the training set, as its pixels say
        assert y == pixel % 10 and torch.allclose(
            x, torch.full_like(x, (pixel / 255 - train.FASHION_MEAN) / train.FASHION_STD))


def test_missing_fashion_files_say_what_to_do(tmp_path):
    with pytest.raises(prepare.DataUnavailable, match="apt-get install dataset-fashion-mnist"
                       "|copy the four .gz IDX files"):
        prepare.ensure_fashion_package(tmp_path, install=False)
    assert train.main([str(tmp_path), "--dataset", "fashion-mnist"]) == 2


@pytest.mark.parametrize("argv, words", [
    (["--dummy", "--horovod", "--compression", "csc"], "--horovod takes"),
    (["--dummy", "--compression", "powersgd", "--powersgd-start-iter", "1"], "--powersgd"),
    (["--dummy", "--fsdp", "--compression", "powersgd", "--no-checkpoint"], "--fsdp runs with"),
    (["--dummy", "--fsdp", "--compression", "csc"], "--no-checkpoint"),
    (["--dummy", "--compression", "powersgd", "--compression-group", "gradientflow"],
     "--compression-group gradientflow puts"),
])
def test_peer_flags_are_checked_before_init(argv, words, capsys):
    assert train.main(argv) == 2 and words in capsys.readouterr().err


def test_the_constant_schedule_keeps_the_rate():
    cfg = train.resolve(train.parse_args(["--dummy", "--lr-schedule", "constant", "--lr", "0.2",
                                          "-b", "256"]), env={})
    assert [train.learning_rate(cfg, e) for e in (0, 1.5, 80)] == [0.2, 0.2, 0.2]


def test_the_two_shapes_keep_what_makes_alexnet_and_resnet_differ():
    alex, res = models.alexnet_shaped(), models.resnet_shaped()
    for m in (alex, res):
        assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)

    def fc_share(m):
        fc = sum(p.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear)
                 for p in mod.parameters())
        return fc / sum(p.numel() for p in m.parameters())

    assert fc_share(alex) > 0.95 and fc_share(res) < 0.01  # AlexNet: 58 of 61 M in FC layers
    from torchvision.models.resnet import BasicBlock
    assert sum(isinstance(m, BasicBlock) for m in res.modules()) == 8  # ResNet-18's blocks
    assert len(list(res.parameters())) == 62 and len(list(alex.parameters())) < 25


@pytest.mark.parametrize("method, extra", [("torch-fp16", []),
                                           ("powersgd", ["--powersgd-start-iter", "2"]),
                                           ("gf-powersgd", ["--powersgd-start-iter", "2"])])
def test_torch_hooks_train_and_count_their_bytes(method, extra, tmp_path):
    """torch's hooks, and PowerSGD on GradientFlow's engine started as torch's is."""
    log = tmp_path / "log.jsonl"
    backend = "gradientflow" if method.startswith("gf-") else "gloo"
    cmd = [sys.executable, str(SCRIPT), "--dummy", "--dataset", "fashion-mnist", "-a",
           "alexnet_shaped", "--num-classes", "10", "-b", "4", "--steps-per-epoch", "4",
           "--epochs", "1", "-j", "0", "--dist-backend", backend, "--compression", method,
           "--no-checkpoint", "--json-log", str(log), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = [json.loads(line) for line in log.read_text().splitlines()]
    dense_step = 4 * sum(p.numel() for p in models.alexnet_shaped().parameters())
    assert r["dense_bytes"] == 4 * dense_step
    if method == "torch-fp16":
        assert r["wire_bytes"] == r["dense_bytes"] // 2
    else:  # two plain steps, then rank-2 factors: far fewer bytes than two more dense steps
        assert 2 * dense_step < r["wire_bytes"] < 2.2 * dense_step


def test_nic_bytes_are_read_for_the_gloo_interface_only(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert train.nic_tx_bytes() is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert train.nic_tx_bytes() is None


def test_horovod_slots_number_ranks_per_host_as_horovodrun_does():
    two_hosts = hvd_launch.slot_plan(["10.0.0.1", "10.0.0.2"])
    assert two_hosts == [("10.0.0.1", 0, 0, 0, 2, 1, 2), ("10.0.0.2", 1, 0, 1, 2, 1, 2)]
    loopback = hvd_launch.slot_plan(["127.0.0.1"] * 3)
    assert [s[2] for s in loopback] == [0, 1, 2] and {s[5] for s in loopback} == {3}
    env = hvd_launch.rank_env(1, ["a", "b"], "a", 4242, "gfnic")
    assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242"
    assert env["HOROVOD_GLOO_IFACE"] == "gfnic" and env["HOROVOD_CONTROLLER"] == "gloo"
    assert "make horovod" in hvd_launch.horovod_unavailable(Path("/no/such/python"))


def _run(top1: list, secs: float, steps: int = 10) -> list:
    return [{"epoch": e, "val_top1": t, "train_time_s": secs, "steps": steps,
             "images_per_s": 1.0, "wire_bytes_per_step": 1.0, "nic_tx_bytes": steps * 100}
            for e, t in enumerate(top1)]


def test_the_target_is_what_every_ddp_seed_reached_before_its_last_epoch():
    assert compare.target_of([_run([80.2, 86.7, 88.0], 1), _run([81.0, 86.3, 87.0], 1)]) == 86.0
    assert compare.target_of([_run([80.0], 1)]) is None


def test_verdict_and_table_say_met_missed_and_why_a_peer_did_not_run():
    target = 86.0
    rows = {"ddp-gloo": compare.peer_row("ddp-gloo", [_run([80, 86.5, 88.0], 30.0)] * 2,
                                         target, 0.01, None),
            rx.OURS: compare.peer_row(rx.OURS, [_run([79, 86.2, 87.8], 8.0)] * 2,
                                      target, 0.01, None),
            "powersgd-2": compare.peer_row("powersgd-2", [_run([70, 86.1, 87.0], 10.0)] * 2,
                                           target, 0.02, None)}
    v = {text: (ok, nums) for text, ok, nums in compare.verdict(rows, "plain")}
    assert v["top-1 within 0.5 point of DDP (mean of seeds)"] == (True, "-0.20 points")
    assert v["1 Gbit/s: time to target >= 3x sooner than DDP"] == (True, "3.75x")
    ok, nums = v["1 Gbit/s: >= 1.5x sooner than the best other peer"]
    assert not ok and nums.startswith("1.25x")
    results = [{"model": "alexnet_shaped", "recipes": {"plain": {
        "target_top1": target, "rows": rows, "verdict": compare.verdict(rows, "plain"),
        "unavailable": {"horovod": "Horovod is not built here"}}}}]
    text = compare.markdown(results, 3, [0, 1], "cmd")
    assert "| Horovod 0.28.1 | did not run: Horovod is not built here |" in text
    assert "**missed** (1.25x (DDP + PowerSGD rank 2))" in text


def test_the_demo_without_root_adds_a_ring_allreduce_of_the_measured_bytes():
    import demo

    log = [{"train_time_s": 2.0, "wire_bytes": 125_000_000, "val_top1": 50.0},
           {"train_time_s": 1.0, "wire_bytes": 0, "val_top1": 60.0}]
    # 2 ranks: each sends its 1 Gbit once per allreduce, 1 s on a 1 Gbit/s link
    assert demo.modelled_times(log, 1.0, 2) == [3.0, 4.0]
    c = demo.curve(log, shaped=False, link_gbps=1.0, nproc=4)
    assert c["time_s"] == [3.5, 4.5] and c["sent_mb"] == [125.0, 125.0] and c["top1"] == [50, 60]


def test_the_demo_says_which_way_the_time_went():
    import demo

    assert demo.time_sentence(69.7, 40.7) == "1.7x less training time"
    assert demo.time_sentence(66.0, 82.2) == "1.25x more training time"  # not "0.8x less"
    assert demo.time_sentence(50.0, 50.0) == "1.0x less training time"


def test_compare_runs_every_peer_at_1_gbps_and_times_them_at_10_gbps_and_4_ranks():
    args = argparse.Namespace(
        seeds=[10, 11, 12], epochs=3, lock=None, timeout=60, quick=False, quick_steps=40,
        step_steps=60, step_repeats=5, peers=None)
    stages = dict(compare.stages(args))
    assert set(stages) == {f"{m}/{s}" for m in compare.MODELS
                           for s in ("1gbps-plain", "1gbps-schedule", "1gbps-step",
                                     "10gbps-step")} | {
        "alexnet_shaped/1gbps-4ranks-step"}
    plain = stages["resnet_shaped/1gbps-plain"]
    assert all(k in plain for k in rx.PEERS) and "nocomm" in plain
    assert plain[plain.index("--seeds") + 1:plain.index("--seeds") + 4] == ["10", "11", "12"]
    # the protocol: validation every epoch, the test set once; step stages never read it
    assert plain[plain.index("--train-args") + 1] == "--val-split 10000 --report-test"
    step_args = stages["resnet_shaped/10gbps-step"]
    assert step_args[step_args.index("--train-args") + 1] == \
        "--val-split 10000 --steps-per-epoch 60"
    four = stages["alexnet_shaped/1gbps-4ranks-step"]
    assert four[four.index("--nproc") + 1] == "4" and "--steps-per-epoch 60" in " ".join(four)
    step = stages["alexnet_shaped/1gbps-step"]
    assert "nocomm" in step and step[step.index("--link-gbps") + 1] == "1"
    # every step-time stage repeats 5 times: seeds 0-4, one run of each setting per seed
    for folder in ("alexnet_shaped/1gbps-step", "resnet_shaped/10gbps-step",
                   "alexnet_shaped/1gbps-4ranks-step"):
        argv = stages[folder]
        assert argv[argv.index("--seeds") + 1:argv.index("--epochs")] == ["0", "1", "2", "3", "4"]


def test_settings_interleave_seed_by_seed_not_setting_by_setting():
    order = rx.run_order(["A", "B", "C"], [0, 1])
    assert order == [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1)]


def test_the_step_table_gives_the_median_and_range_of_the_repeats(tmp_path):
    for seed, step_s in enumerate([0.10, 0.12, 0.30, 0.11, 0.13]):
        folder = tmp_path / "alexnet_shaped" / "1gbps-step" / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"ddp-gloo-seed{seed}.jsonl").write_text("".join(
            json.dumps({"epoch": e, "steps": 10, "train_time_s": 10 * step_s * (2 - e),
                        "val_top1": 10.0}) + "\n" for e in range(2)))
    res = compare.summarise_model(tmp_path, "alexnet_shaped")
    assert res["steps"]["1 Gbit/s"]["ddp-gloo"] == pytest.approx(0.12)
    text = "\n".join(compare.step_markdown(res))
    assert "| DDP gloo dense FP32 | 120 (100-300, n=5), 1.00x |" in text


def test_the_step_table_says_how_much_faster_than_ddp_any_setting_can_step():
    res = {"model": "alexnet_shaped", "recipes": {}, "steps": {
        "1 Gbit/s": {"ddp-gloo": 0.2, rx.OURS: 0.1, "nocomm": 0.08},
        "10 Gbit/s": {"ddp-gloo": 0.1, rx.OURS: 0.1}}}
    text = "\n".join(compare.step_markdown(res))
    assert ("| GradientFlow CSC 1% default | 100 (100-100, n=1), 2.00x | "
            "100 (100-100, n=1), 1.00x |") in text
    assert "1 Gbit/s: no setting can step more than 2.50x faster than DDP" in text
    assert "10 Gbit/s: no setting" not in text  # no bound measured there


def test_compare_peers_runs_a_subset_in_every_stage():
    args = argparse.Namespace(
        seeds=[10, 11, 12], epochs=3, lock=None, timeout=60, quick=False, quick_steps=40,
        step_steps=60, step_repeats=5, peers=["ddp-gloo", "powersgd-2", rx.OURS])
    for folder, argv in compare.stages(args):
        settings = argv[argv.index("--settings") + 1:argv.index("--seeds")]
        want = (["ddp-gloo", rx.OURS] if folder.endswith("schedule")
                else ["ddp-gloo", "powersgd-2", rx.OURS])
        assert settings == want, folder


def test_the_report_says_which_commits_hosts_and_span_its_runs_cover(tmp_path):
    logs = tmp_path / "alexnet_shaped" / "1gbps-plain" / "logs"
    logs.mkdir(parents=True)
    for i, (commit, start, end) in enumerate([("abc", "2026-01-01T10:00:00+00:00",
                                               "2026-01-01T10:05:00+00:00"),
                                              ("def", "2026-01-01T09:00:00+00:00",
                                               "2026-01-01T09:04:00+00:00")]):
        (logs / f"ddp-gloo-seed{i}.meta.json").write_text(json.dumps(
            {"commit": commit, "host": "h", "started_utc": start, "ended_utc": end}))
    (logs / "nocomm-seed0.meta.json").write_text(json.dumps({"wall_s": 1.0}))  # an older run
    prov = compare.provenance(tmp_path)
    assert prov["commits"] == ["abc", "def", "unrecorded"] and prov["runs"] == 3
    line = compare.provenance_line(prov)
    assert "started 2026-01-01T09:00:00+00:00 and ended 2026-01-01T10:05:00+00:00" in line
    assert "1 without recorded times" in line
    assert line in compare.markdown([], 3, [0], "cmd", prov)


def test_compare_reports_on_report_seeds_and_the_test_set_read_once(capsys):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--seeds", "0", "1", "2", "--timeout", "1"])
    assert exc.value.code == 2 and "seeds 0-9" in capsys.readouterr().err
    new = [{"val_top1": 80.0, "eval_set": "validation"},
           {"val_top1": 85.0, "eval_set": "validation", "test_top1": 84.2}]
    assert compare.reported_top1(new) == 84.2  # never the validation score
    assert compare.reported_top1([{"val_top1": 85.1}]) == 85.1  # a run before the protocol


@pytest.mark.parametrize("method", ["none", "csc"])
def test_fsdp_shards_the_model_and_counts_its_bytes(method, tmp_path):
    """--fsdp: fully_shard per block on one mesh, FSDP's own reduce-scatter or the model
    registered with gradientflow.hooks.register; a dense step counts the FP32 gradient."""
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--dummy", "--dataset", "fashion-mnist", "-a",
           "resnet_shaped", "--num-classes", "10", "-b", "4", "--steps-per-epoch", "3",
           "--epochs", "1", "-j", "0", "--fsdp", "--compression", method, "--no-checkpoint",
           "--json-log", str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = [json.loads(line) for line in log.read_text().splitlines()]
    dense_step = 4 * sum(p.numel() for p in models.resnet_shaped().parameters())
    assert r["dense_bytes"] == 3 * dense_step
    assert r["wire_bytes"] == (r["dense_bytes"] if method == "none" else 0)  # one rank: no wire
