"""Run every benchmark, gather their JSON, write one markdown summary with plots.

    python -m benchmarks.run                 # make bench: full sizes -> benchmarks/results/
    python -m benchmarks.run --quick         # make bench ARGS=--quick: tiny, .../results/quick/
    python -m benchmarks.run --only e2e,collectives --timeout 1800

One folder per benchmark holds its latest run: every ``benchmarks/bench_<name>.py`` is run as its
own subprocess, ``python -m benchmarks.bench_<name> [--quick] --out OUT/<name>``, under a time
limit, after the files of that folder are removed (a re-run replaces them; its subfolders stay:
they hold inputs, such as the runs bench_simulate is calibrated on); it must write
``<name>.json`` and ``<name>.md`` there, and its console goes to ``<name>.log`` beside them.
A benchmark that fails, times out or writes nothing is reported in ``OUT/summary.md`` with the
end of its log, and the others still run; the exit status is 1 if any failed. The measurement
history (dated key numbers and their commands) is ``benchmarks/results/HISTORY.md``, kept by
hand.

Plots the runner draws from the gathered JSON (when the data are there), into the folder of
the benchmark they come from:
- ``e2e`` rows (``rate_gbps``, ``median_ms``, ``label``): step time vs bandwidth;
- ``collectives`` rows with a size key (``bytes``/``size_bytes``/``size``/``nbytes``), a
  bus-bandwidth key (containing ``busbw``) and a series key (``label``/``impl``/``backend``/
  ``op``/``variant``): bus bandwidth vs message size.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by path: make benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import line_plot, machine_info, machine_line, markdown_table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
QUICK_TIMEOUT_S = 180.0
FULL_TIMEOUT_S = 3600.0


def discover(bench_dir: Path = HERE, only: list[str] | None = None) -> list[tuple[str, Path]]:
    """(name, path) of every bench_<name>.py in `bench_dir`, sorted; filtered by `only`."""
    found = [(p.stem[len("bench_"):], p) for p in sorted(bench_dir.glob("bench_*.py"))]
    if only:
        unknown = set(only) - {n for n, _ in found}
        if unknown:
            raise SystemExit(f"benchmarks.run: no benchmark named {sorted(unknown)} in "
                             f"{bench_dir}; found {[n for n, _ in found]}")
        found = [(n, p) for n, p in found if n in only]
    return found


def run_one(name: str, path: Path, out: Path, quick: bool, timeout_s: float,
            extra: list[str] | None = None) -> dict:
    """Run one benchmark as a subprocess into OUT/<name>/; return its status (never raises)."""
    bdir = out / name
    bdir.mkdir(parents=True, exist_ok=True)
    for old in bdir.iterdir():  # the folder's files are the latest run only
        if old.is_file() or old.is_symlink():
            old.unlink()
    log = bdir / f"{name}.log"
    # Modules of this package run with -m (their imports resolve as benchmarks.*); others by path.
    target = (["-m", f"benchmarks.{path.stem}"] if path.parent.resolve() == HERE
              else [str(path)])
    argv = [sys.executable, *target, *(["--quick"] if quick else []), "--out", str(bdir),
            *(extra or [])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.monotonic()
    status = "ok"
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # The whole session: a benchmark's rank processes die with it (their own
            # sessions are killed by its launcher's cleanup, which SIGTERM lets run).
            import signal
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, status = None, f"timed out after {timeout_s:.0f} s"
    secs = time.monotonic() - t0
    data = None
    jpath = bdir / f"{name}.json"
    if rc not in (0, None):
        status = f"failed (exit code {rc})"
    if jpath.exists():
        try:
            data = json.loads(jpath.read_text())
        except json.JSONDecodeError as exc:
            status = f"wrote unreadable JSON ({exc})"
    elif status == "ok":
        status = f"wrote no {name}.json"
    md = (bdir / f"{name}.md").read_text() if (bdir / f"{name}.md").exists() else ""
    tail = "\n".join(log.read_text(errors="replace").rstrip().splitlines()[-20:])
    return {"name": name, "status": status, "seconds": round(secs, 1), "data": data,
            "markdown": md, "log": str(log.relative_to(out)), "log_tail": tail}


def gather_one(name: str, out: Path) -> dict:
    """The status record of a benchmark already run into `out`/<name> (for --gather-only)."""
    bdir = out / name
    jpath, mpath = bdir / f"{name}.json", bdir / f"{name}.md"
    data, status = None, "not run (no JSON in the results directory)"
    if jpath.exists():
        try:
            data, status = json.loads(jpath.read_text()), "ok (gathered)"
        except json.JSONDecodeError as exc:
            status = f"unreadable JSON ({exc})"
    log = bdir / f"{name}.log"
    return {"name": name, "status": status, "seconds": None, "data": data,
            "markdown": mpath.read_text() if mpath.exists() and data else "",
            "log": str(log.relative_to(out)) if log.exists() else "-", "log_tail": ""}


def _rows(data) -> list[dict]:
    if not isinstance(data, dict):
        return []
    for key in ("rows", "results", "records"):
        if isinstance(data.get(key), list):
            return [r for r in data[key] if isinstance(r, dict)]
    return []


def plot_step_time(records: dict, out: Path) -> list[str]:
    """Step time vs bandwidth, one panel per model at 2 ranks, from e2e's rows."""
    # The gradientflow launch's own DDP/nocomm anchors would duplicate the peers' lines.
    rows = [r for r in _rows(records.get("e2e")) if r.get("rate_gbps") and r.get("median_ms")
            and (r.get("group") != "gradientflow" or str(r.get("variant")).startswith("gf_"))]
    made = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for n in sorted({r["ranks"] for r in rows if r["model"] == model}):
            series = {}
            for r in rows:
                if r["model"] == model and r["ranks"] == n:
                    xs, ys = series.setdefault(r.get("label", r.get("variant")), ([], []))
                    xs.append(r["rate_gbps"])
                    ys.append(r["median_ms"])
            p = line_plot(out / f"summary_step_time_{model}_{n}ranks.png", series,
                          "link rate (Gbit/s)", "median step time (ms)",
                          f"{model}, {n} ranks", logx=True)
            if p:
                made.append(p.name)
    return made


_UNITS = {"b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}


def _size_bytes(value) -> float | None:
    """A message size as bytes: a number, or a label such as "64 KB" / "1MiB"."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):] or "b"
    try:
        return float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        return None


def plot_busbw(records: dict, out: Path) -> list[str]:
    """Bus bandwidth vs message size from collectives' rows (long or wide format)."""
    rows = _rows(records.get("collectives"))
    if not rows:
        return []
    keys = list(rows[0].keys())
    size = next((k for k in ("bytes", "size_bytes", "nbytes", "size") if k in keys), None)
    # Every busbw column is a series (wide: "gloo busbw GB/s", "gf busbw GB/s"); ratios are not.
    bws = [k for k in keys if "busbw" in k and "/" not in k.replace("GB/s", "").replace("Gb/s", "")
           .replace("gbps", "")]
    groups = [k for k in ("op", "ranks", "label", "impl", "backend", "variant") if k in keys]
    if not size or not bws:
        return []
    series = {}
    for r in rows:
        x = _size_bytes(r.get(size))
        for bw in bws:
            y = r.get(bw)
            if x is None or not isinstance(y, (int, float)):
                continue
            name = " ".join([*(str(r[g]) + ("r" if g == "ranks" else "") for g in groups),
                             *([bw] if len(bws) > 1 else [])])
            xs, ys = series.setdefault(name or bw, ([], []))
            xs.append(x)
            ys.append(y)
    p = line_plot(out / "summary_busbw.png", series, "message size (bytes)",
                  bws[0] if len(bws) == 1 else "bus bandwidth", "bus bandwidth vs message size",
                  logx=True, logy=True)
    return [p.name] if p else []


def write_summary(results: list[dict], out: Path, quick: bool, cmd: str) -> Path:
    """Write OUT/summary.md (machine, status table, each benchmark's section, plots)."""
    records = {r["name"]: r["data"] for r in results if r["data"]}
    plots, plot_errors = [], []
    for plot, source in ((plot_step_time, "e2e"), (plot_busbw, "collectives")):
        if source not in records:
            continue
        try:
            plots += [f"{source}/{p}" for p in plot(records, out / source)]
        except Exception as exc:  # noqa: BLE001 - a plot must never cost the summary
            plot_errors.append(f"{plot.__name__}: {type(exc).__name__}: {exc}")
    m = machine_info()
    lines = [f"# GradientFlow benchmarks{' (quick mode: plumbing on tiny sizes)' if quick else ''}",
             "", machine_line(m), f"Command: `{cmd}`", "",
             markdown_table(["name", "status", "seconds", "log"], results,
                            ["benchmark", "status", "seconds", "log"]), ""]
    for r in results:
        if not r["status"].startswith("ok") and r["log_tail"]:
            lines += [f"### {r['name']}: {r['status']}", "", "```", r["log_tail"], "```", ""]
    for r in results:
        if r["markdown"]:
            # The benchmark's own links (its plots) are relative to its folder.
            md = re.sub(r"\]\((?![a-z]+:|/)([^)]+)\)", rf"]({r['name']}/\1)", r["markdown"])
            lines += [md.rstrip(), ""]
    if plot_errors:
        lines += ["Plots that failed: " + "; ".join(plot_errors), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(
        {"machine": m, "quick": quick, "command": cmd, "plots": plots,
         "benchmarks": [{k: r[k] for k in ("name", "status", "seconds", "log")}
                        for r in results]}, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, loopback: a smoke check")
    ap.add_argument("--out", default=None,
                    help="results directory (default benchmarks/results, quick: .../quick)")
    ap.add_argument("--only", default=None, help="comma list of benchmark names (e2e,...)")
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"seconds per benchmark (default {QUICK_TIMEOUT_S:.0f} quick, "
                         f"{FULL_TIMEOUT_S:.0f} full)")
    ap.add_argument("--gather-only", action="store_true",
                    help="run nothing: summarise the JSON already in the results directory")
    ap.add_argument("--bench-dir", default=str(HERE), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out or (HERE / "results" / ("quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (QUICK_TIMEOUT_S if args.quick else FULL_TIMEOUT_S)
    benches = discover(Path(args.bench_dir), args.only.split(",") if args.only else None)
    cmd = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for name, path in benches:
        if args.gather_only:
            results.append(gather_one(name, out))
            continue
        print(f"[run] {name} ...", flush=True)
        r = run_one(name, path, out, args.quick, timeout)
        print(f"[run] {name}: {r['status']} in {r['seconds']} s", flush=True)
        results.append(r)
    summary = write_summary(results, out, args.quick, cmd.strip())
    print(f"[run] summary: {summary}")
    return 0 if all(r["status"].startswith("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
