"""torchrun --max-restarts: a rank SIGKILLed mid-training, the job restarts from its checkpoint
and the compressor's residuals come back exactly as they were saved."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "experiments" / "imagenet" / "train.py"
TIMEOUT_S = 150  # the whole torchrun job, both attempts (about 40 s on a loaded 2-core machine)
_SAVED = re.compile(r"\[rank (\d+)\] checkpoint saved after epoch (\d+): compressor residuals "
                    r"(crc32 \w+ l1 (\S+))")
_RESUMED = re.compile(r"\[rank (\d+)\] resumed from \S+ at epoch (\d+): compressor residuals "
                      r"(crc32 \w+ l1 (\S+))")


def _prepare(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("gf_restart_prepare", TRAIN.parent / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prepare(out, size=16, limit=48)


def restart_command(data: Path, ckpt: Path, log_dir: Path, kill_at_step: int) -> list[str]:
    """torchrun, 2 ranks, one restart allowed; train.py on the digits with CSC at 1% (so there
    are residuals), per-rank shards, --resume auto, and the last rank killed at a global step
    of the second epoch in the first attempt (3 steps per epoch: 48 images, global batch 16)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--log-dir", str(log_dir), "--redirects", "3",
            str(TRAIN), str(data), "-a", "resnet18", "--image-size", "16", "--num-classes", "10",
            "--augment", "none", "-b", "16", "--lr", "0.05", "--lr-base-batch", "16", "-j", "0",
            "--seed", "3", "--compression", "csc", "--density", "0.01", "--warmup", "none",
            "--bucket-cap-mb", "5", "--epochs", "2", "--checkpoint-dir", str(ckpt),
            "--resume", "auto", "--fault-kill-at-step", str(kill_at_step)]


def clean_env() -> dict:
    """This environment without a launcher's or gradientflow's variables (they would leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADIENTFLOW_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def rank_logs(log_dir: Path) -> dict[tuple[int, int], str]:
    """{(attempt, rank): stdout + stderr} from torchrun's --log-dir tree."""
    out = {}
    for attempt_dir in sorted(log_dir.glob("*/attempt_*")):
        attempt = int(attempt_dir.name.split("_")[1])
        for rank_dir in sorted(p for p in attempt_dir.iterdir() if p.is_dir()):
            text = "".join((rank_dir / f).read_text(errors="replace")
                           for f in ("stdout.log", "stderr.log") if (rank_dir / f).exists())
            out[(attempt, int(rank_dir.name))] = text
    return out


def format_logs(logs: dict, launcher: str = "") -> str:
    parts = [f"--- torchrun\n{launcher[-3000:]}"] if launcher else []
    parts += [f"--- attempt {a}, rank {r}\n{text[-3000:]}" for (a, r), text in sorted(logs.items())]
    return "\n".join(parts)


def check_resumed(logs: dict, world: int = 2) -> dict:
    """The restart's evidence from the logs; raises AssertionError saying what is missing."""
    attempts = sorted({a for a, _r in logs})
    assert attempts[-1] >= 1, "no restart happened (only attempt 0 in torchrun's logs)"
    killed = [r for (a, r), text in logs.items() if a == 0 and "fault injection: SIGKILL" in text]
    assert killed == [world - 1], f"expected rank {world - 1} to kill itself in attempt 0, got {killed}"
    saved = {(int(m[1]), int(m[2])): m[3] for (a, _r), t in logs.items() if a == 0
             for m in _SAVED.finditer(t)}
    last = attempts[-1]
    resumed = {}
    for r in range(world):
        ms = list(_RESUMED.finditer(logs.get((last, r), "")))
        assert ms, f"rank {r} did not resume from a checkpoint in attempt {last} (started from scratch?)"
        epoch, text, l1 = int(ms[0][2]), ms[0][3], float(ms[0][4])
        assert epoch >= 1, f"rank {r} resumed at epoch {epoch}"
        assert (r, epoch - 1) in saved, f"rank {r}: no checkpoint of epoch {epoch - 1} in attempt 0"
        assert text == saved[(r, epoch - 1)], (
            f"rank {r}: residuals loaded ({text}) differ from those saved ({saved[(r, epoch - 1)]})")
        assert l1 > 0, f"rank {r}: the saved residuals are all zero: the test would prove nothing"
        resumed[r] = {"epoch": epoch, "residuals": text}
    assert "epoch 0:" not in logs.get((last, 0), ""), "attempt 1 trained epoch 0 again"
    return resumed


def test_killed_rank_restarts_from_checkpoint_with_residuals(tmp_path):
    data = _prepare(tmp_path / "digits")
    log_dir = tmp_path / "logs"
    cmd = restart_command(data, tmp_path / "ckpt", log_dir, kill_at_step=4)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env=clean_env(), cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        launcher = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else (exc.stderr or "")
        raise AssertionError(f"torchrun did not finish within {TIMEOUT_S} s (hang?)\n"
                             + format_logs(rank_logs(log_dir), launcher)) from None
    logs = rank_logs(log_dir)
    assert proc.returncode == 0, (f"torchrun exited {proc.returncode}\n"
                                  + format_logs(logs, proc.stderr))
    try:
        check_resumed(logs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{format_logs(logs, proc.stderr)}") from None
