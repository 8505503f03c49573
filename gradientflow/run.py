"""gradientflow-run: horovodrun's common flags, launching through torchrun on this host.

    gradientflow-run -np 2 python train.py --epochs 1
    gradientflow-run -np 2 train.py                       # the script alone works too
    python -m gradientflow.run -np 4 --fusion-threshold-mb 64 --timeline-filename tl.json x.py

Each rank runs the script with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), so
`hvd.init()` (gradientflow.horovod) or `init_process_group("gradientflow")` joins the job.
Horovod's tuning flags become GRADIENTFLOW_* variables of the ranks. One host only: for several
hosts, run torchrun on each (see docs/HOROVOD.md).
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from typing import Optional, Sequence

__all__ = ["build_parser", "torchrun_command", "main"]

_LOCAL = {"localhost", "127.0.0.1", "::1"}
# horovodrun flags accepted for compatibility that change nothing here (why, in the help).
_IGNORED = {
    "--disable-cache": "gradientflow has no response cache: every round is agreed afresh",
    "--cache-capacity": "gradientflow has no response cache",
    "--network-interface": "gloo picks the interface of the rendezvous address",
    "--gloo": "gradientflow always runs CPU tensors over gloo",
    "--autotune": "no autotuner: set --fusion-threshold-mb and --cycle-time-ms",
    "--autotune-log-file": "no autotuner",
    "--mpi-args": "no MPI",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: horovodrun's common flags, then the command to run."""
    p = argparse.ArgumentParser(
        prog="gradientflow-run",
        description="Launch a training script on N processes of this host (horovodrun's "
                    "flags; torchrun underneath).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of processes (ranks)")
    p.add_argument("-H", "--hosts", default=None,
                   help="host:slots list; only this host (localhost) is launched here")
    p.add_argument("--hostfile", default=None, help="file of 'host slots=N' lines (this host)")
    p.add_argument("--start-timeout", type=int, default=None,
                   help="seconds to wait for every rank to join the rendezvous")
    p.add_argument("--output-filename", default=None,
                   help="directory: each rank's stdout/stderr also go to files under it")
    p.add_argument("--verbose", action="store_true", help="print the torchrun command")
    p.add_argument("--log-level", default=None, choices=["TRACE", "DEBUG", "INFO", "WARNING",
                                                         "ERROR", "FATAL"],
                   help="torch's C++ log level on the ranks")
    p.add_argument("--fusion-threshold-mb", type=float, default=None,
                   help="largest fused message, MB (GRADIENTFLOW_FUSION_THRESHOLD)")
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="fusion cycle, ms (GRADIENTFLOW_CYCLE_TIME_MS)")
    p.add_argument("--timeline-filename", default=None,
                   help="write a Chrome-trace timeline (GRADIENTFLOW_TIMELINE)")
    p.add_argument("--stall-check-warning-time-seconds", type=float, default=None,
                   help="warn about ranks that stall this long (GRADIENTFLOW_STALL_WARNING_S)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float, default=None,
                   help="abort a stall after this long (GRADIENTFLOW_STALL_ABORT_S)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free one)")
    for flag, why in _IGNORED.items():
        takes_value = flag in {"--cache-capacity", "--network-interface",
                               "--autotune-log-file", "--mpi-args"}
        p.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"), default=None,
                       action="store" if takes_value else "store_true",
                       help=f"accepted, no effect: {why}")
    p.add_argument("--mpi", action="store_true", help="refused: gradientflow does not use MPI")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the script (python train.py ... or train.py ...)")
    return p


def _local_slots(args) -> Optional[int]:
    """Slots of this host from -H or --hostfile (None if neither); refuse other hosts."""
    entries = []
    if args.hosts:
        entries = [h.strip() for h in args.hosts.split(",") if h.strip()]
    elif args.hostfile:
        with open(args.hostfile) as f:
            for line in f:
                words = line.split("#")[0].split()
                if words:
                    slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
                    entries.append(words[0] + (":" + slots[0] if slots else ""))
    if not entries:
        return None
    me = _LOCAL | {socket.gethostname()}
    total = 0
    for entry in entries:
        host, _, slots = entry.partition(":")
        if host not in me:
            raise SystemExit(f"gradientflow-run: host {host!r} is not this host; "
                             "gradientflow-run launches one host. On several hosts run "
                             "`torchrun --nnodes N --node-rank I --rdzv-endpoint HOST:PORT "
                             "--nproc-per-node K train.py` on each (docs/HOROVOD.md)")
        total += int(slots) if slots else 1
    return total


def _env(args) -> dict:
    env = {}
    if args.fusion_threshold_mb is not None:
        env["GRADIENTFLOW_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 2**20))
    if args.cycle_time_ms is not None:
        env["GRADIENTFLOW_CYCLE_TIME_MS"] = str(args.cycle_time_ms)
    if args.timeline_filename is not None:
        env["GRADIENTFLOW_TIMELINE"] = args.timeline_filename
    if args.stall_check_warning_time_seconds is not None:
        env["GRADIENTFLOW_STALL_WARNING_S"] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["GRADIENTFLOW_STALL_ABORT_S"] = str(args.stall_check_shutdown_time_seconds)
    if args.log_level is not None:
        env["TORCH_CPP_LOG_LEVEL"] = args.log_level
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args) -> list[str]:
    """The torchrun command line these arguments stand for."""
    if args.mpi:
        raise SystemExit("gradientflow-run: --mpi is not offered; gradientflow runs over "
                         "gloo (CPU) and NCCL (GPU)")
    if args.np < 1:
        raise SystemExit(f"gradientflow-run: -np {args.np} must be at least 1")
    slots = _local_slots(args)
    if slots is not None and slots < args.np:
        raise SystemExit(f"gradientflow-run: -np {args.np} is more than the {slots} slots "
                         "given for this host")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("gradientflow-run: no command given; e.g. gradientflow-run -np 2 "
                         "python train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(args.np), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{args.master_port or _free_port()}"]
    if args.start_timeout is not None:
        cmd += ["--rdzv-conf", f"join_timeout={args.start_timeout}"]
    if args.output_filename is not None:
        cmd += ["--log-dir", args.output_filename, "--redirects", "3", "--tee", "3"]
    exe = os.path.basename(command[0])
    if exe.startswith("python") and len(command) > 1:
        # `python train.py` or `python -m pkg`: torchrun runs it with its own interpreter.
        rest = command[1:]
        if rest[0] == "-m":
            cmd += ["--module", *rest[1:]]
        else:
            cmd += rest
    elif command[0].endswith(".py"):
        cmd += command
    else:
        cmd += ["--no-python", *command]
    return cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse horovodrun-style arguments, run torchrun, return its exit status."""
    args = build_parser().parse_args(argv)
    for flag in _IGNORED:
        if getattr(args, flag.lstrip("-").replace("-", "_")) not in (None, False):
            print(f"gradientflow-run: {flag} has no effect: {_IGNORED[flag]}", file=sys.stderr)
    # The ranks' GRADIENTFLOW_* settings go through `env`, on top of the inherited environment.
    cmd = ["env", *(f"{k}={v}" for k, v in _env(args).items()), *torchrun_command(args)]
    if args.verbose:
        print("gradientflow-run: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr,
              flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
