"""experiments/lm: the corpus's splits, the GPT's causality, the schedule, a tiny real run
under CSC with AdamW, and the report's paired difference to DDP."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LM = ROOT / "experiments" / "lm"
sys.path.insert(0, str(LM))
import corpus  # noqa: E402
import run_lm  # noqa: E402
import train_lm  # noqa: E402
from model import GPT  # noqa: E402

TIMEOUT = 240  # seconds for the subprocess: a hang fails the test instead of the suite


@pytest.fixture
def text_gz(tmp_path) -> Path:
    """A small real text: the project's own README, gzipped as the Debian package ships it."""
    path = tmp_path / "text.txt.gz"
    path.write_bytes(gzip.compress((ROOT / "README.md").read_bytes()))
    return path


def test_the_splits_are_contiguous_and_cover_the_text(text_gz):
    data = gzip.decompress(text_gz.read_bytes())
    splits = corpus.load(text_gz)
    assert bytes(torch.cat([splits[k] for k in ("train", "val", "test")]).tolist()) == data
    assert len(splits["val"]) == pytest.approx(0.05 * len(data), abs=2)


def test_a_missing_corpus_says_how_to_install_it(tmp_path):
    with pytest.raises(corpus.CorpusUnavailable, match="apt-get install jargon-text"):
        corpus.ensure(tmp_path / "nothing.gz", install=False)


def test_the_model_is_causal_and_its_head_is_the_embedding():
    torch.manual_seed(0)
    model = GPT(256, context=16, layers=2, width=32, heads=4).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future only
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6) and not torch.allclose(a, b)
    assert model.head.weight is model.tok.weight
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_the_rate_warms_up_linearly_then_follows_a_cosine_to_its_floor():
    args = train_lm.parse_args(["--steps", "110", "--warmup-steps", "10", "--lr", "1e-3"])
    assert train_lm.learning_rate(args, 0) == pytest.approx(1e-4)
    assert train_lm.learning_rate(args, 9) == pytest.approx(1e-3)
    assert train_lm.learning_rate(args, 60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert train_lm.learning_rate(args, 110) == pytest.approx(1e-4)


def test_a_tiny_csc_run_with_adamw_trains_and_reads_the_test_split_once(text_gz, tmp_path):
    log = tmp_path / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(LM / "train_lm.py"), "--setting", "csc", "--steps", "6",
           "--eval-every", "3", "--layers", "1", "--width", "32", "--heads", "2",
           "--context", "16", "--batch", "4", "--warmup-steps", "2", "--corpus", str(text_gz),
           "--csc-option", "min_numel=0", "--json-log", str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = [json.loads(line) for line in log.read_text().splitlines()]
    assert (first["step"], last["step"]) == (3, 6) and "test_loss" not in first
    assert last["test_ppl"] == pytest.approx(math.exp(last["test_loss"]))
    assert last["val_loss"] < math.log(256) + 0.5 and len(last["rank_cpu_s"]) == 1
    assert 0 < last["wire_bytes"] <= last["dense_bytes"]


def _write(out: Path, key: str, seed: int, val: float) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    records = [{"step": 100, "val_loss": val + 1}, {"step": 200, "val_loss": val,
                                                     "test_loss": val + 0.01, "wire_bytes": 10,
                                                     "dense_bytes": 100}]
    (logs / f"{key}-seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (logs / f"{key}-seed{seed}.meta.json").write_text(json.dumps(
        {"wall_s": 60.0, "cpu_s": 120.0, "commit": "abc"}))


def test_the_report_gives_csc_against_ddp_in_percent_paired_by_seed(tmp_path):
    for seed, ddp, csc in ((10, 2.0, 2.02), (11, 2.1, 2.121), (12, 2.0, 2.0)):
        _write(tmp_path, "ddp", seed, ddp)
        _write(tmp_path, "csc", seed, csc)
    rows = run_lm.summarise(tmp_path, ["ddp", "csc", "torch-fp16"], [10, 11, 12])
    assert set(rows) == {"ddp", "csc"}
    rel = rows["csc"]["vs_ddp_pct_seeds"]
    assert rel == {10: pytest.approx(1.0), 11: pytest.approx(1.0), 12: pytest.approx(0.0)}
    text = run_lm.markdown(rows, [10, 11, 12], 200, "t", "cmd")
    assert "**met** (+0.67%)" in text and "| 10.0x |" in text
    assert "| 200 | 2.0333 | 2.0470 |" in text  # the curve's last point, mean over seeds


def test_the_table_names_the_density_the_runs_were_given():
    assert run_lm.label("csc", ["--density", "0.1"]) == "GradientFlow CSC 10% (default recipe)"
    assert run_lm.label("csc", []) == run_lm.LABELS["csc"]
    assert run_lm.label("ddp", ["--density", "0.1"]) == run_lm.LABELS["ddp"]
    assert run_lm.label("csc", ["--density", "0.1", "--csc-option", "min_numel=65537"]) == (
        "GradientFlow CSC 10% (min_numel=65537)")


def test_csc_options_are_python_literals_and_bad_ones_are_refused(capsys):
    args = train_lm.parse_args(["--csc-option", "min_numel=65537",
                                "--csc-option", "warmup_densities=(1.0, 0.25)"])
    assert args.csc_options == {"min_numel": 65537, "warmup_densities": (1.0, 0.25)}
    for bad in ("min_numel", "min_numel=many", "=3"):
        with pytest.raises(SystemExit):
            train_lm.parse_args(["--csc-option", bad])
        assert "--csc-option" in capsys.readouterr().err
