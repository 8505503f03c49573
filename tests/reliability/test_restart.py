"""torchrun --max-restarts: a rank SIGKILLed mid-training, the job restarts from its checkpoint
and the compressor's residuals come back exactly as they were saved."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.imagenet.restart_scenario import (  # noqa: E402 - run once here
    check_resumed, format_logs, launcher_env, prepare_digits, rank_logs, restart_command,
)

TIMEOUT_S = 150  # the whole torchrun job, both attempts (30-40 s on a loaded 2-core machine)


def test_killed_rank_restarts_from_checkpoint_with_residuals(tmp_path):
    data = prepare_digits(tmp_path / "digits")
    log_dir = tmp_path / "logs"
    # 3 steps per epoch: global step 4 is the second step of epoch 1, after epoch 0's checkpoint.
    cmd = restart_command(data, tmp_path / "ckpt", log_dir, kill_at_step=4)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env=launcher_env(), cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        launcher = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        raise AssertionError(f"torchrun did not finish within {TIMEOUT_S} s (a hang)\n"
                             + format_logs(rank_logs(log_dir), launcher)) from None
    logs = rank_logs(log_dir)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n" + format_logs(
        logs, proc.stderr
    )
    try:
        resumed = check_resumed(logs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{format_logs(logs, proc.stderr)}") from None
    assert all(r["epoch"] == 1 for r in resumed.values()), resumed
