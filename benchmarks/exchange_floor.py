"""Where a synchronous exchanged allreduce's time goes: gloo's, the engine's, and the floor.

The floor is what any carried exchange of two ranks must do, written by hand on a gloo group
with no engine and no check: copy the tensor into a frame behind a 256-byte header, one
all-to-all of the frame, add the peer's payload. The plugin floor is that same work as the
whole `allreduce` of a process-group backend registered with torch as ours is, called through
`dist.all_reduce`: what any Python backend pays, torch's dispatch into Python included. The
engine's call (checks.own_route: the call carried in its own check round, rounds.py) does the
same plus its per-call Python (validation, routing, the inspector's record, the round's words).
The checked plugin floor adds the least a check can be: the call's sequence number and the
fingerprint of its dtype and shape (a dict lookup) packed into the header, and the peer's
compared after the all-to-all. Each rep times the five alternately in the same processes; the
caller's thread CPU per call is measured beside the wall time.

    python benchmarks/exchange_floor.py [--runs 3] [--reps 300] [--lock /work/timing.lock]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.check_cost import locked
from benchmarks.common import fmt, markdown_table, results_dir, timed_header, write_result
from benchmarks.launch import launch

SIZES = (1 << 20,)
HEADER = 256
_WORDS = struct.Struct("<qq")  # the checked floor's header: sequence number, fingerprint
_SIDE: list = []  # the plugin floor's gloo group (set by floor_worker before its first call)


def _frames(x, rank: int) -> tuple:
    """(send, recv, the peer's payload as x's dtype and shape, splits, and writable views of
    send and recv) for carrying `x` between two ranks behind a HEADER-byte header."""
    import torch

    f = x.numel() * x.element_size() + HEADER
    send, recv = torch.zeros(f, dtype=torch.uint8), torch.zeros(f, dtype=torch.uint8)
    return (send, recv, recv[HEADER:].view(x.dtype).view(x.shape), [0, f] if rank == 0 else [f, 0],
            memoryview(send.numpy()), memoryview(recv.numpy()))


def _carry(x, frames: tuple, group, words: tuple | None = None) -> None:
    """The floor: `x` copied into its frame, one all-to-all on `group`, the peer's added.
    `words` (the checked floor): packed into the header, and the peer's must be the same."""
    send, recv, peer, splits, send_mem, recv_mem = frames
    if words is not None:
        _WORDS.pack_into(send_mem, 0, *words)
    ctypes.memmove(send.data_ptr() + HEADER, x.data_ptr(), x.numel() * x.element_size())
    group.alltoall_base(recv, send, splits, splits).wait()
    if words is not None and (theirs := _WORDS.unpack_from(recv_mem, 0)) != words:
        raise RuntimeError(f"checked floor: the peer issued {theirs} where this rank issued "
                           f"{words}")
    x.add_(peer)


def _floor_backend(store, rank: int, size: int, timeout, checked: bool = False):
    """A process-group backend whose allreduce is the floor and nothing else (module doc);
    `checked`: the checked floor, its side group _SIDE[1]."""
    from torch._C._distributed_c10d import Backend

    class FloorBackend(Backend):
        def __init__(self) -> None:
            super().__init__(rank, size)
            self.frames: dict = {}
            self.seq = 0

        def allreduce(self, tensors, opts=None):
            x = tensors[0]
            key = (x.dtype, x.shape)
            entry = self.frames.get(key)
            if entry is None:  # the frames, and the fingerprint the checked floor sends
                entry = self.frames[key] = (_frames(x, rank), zlib.crc32(repr(key).encode()))
            frames, fp = entry
            if checked:
                self.seq += 1
                _carry(x, frames, _SIDE[1], (self.seq, fp))
            else:
                _carry(x, frames, _SIDE[0])
            return None  # complete, as the engine's synchronous call

        def getBackendName(self) -> str:
            return "checked_floor" if checked else "exchange_floor"

    return FloorBackend()


def _checked_backend(store, rank: int, size: int, timeout):
    return _floor_backend(store, rank, size, timeout, checked=True)


def floor_worker(rank: int, world_size: int, reps: int, sizes: list) -> dict:
    """Per size and variant: median wall ms and caller-thread CPU ms per call."""
    import torch
    import torch.distributed as dist

    import gradientflow  # noqa: F401 - registers the backend before torch 2.14

    torch.set_num_threads(1)
    side = dist.new_group(backend="gloo")
    gf = dist.new_group(backend="gradientflow")
    _SIDE[:] = [side, dist.new_group(backend="gloo")]
    dist.Backend.register_backend("exchange_floor", _floor_backend, devices=["cpu"])
    dist.Backend.register_backend("checked_floor", _checked_backend, devices=["cpu"])
    plugin = dist.new_group(backend="exchange_floor")
    checked = dist.new_group(backend="checked_floor")
    out = {}
    for size in sizes:
        x = torch.ones(size // 4)
        frames = _frames(x, rank)
        variants = {"gloo": lambda: dist.all_reduce(x),
                    "gradientflow": lambda: dist.all_reduce(x, group=gf),
                    "floor": lambda: _carry(x, frames, side),
                    "plugin floor": lambda: dist.all_reduce(x, group=plugin),
                    "checked floor": lambda: dist.all_reduce(x, group=checked)}
        wall: dict = {k: [] for k in variants}
        cpu: dict = {k: [] for k in variants}
        for fn in variants.values():
            for _ in range(20):
                fn()
        for i in range(reps):
            names = list(variants)
            turn = i % len(names)
            for name in names[turn:] + names[:turn]:
                dist.barrier()
                c0, t0 = time.thread_time(), time.perf_counter()
                variants[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
        out[str(size)] = {k: {"wall_ms": statistics.median(wall[k]) * 1e3,
                              "cpu_ms": statistics.median(cpu[k]) * 1e3} for k in variants}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="launches")
    ap.add_argument("--reps", type=int, default=300, help="timed calls per launch and variant")
    ap.add_argument("--lock", default=None, help="a lock file shared with other timing jobs")
    ap.add_argument("--out", type=Path, default=Path(results_dir("exchange_floor")))
    args = ap.parse_args()
    runs, loads = [], []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with locked(args.lock):
        for i in range(args.runs):
            loads.append(os.getloadavg()[0])
            res = launch("benchmarks.exchange_floor:floor_worker", 2,
                         kwargs={"reps": args.reps, "sizes": list(SIZES)}, timeout_s=600)
            if not res.ok:
                raise RuntimeError(f"floor_worker: {res.error}")
            runs.append(res.results[0])
            print(f"run {i + 1}/{args.runs} done (load {loads[-1]:.1f})", flush=True)
    rows = []
    for size in SIZES:
        per = [r[str(size)] for r in runs]

        def med(variant: str, what: str = "wall_ms") -> float:
            return statistics.median(p[variant][what] for p in per)

        def over_gloo(variant: str) -> str:
            ratio = [p[variant]["wall_ms"] / p["gloo"]["wall_ms"] for p in per]
            return f"{fmt(statistics.median(ratio))} ({fmt(min(ratio))}-{fmt(max(ratio))})"

        over = [p["gradientflow"]["wall_ms"] - p["plugin floor"]["wall_ms"] for p in per]
        rows.append({"all_reduce": f"{size >> 20} MB", "gloo ms": med("gloo"),
                     "floor ms": med("floor"), "plugin floor ms": med("plugin floor"),
                     "checked floor ms": med("checked floor"),
                     "gradientflow ms": med("gradientflow"),
                     "floor / gloo": over_gloo("floor"),
                     "plugin floor / gloo": over_gloo("plugin floor"),
                     "checked floor / gloo": over_gloo("checked floor"),
                     "gradientflow / gloo": over_gloo("gradientflow"),
                     "gradientflow - plugin floor ms": statistics.median(over),
                     "caller CPU ms: gloo / floor / plugin floor / checked floor / gradientflow":
                         " / ".join(fmt(med(v, "cpu_ms")) for v in (
                             "gloo", "floor", "plugin floor", "checked floor", "gradientflow"))})
    md = (f"## A synchronous exchanged allreduce: gloo, the floor of a carried exchange, and "
          f"the engine\n\n{timed_header(started, loads)}\n\n2 ranks on loopback, the five "
          f"timed in turn in the same processes ({args.reps} reps each, per-launch medians; "
          f"median and spread over {args.runs} launches). Floor: the tensor copied behind a "
          f"{HEADER}-byte header, one all-to-all, the peer's payload added, on a gloo group "
          "with no engine; plugin floor: the same as a registered backend's whole allreduce, "
          "called through dist.all_reduce; checked floor: that with its sequence number and "
          "fingerprint in the header, compared (module doc); ratios per launch, median (range)."
          "\n\n" + markdown_table(list(rows[0]), rows)
          + f"\n\nCommand: `python benchmarks/exchange_floor.py --runs {args.runs} --reps "
          f"{args.reps}`\n")
    write_result(args.out, "exchange_floor", {"runs": runs, "loads": loads, "rows": rows,
                                              "started": started}, md)
    print(md)


if __name__ == "__main__":
    main()
