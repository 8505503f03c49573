"""The evidence protocol (experiments/imagenet/protocol.py and train.py's --val-split,
--report-test): choices see the validation split and screening seeds only, reports the test set
and seeds no choice saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments" / "imagenet"
SCRIPT = HERE / "train.py"
TIMEOUT = 240  # seconds for the subprocess: a hang fails the test instead of the suite
sys.path.insert(0, str(HERE))
import prepare  # noqa: E402
import protocol  # noqa: E402
import train  # noqa: E402


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_the_split_is_fixed_disjoint_and_whole_whatever_the_training_seed():
    torch.manual_seed(1)
    a = protocol.split_indices(100, 20)
    torch.manual_seed(2)
    b = protocol.split_indices(100, 20)
    assert a == b
    tr, va = a
    assert len(tr) == 80 and len(va) == 20 and sorted(tr + va) == list(range(100))
    # a permutation, not the literal tail: ImageFolder lists images class by class
    assert va != list(range(80, 100))


@pytest.mark.parametrize("n_val", [0, 100, 101, -1])
def test_a_split_that_leaves_nothing_on_either_side_is_refused(n_val):
    with pytest.raises(protocol.ProtocolError, match="--val-split"):
        protocol.split_indices(100, n_val)


def test_carve_scores_the_split_through_the_unaugmented_view():
    augmented = [("aug", i) for i in range(10)]
    view = [("plain", i) for i in range(10)]
    train_set, val = protocol.carve(augmented, view, 3)
    assert len(train_set) == 7 and len(val) == 3
    assert all(x[0] == "plain" for x in val) and all(x[0] == "aug" for x in train_set)
    assert {x[1] for x in train_set}.isdisjoint({x[1] for x in val})


@pytest.mark.parametrize("seed", [None, 0, 2, 9])
def test_screening_seeds_cannot_report(seed):
    with pytest.raises(protocol.ProtocolError, match="seeds 0-9"):
        protocol.check_report_seed(seed)


def test_roles_take_their_own_seeds():
    protocol.check_role("screen", [0, 1, 2])
    protocol.check_role("report", protocol.REPORT_SEEDS)
    with pytest.raises(protocol.ProtocolError):
        protocol.check_role("report", [0, 1, 2])
    with pytest.raises(protocol.ProtocolError):
        protocol.check_role("screen", [10])
    with pytest.raises(protocol.ProtocolError):
        protocol.check_role("choose", [0])


def test_a_choice_cannot_rank_on_the_test_set():
    assert protocol.selection_top1({"epoch": 0, "val_top1": 90.0,
                                    "eval_set": "validation"}) == 90.0
    for record in ({"epoch": 0, "val_top1": 90.0, "eval_set": "test"},
                   {"epoch": 0, "val_top1": 90.0}):  # logs from before the protocol
        with pytest.raises(protocol.ProtocolError, match="validation split"):
            protocol.selection_top1(record)
    with pytest.raises(protocol.ProtocolError, match="--report-test"):
        protocol.report_top1([{"epoch": 0, "val_top1": 90.0}])
    assert protocol.report_top1([{"test_top1": 88.5}]) == 88.5


@pytest.mark.parametrize("argv, words", [
    (["--dummy", "--report-test", "--seed", "10"], "needs --val-split"),
    (["--dummy", "--val-split", "8", "--report-test", "--seed", "1"], "seeds 0-9"),
    (["--dummy", "--val-split", "8", "--report-test"], "seeds 0-9"),
    (["--dummy", "--val-split", "-1"], "--val-split"),
])
def test_train_refuses_a_report_that_breaks_the_protocol_before_init(argv, words):
    with pytest.raises(train.ConfigError, match=words):
        train.resolve(train.parse_args(argv), env={})


def test_a_report_run_scores_validation_each_epoch_and_test_once(tmp_path):
    """One process on a tiny digits tree: every epoch on the split, the test set at the end."""
    data = prepare.prepare(tmp_path / "digits", size=16, limit=40)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, str(SCRIPT), str(data), "-a", "resnet18", "--image-size", "16",
           "--num-classes", "10", "-b", "8", "--epochs", "2", "--augment", "light", "-j", "0",
           "--dist-backend", "gloo", "--no-checkpoint", "--val-split", "10", "--report-test",
           "--seed", "10", "--json-log", str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train 30 / validation split 10 / test 40" in proc.stdout
    first, last = [json.loads(line) for line in log.read_text().splitlines()]
    assert first["eval_set"] == last["eval_set"] == "validation"
    assert "test_top1" not in first and 0 <= last["test_top1"] <= 100
    assert {"test_top5", "test_loss"} <= set(last)
    assert len(last["rank_cpu_s"]) == 1 and last["rank_cpu_s"][0] >= first["rank_cpu_s"][0] > 0
    # the split is scored on its 10 images (each 10 points), the test set on its 40 (2.5)
    assert first["val_top1"] % 10 == 0 and last["test_top1"] % 2.5 == 0
