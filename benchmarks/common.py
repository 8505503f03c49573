"""Shared helpers for the benchmarks: statistics, timing, markdown tables, JSON, plots.

Every `benchmarks/bench_<name>.py` can use these so that all results read alike::

    from benchmarks.common import median, p95, markdown_table, write_result, machine_info

Leaf module: imports nothing of gradientflow; matplotlib only inside `line_plot`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

# ---- statistics -------------------------------------------------------------------------------

def percentile(values: Iterable[float], q: float) -> float:
    """Return the q-th percentile (0..100) with linear interpolation; NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """Return the median (NaN for no values)."""
    return percentile(values, 50.0)


def p95(values: Iterable[float]) -> float:
    """Return the 95th percentile (NaN for no values)."""
    return percentile(values, 95.0)


def paired_ratio(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]],
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The median of num[l][i] / den[l][i] over launches l and reps i, and its 95% bootstrap
    interval, as (median, low, high).

    For two variants timed in the same reps, alternated: a rep's ratio compares runs a few
    hundred milliseconds apart, so the drift of a busy machine cancels, which it does not in a
    ratio of two medians. Launches also differ from each other (one pair of variants read
    0.90x-1.08x from one launch to the next), and reps of one launch are not independent of
    each other, so the interval resamples launches first, then the reps within each drawn
    launch (a two-stage percentile bootstrap, seeded: the same data give the same interval).
    With one launch it reflects the reps only.
    """
    if len(num) != len(den) or not num or any(
            len(a) != len(b) or not a for a, b in zip(num, den)):
        raise ValueError("paired_ratio: needs the same non-empty launches of equally long, "
                         f"non-empty series, got {[len(a) for a in num]} and "
                         f"{[len(b) for b in den]} values")
    ratios = [[a / b for a, b in zip(xs, ys)] for xs, ys in zip(num, den)]
    rng = random.Random(seed)
    meds = []
    for _ in range(resamples):
        drawn = [x for launch in rng.choices(ratios, k=len(ratios))
                 for x in rng.choices(launch, k=len(launch))]
        meds.append(median(drawn))
    return median([x for launch in ratios for x in launch]), percentile(meds, 2.5), \
        percentile(meds, 97.5)


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1,
               before: Callable[[], object] | None = None) -> list[float]:
    """Call `fn` warmup + reps times; return the wall time in seconds of each timed call.

    `before` runs untimed ahead of each timed call (`dist.barrier`: the ranks start each call
    together, so a rank's time is the collective's, not its wait for a late peer)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def sigterm_raises():
    """Within this block SIGTERM raises KeyboardInterrupt, so `finally` clean-up runs.

    A runner that times a benchmark out sends SIGTERM; Python's default would end the process
    at once, leaving rank processes and network namespaces behind. Only the main thread can
    install handlers; elsewhere (or when a handler is already set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield
        return

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---- formatting -------------------------------------------------------------------------------

def fmt(value, digits: int = 3) -> str:
    """Format a table cell: floats to `digits` significant figures, None/NaN as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        a = abs(value)
        if a >= 1e6 or (0 < a < 1e-3):
            return f"{value:.3g}"
        # Three significant figures, but never scientific notation for everyday magnitudes.
        if a >= 100:
            return f"{value:.0f}"
        if a >= 10:
            return f"{value:.1f}"
        return f"{value:.{digits - 1}f}" if a >= 1 else f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[str], rows: Iterable[dict],
                   headers: Sequence[str] | None = None) -> str:
    """Render `rows` (dicts) as a GitHub markdown table of `columns` (missing keys as dashes)."""
    headers = list(headers or columns)
    if len(headers) != len(columns):
        raise ValueError("markdown_table: headers and columns must have the same length")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


# ---- results ----------------------------------------------------------------------------------

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir(name: str) -> str:
    """Return benchmarks/results/<name>: the folder holding benchmark `name`'s latest run."""
    return str(RESULTS / name)


def machine_info() -> dict:
    """Describe the machine the numbers come from: cores, CPU model, memory, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = float("nan")
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem_gib, 1), "loadavg": load,
            "torch": torch_version, "python": platform.python_version(),
            "kernel": platform.release()}


def machine_line(info: dict | None = None) -> str:
    """One line stating the machine, for the top of every markdown section."""
    m = info or machine_info()
    return (f"Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_gib']} GiB, "
            f"torch {m['torch']}, Python {m['python']}, Linux {m['kernel']}; load average "
            f"{'/'.join(str(x) for x in m.get('loadavg', [])) or '?'} (1/5/15 min) when written.")


def thread_cpu_seconds(python_name: Callable[[str], str] = lambda name: name) -> dict:
    """CPU seconds (user + system) so far of this process's threads, summed by name: a thread
    Python started by `python_name(its Python name)`, any other (gloo's, torch's) by the
    kernel's name for it; {} where /proc does not say (not Linux). A thread that ended is not
    counted."""
    names = {t.native_id: python_name(t.name) for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:  # "tid (comm) state ... "
                comm, _, rest = fh.read().partition(" (")[2].rpartition(") ")
        except OSError:  # the thread ended meanwhile
            continue
        fields = rest.split()  # from the state on: utime and stime are the 12th and 13th
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def timed_header(started: str, loads: Sequence[float]) -> str:
    """The machine, when a timed run started and the 1-minute load at each of its launches."""
    return (f"{machine_line()}\nStarted {started}; 1-minute load averages at each launch: "
            f"{', '.join(f'{x:.1f}' for x in loads)}.")


def write_result(out_dir: str | os.PathLike, name: str, data: dict, markdown: str) -> Path:
    """Write DIR/<name>.json (with machine info added) and DIR/<name>.md; return the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "machine": machine_info(), **data}
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
    return path


def _json_default(obj):
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(obj)
    return str(obj)


# ---- plots ------------------------------------------------------------------------------------

def line_plot(path: str | os.PathLike, series: dict[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, title: str = "", logx: bool = False,
              logy: bool = False) -> Path | None:
    """Plot named (x, y) series to a PNG; return its path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys)
               if y is not None and not (isinstance(y, float) and math.isnan(y))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if logx:
        ax.set_xscale("log")
        ticks = sorted({float(x) for xs, _ in series.values() for x in xs})
        if 0 < len(ticks) <= 6:  # few points (bandwidth tiers): label them plainly
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
