"""Summarize: top phases, per-step communication (union of intervals), the CLI and its plot."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from gradientflow.observability import summarize as M
from gradientflow.observability import timeline as T


def write_known_trace(path, rank=0):
    """Two steps of 1000 us; per step two buckets whose allreduces overlap by 50 us."""
    events = [
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 2, "args": {"name": "bucket 0"}}
    ]
    for step, t0 in ((0, 0.0), (1, 1000.0)):
        events.append({"ph": "X", "name": T.STEP, "cat": T.CAT_STEP, "ts": t0, "dur": 1000.0,
                       "pid": rank, "tid": 1, "args": {"step": step}})
        events.append(
            {
                "ph": "X",
                "name": T.ALLREDUCE,
                "cat": T.CAT_COMM,
                "ts": t0 + 100,
                "dur": 100.0,
                "pid": rank,
                "tid": 2,
            }
        )
        events.append(
            {
                "ph": "X",
                "name": T.ALLREDUCE,
                "cat": T.CAT_COMM,
                "ts": t0 + 150,
                "dur": 100.0,
                "pid": rank,
                "tid": 3,
            }
        )
        events.append(
            {
                "ph": "B",
                "name": T.COMPRESS,
                "cat": T.CAT_CODEC,
                "ts": t0 + 10,
                "pid": rank,
                "tid": 2,
            }
        )
        events.append(
            {
                "ph": "E",
                "name": T.COMPRESS,
                "cat": T.CAT_CODEC,
                "ts": t0 + 40,
                "pid": rank,
                "tid": 2,
            }
        )
        events.append({"ph": "X", "name": T.AGREE, "cat": T.CAT_AGREE, "ts": t0 + 300, "dur": 20.0,
                       "pid": rank, "tid": 4})
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"rank": rank}}))
    return str(path)


def test_summary_of_a_known_trace(tmp_path):
    s = M.summarize(write_known_trace(tmp_path / "k.json"))
    top = {r["name"]: r for r in s["top_phases"]}
    assert s["top_phases"][0]["name"] == T.ALLREDUCE
    assert top[T.ALLREDUCE]["count"] == 4 and top[T.ALLREDUCE]["total_ms"] == 0.4
    assert top[T.COMPRESS]["count"] == 2 and abs(top[T.COMPRESS]["total_ms"] - 0.06) < 1e-9
    assert [r["step"] for r in s["steps"]] == [0, 1]
    for r in s["steps"]:
        assert r["step_ms"] == 1.0
        assert abs(r["comm_ms"] - 0.17) < 1e-9       # union: 100..250 plus the 20 us agreement
        assert abs(r["comm_sum_ms"] - 0.22) < 1e-9   # plain sum counts the overlap twice
    text = M.format_summary(s)
    assert "allreduce" in text and "Communication per step" in text


def test_steps_from_markers_when_there_are_no_step_bars(tmp_path):
    events = [
        {
            "ph": "i",
            "name": f"step {k}",
            "cat": T.CAT_STEP,
            "ts": 500.0 * k,
            "pid": 0,
            "tid": 1,
            "s": "g",
            "args": {"step": k},
        }
        for k in range(3)
    ]
    events.append({"ph": "X", "name": T.ALLREDUCE, "cat": T.CAT_COMM, "ts": 600.0, "dur": 50.0,
                   "pid": 0, "tid": 2})
    (tmp_path / "m.json").write_text(json.dumps(events))  # the JSON-array flavour
    s = M.summarize(str(tmp_path / "m.json"))
    assert [(r["step"], r["comm_ms"]) for r in s["steps"]] == [(0, 0.0), (1, 0.05)]


def test_cli_prints_and_plots_a_recorded_merged_trace(tmp_path, capsys):
    paths = []
    for rank in (0, 1):
        tl = T.Timeline()
        paths.append(tl.start(str(tmp_path / "r.json"), rank=rank))
        for step in range(3):
            tl.mark_step(step)
            t = T.now_us()
            for k, name in enumerate(
                (T.QUEUE, T.FUSE, T.COMPRESS, T.ALLREDUCE, T.DECOMPRESS, T.UNPACK)
            ):
                cat = T.CAT_COMM if name == T.ALLREDUCE else T.CAT_ENGINE
                tl.complete(name, cat, t + 20 * k, 15.0, tid="bucket 0")
        tl.stop()
    merged = T.merge(paths, str(tmp_path / "merged.json"))
    png = tmp_path / "step.png"
    assert M.main([merged, "--plot", str(png), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "allreduce" in out and "plot:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert M.main([merged, "--plot", str(tmp_path / "no.png"), "--step", "99"]) == 2
    assert "step 99 is not in" in capsys.readouterr().err
    assert M.main([merged, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == [0, 1]


spans = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(spans)
def test_union_matches_a_unit_grid(raw):
    """The interval union equals counting covered unit cells (integer endpoints)."""
    ivs = [(float(a), float(a + d)) for a, d in raw]
    cells = set()
    for a, b in ivs:
        cells.update(range(int(a), int(b)))
    assert M._union_us(ivs) == len(cells)
