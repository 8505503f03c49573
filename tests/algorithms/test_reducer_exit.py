"""A reducer whose job has ended exits instead of spinning on a refused store connection."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

STORE = textwrap.dedent("""
    import datetime, sys
    from torch.distributed import TCPStore
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=60))
    print(s.port, flush=True)
    sys.stdin.read()  # the job lives until the test closes our stdin
""")


@pytest.mark.timeout(180)
def test_reducer_exits_when_the_jobs_store_is_gone():
    store = subprocess.Popen([sys.executable, "-c", STORE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    reducer = None
    try:
        port = int(store.stdout.readline())
        reducer = subprocess.Popen(
            [sys.executable, "-m", "gradientflow.reducer", "--workers", "2", "--reducers", "1",
             "--index", "0", "--store", f"127.0.0.1:{port}", "--connect-timeout", "60"],
            stderr=subprocess.PIPE, text=True)
        # the reducer says it joined before it waits for channels
        joined = reducer.stderr.readline()
        assert "joined the store" in joined, joined
        store.stdin.close()
        store.wait(timeout=60)
        try:
            rc = reducer.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the reducer kept running 90 s after its job's store went away")
        assert rc == 0
        assert "store is gone" in reducer.stderr.read()
    finally:
        for p in (reducer, store):
            if p is not None and p.poll() is None:
                p.kill()
