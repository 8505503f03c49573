"""Timeline: valid Chrome traces, expected phases, sampling, restart, off means nothing written."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from gradientflow.observability import timeline as T

# Python source that imports the timeline in a fresh process without running the package's
# __init__ (which imports torch): the packages are empty shells over their folders, so the
# timeline and the observability modules it imports are loaded from their files alone. That
# keeps such a test fast and checks that they are a stdlib-only leaf.
LOAD_ALONE = "; ".join([
    "import sys, types",
    *[f"m = types.ModuleType({name!r}); m.__path__ = [{os.path.dirname(path)!r}]; "
      f"sys.modules[{name!r}] = m"
      for name, path in (("gradientflow", os.path.dirname(os.path.dirname(T.__file__)) + "/x"),
                         ("gradientflow.observability", T.__file__))],
    "from gradientflow.observability import timeline as T",
])

PIPELINE = [(T.QUEUE, T.CAT_ENGINE), (T.FUSE, T.CAT_ENGINE), (T.COMPRESS, T.CAT_CODEC),
            (T.ALLREDUCE, T.CAT_COMM), (T.DECOMPRESS, T.CAT_CODEC), (T.UNPACK, T.CAT_ENGINE)]


def assert_chrome_trace(path: str) -> dict:
    """Check the file is JSON in Chrome's Trace Event Format; return it."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)  # strict: the closing bracket must be there
    assert isinstance(data["traceEvents"], list)
    stacks = collections.defaultdict(list)
    for ev in data["traceEvents"]:
        assert ev["ph"] in {"X", "B", "E", "i", "C", "M"}, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        assert isinstance(ev["name"], str), ev
        if ev["ph"] == "M":
            continue
        assert isinstance(ev["ts"], (int, float)), ev
        if ev["ph"] == "X":
            assert ev["dur"] >= 0, ev
        elif ev["ph"] == "B":
            stacks[(ev["pid"], ev["tid"])].append(ev)
        elif ev["ph"] == "E":
            b = stacks[(ev["pid"], ev["tid"])].pop()
            assert b["name"] == ev["name"] and b["ts"] <= ev["ts"], (b, ev)
    assert not any(stacks.values()), "unbalanced B events"
    return data


def phases(data):
    return [e for e in data["traceEvents"] if e["ph"] in "XBi" and e.get("cat") != T.CAT_STEP]


def run_program(tl: T.Timeline, steps: int, buckets: int = 3):
    """A synthetic engine step: per bucket the six phases recorded after the fact, plus spans."""
    for step in range(steps):
        tl.mark_step(step)
        for b in range(buckets):
            t = T.now_us()
            for k, (name, cat) in enumerate(PIPELINE):
                tl.complete(name, cat, t + 10 * k, 9.0, tid=f"bucket {b}",
                            args={"bucket": b, "step": step})
        with tl.span(T.AGREE, T.CAT_AGREE, tid="engine", args={"keys": buckets}):
            pass
        tl.begin("backward", "user")
        tl.end("backward", "user")
        tl.counter("bytes", {"wire": 100 * step})


def test_trace_is_chrome_format_with_expected_phases(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "trace.json"), rank=3)
    assert path == str(tmp_path / "trace.rank3.json")
    run_program(tl, steps=4)
    assert tl.stop() == path
    data = assert_chrome_trace(path)
    names = collections.Counter(e["name"] for e in phases(data))
    for name, _ in PIPELINE:
        assert names[name] == 4 * 3, name
    assert names[T.AGREE] == 4 and names["backward"] == 4
    assert {e["pid"] for e in data["traceEvents"]} == {3}
    markers = [e["args"]["step"] for e in data["traceEvents"] if e["ph"] == "i"]
    assert markers == [0, 1, 2, 3]
    bars = [e for e in data["traceEvents"] if e["ph"] == "X" and e["name"] == T.STEP]
    assert sorted(e["args"]["step"] for e in bars) == [0, 1, 2, 3]
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert {"bucket 0", "bucket 1", "bucket 2", "engine", "steps"} <= lanes
    assert any(lane.startswith("thread ") for lane in lanes)  # tid=None: the calling thread's lane
    assert data["otherData"]["dropped_events"] == 0 and data["otherData"]["rank"] == 3
    assert sum(1 for e in data["traceEvents"] if e["ph"] == "C") == 4


def test_sampling_records_only_the_requested_steps_and_closes_early(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "t{rank}.json"), rank=0, steps=(3, 5))
    assert path == str(tmp_path / "t0.json")
    assert not tl.enabled  # nothing before the first sampled step
    run_program(tl, steps=7)   # steps 0..6: step 6 lies past the range and closes the file
    assert not tl.recording
    data = assert_chrome_trace(path)  # complete before stop()
    steps_seen = sorted({e["args"]["step"] for e in phases(data) if "step" in e.get("args", {})})
    assert steps_seen == [3, 4, 5]
    assert [e["args"]["step"] for e in data["traceEvents"] if e["ph"] == "i"] == [3, 4, 5]
    assert tl.stop() == path and tl.stop() is None


def test_sampling_with_a_strided_range(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "s.json"), steps=range(0, 10, 4))
    run_program(tl, steps=10, buckets=1)
    tl.stop()
    data = assert_chrome_trace(path)
    assert [e["args"]["step"] for e in data["traceEvents"] if e["ph"] == "i"] == [0, 4, 8]
    assert {e["args"]["step"] for e in phases(data) if "step" in e.get("args", {})} == {0, 4, 8}


@pytest.mark.parametrize("steps", [(5, 2), (1, 2, 3), "all", 7])
def test_invalid_steps_are_refused_with_a_sentence(tmp_path, steps):
    with pytest.raises(ValueError, match="steps"):
        T.Timeline().start(str(tmp_path / "x.json"), steps=steps)


def test_disabled_recorder_writes_nothing(tmp_path):
    tl = T.Timeline()
    assert tl.enabled is False
    run_program(tl, steps=3)
    assert tl.span("x", "y") is T._NULL_SPAN  # no allocation while off
    assert tl.stop() is None
    assert list(tmp_path.iterdir()) == []
    # Started but outside the sampled steps: no phase reaches the file.
    path = tl.start(str(tmp_path / "late.json"), steps=(100, 101))
    run_program(tl, steps=5)
    tl.stop()
    assert phases(assert_chrome_trace(path)) == []


def test_stop_then_start_again(tmp_path):
    tl = T.Timeline()
    first = tl.start(str(tmp_path / "a.json"))
    run_program(tl, steps=2)
    with pytest.raises(RuntimeError, match="already recording"):
        tl.start(str(tmp_path / "b.json"))
    tl.stop()
    second = tl.start(str(tmp_path / "b.json"), rank=1)
    run_program(tl, steps=3)
    tl.stop()
    third = tl.start(str(tmp_path / "a.json"))  # same file again: overwritten, still valid
    run_program(tl, steps=1)
    tl.stop()
    assert third == first
    assert len([e for e in assert_chrome_trace(second)["traceEvents"] if e["ph"] == "i"]) == 3
    assert len([e for e in assert_chrome_trace(first)["traceEvents"] if e["ph"] == "i"]) == 1


def test_concurrent_threads_lose_nothing(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "c.json"), flush_interval_s=0.001)
    n_threads, per_thread = 8, 2000
    barrier = threading.Barrier(n_threads)

    def worker(i):
        barrier.wait()
        for k in range(per_thread):
            with tl.span("compress", T.CAT_CODEC, args={"k": k}):
                pass
            tl.complete("allreduce", T.CAT_COMM, T.now_us(), 1.0, tid=f"bucket {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    tl.stop()
    data = assert_chrome_trace(path)
    names = collections.Counter(e["name"] for e in phases(data))
    assert names == {"compress": n_threads * per_thread, "allreduce": n_threads * per_thread}
    # Each thread's spans land on their own lane.
    assert len({e["tid"] for e in phases(data) if e["name"] == "compress"}) == n_threads


def test_full_buffer_drops_and_counts_instead_of_blocking(tmp_path):
    tl = T.Timeline()
    # A flush interval far longer than the test: only the high-water wake-up drains the buffer,
    # so pushing far more than the capacity in a burst must drop some, count them, and stay valid.
    path = tl.start(str(tmp_path / "d.json"), capacity=8, flush_interval_s=3600)
    for _ in range(5000):
        tl.complete("fuse", T.CAT_ENGINE, T.now_us(), 1.0, tid="bucket 0")
    tl.stop()
    data = assert_chrome_trace(path)
    kept = len(phases(data))
    assert data["otherData"]["dropped_events"] + kept == 5000
    assert data["otherData"]["events"] == kept


def test_module_functions_and_interpreter_exit_close_the_file(tmp_path):
    # A process that never calls stop_timeline(): the atexit hook must write the closing bracket.
    # The module is loaded without the package (LOAD_ALONE).
    out = tmp_path / "exit.json"
    code = textwrap.dedent(f"""
        {LOAD_ALONE}
        assert "torch" not in sys.modules
        p = T.start_timeline({str(out)!r}, rank=0)
        T.TIMELINE.mark_step(0)
        for i in range(1000):
            T.TIMELINE.complete("unpack", "engine", T.now_us(), 1.0, tid="bucket 0")
        print(p)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    path = res.stdout.strip()
    assert path == str(tmp_path / "exit.rank0.json")
    assert len(phases(assert_chrome_trace(path))) == 1000


def test_load_trace_repairs_a_file_cut_short(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "cut.json"))
    run_program(tl, steps=2)
    tl.stop()
    text = open(path, encoding="utf-8").read()
    body = text[: text.rindex("\n],")]
    for cut in (body, body + ",", body[:-7]):   # a kill after an event, after a comma, mid-event
        (tmp_path / "k.json").write_text(cut, encoding="utf-8")
        assert len(T.load_trace(str(tmp_path / "k.json"))["traceEvents"]) > 10
    (tmp_path / "bad.json").write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        T.load_trace(str(tmp_path / "bad.json"))


def test_merge_sets_pid_to_rank(tmp_path):
    paths = []
    for rank in (0, 1):
        tl = T.Timeline()
        paths.append(tl.start(str(tmp_path / "r{rank}.json"), rank=rank))
        run_program(tl, steps=2)
        tl.stop()
    out = T.merge(paths, str(tmp_path / "merged.json"))
    data = assert_chrome_trace(out)
    assert {e["pid"] for e in data["traceEvents"]} == {0, 1}
    procs = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"rank 0", "rank 1"}
    assert data["otherData"]["align"] == "none"  # one host: one monotonic clock
    with pytest.raises(ValueError, match="align"):
        T.merge(paths, out, align="sideways")


def test_trace_path_for_rank(tmp_path):
    assert T.trace_path_for_rank("run/{rank}/t.json", 2) == "run/2/t.json"
    assert T.trace_path_for_rank("t.json", 1) == "t.rank1.json"
    assert T.trace_path_for_rank("trace", 0) == "trace.rank0.json"
    assert T.trace_path_for_rank(str(tmp_path), 4) == os.path.join(
        str(tmp_path), "timeline.rank4.json"
    )


def test_bad_times_and_odd_args_never_break_the_json(tmp_path):
    tl = T.Timeline()
    path = tl.start(str(tmp_path / "odd.json"))
    tl.complete("allreduce", T.CAT_COMM, float("nan"), 1.0, tid="b")   # dropped, counted
    tl.complete("allreduce", T.CAT_COMM, T.now_us(), -5.0, tid="b")    # dropped, counted
    tl.complete('we"ird\nname', T.CAT_COMM, T.now_us(), 1.0, tid="b",
                args={"dtype": object(), "nan": float("nan")})
    tl.complete("fuse", T.CAT_ENGINE, T.now_us(), 1.0, tid=7, args={"dtype": T})
    tl.stop()
    data = assert_chrome_trace(path)
    got = {e["name"]: e for e in phases(data)}
    assert set(got) == {'we"ird\nname', "fuse"}
    assert "repr" in got['we"ird\nname']["args"]           # NaN arg: kept as its repr
    assert isinstance(got["fuse"]["args"]["dtype"], str)   # odd value: its str
    assert data["otherData"]["dropped_events"] == 2


def test_a_forked_child_leaves_the_parents_file_alone(tmp_path):
    out = tmp_path / "fork.json"
    code = textwrap.dedent(f"""
        import os
        {LOAD_ALONE}
        p = T.TIMELINE.start({str(out)!r}, rank=0, flush_interval_s=0.001)
        for i in range(500):
            T.TIMELINE.complete("parent", "engine", T.now_us(), 1.0, tid="bucket 0")
        pid = os.fork()
        if pid == 0:   # the child: records nothing, and its normal exit runs atexit and GC
            for i in range(500):
                T.TIMELINE.complete("child", "engine", T.now_us(), 1.0, tid="bucket 0")
            T.TIMELINE.stop()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for i in range(500):
            T.TIMELINE.complete("parent", "engine", T.now_us(), 1.0, tid="bucket 0")
        T.TIMELINE.stop()
        print(p)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = assert_chrome_trace(res.stdout.strip())
    assert collections.Counter(e["name"] for e in phases(data)) == {"parent": 1000}


def test_an_unwritable_path_is_refused_with_a_sentence(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tl = T.Timeline()
    with pytest.raises(OSError, match="cannot write the trace"):
        tl.start(str(blocker / "sub" / "t.json"))
    assert not tl.recording and not tl.enabled
