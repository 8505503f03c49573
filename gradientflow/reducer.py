"""A reducer process of the Reduction Server: `python -m gradientflow.reducer --workers N`.

Stateless and CPU-only. It joins the workers' rendezvous store (MASTER_ADDR/MASTER_PORT, or
--store HOST:PORT: torchrun's --rdzv-endpoint), serves every channel the workers register
there (one per process group and transport stream), and for each message receives its shard
from every worker, sums the shards in worker rank order and sends the sum back to each. All
transport is torch.distributed: one gloo group per channel and generation (workers 0..N-1,
this reducer N), point-to-point send/recv. See gradientflow/algorithms/reduction_server.py for
the protocol and docs/ALGORITHMS.md for the command lines.

Without --index it starts --reducers processes, one per index, and waits for them.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import subprocess
import sys
import threading

import torch

from gradientflow.algorithms import reduction_server as rs

_FOREVER = datetime.timedelta(days=7)  # a reducer waits for workers as long as it lives
DEPTH = 4  # pieces whose receives are posted ahead of the one being reduced


def _log(msg: str) -> None:
    print(f"gradientflow.reducer[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _reduce(parts: list[torch.Tensor], op: int, out: torch.Tensor) -> None:
    """Combine the workers' parts in worker rank order into `out`."""
    out.copy_(parts[0])
    for p in parts[1:]:
        if op == 0:
            out.add_(p)
        elif op == 1:
            out.mul_(p)
        elif op == 2:
            torch.minimum(out, p, out=out)
        else:
            torch.maximum(out, p, out=out)


class ChannelServer:
    """Serves one channel for reducer `index`: generation after generation, until stopped."""

    def __init__(self, store, channel: str, workers: int, timeout_s: float, index: int,
                 reducers: int) -> None:
        self.store = store
        self.channel = channel
        self.n = workers
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.index = index
        self.reducers = reducers
        self.stop = threading.Event()
        self.served = 0

    def run(self) -> None:
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

        ns = f"{self.channel}/r{self.index}/"
        while not self.stop.is_set():
            gen = self.store.add(f"{ns}gen", 1)
            self.store.set(f"{ns}up{gen}", str(os.getpid()))
            try:
                group = ProcessGroupGloo(PrefixStore(f"{ns}g{gen}/", self.store), self.n,
                                         self.n + 1, _FOREVER)
            except Exception as exc:  # noqa: BLE001 - workers gone: claim the next generation
                _log(f"channel {self.channel}: generation {gen} did not connect: {exc}")
                continue
            _log(f"channel {self.channel}: serving generation {gen} for {self.n} workers")
            try:
                while not self.stop.is_set():
                    self._one_message(group)
                    self.served += 1
            except Exception as exc:  # noqa: BLE001 - a worker died or erred: next generation
                _log(f"channel {self.channel}: generation {gen} ended: {exc}")
                try:
                    self.store.set(f"{ns}g{gen}/error", str(exc))
                except Exception:  # noqa: BLE001
                    pass

    def _one_message(self, group) -> None:
        n = self.n
        headers = [torch.zeros(rs.HEADER, dtype=torch.int64) for _ in range(n)]
        works = [group.recv([headers[w]], w, 0) for w in range(n)]
        works[0].wait()  # the next message may be a long way off: no timeout
        for w in works[1:]:
            w.wait(self.timeout)
        h = headers[0].tolist()
        for w in range(1, n):
            if headers[w].tolist()[1:] != h[1:] or headers[w][0].item() != rs.MAGIC:
                raise RuntimeError(
                    f"reducer {self.index}: workers disagree on message {h[1]}: worker 0 sent "
                    f"{h}, worker {w} {headers[w].tolist()} (magic, message, numel, dtype, op, "
                    "chunk)")
        if h[0] != rs.MAGIC:
            raise RuntimeError(f"reducer {self.index}: bad header {h} from worker 0")
        _, _, numel, code, op, chunk = h
        dtype = rs.DTYPES[code]
        pieces = rs.chunk_bounds(numel, chunk)
        size = min(chunk, numel)
        # A piece flows once its receive is posted (gloo's unbound buffers wait for it): DEPTH
        # pieces stay posted ahead of the one being reduced, so the links never wait on us.
        pool = [[torch.empty(size, dtype=dtype) for _ in range(n)] for _ in range(DEPTH + 1)]
        posted: collections.deque = collections.deque()
        nxt = 0

        def post() -> None:
            nonlocal nxt
            if nxt < len(pieces):
                a, b = pieces[nxt]
                bufs = pool.pop()
                posted.append((bufs, [group.recv([bufs[w][:b - a]], w, 1 + nxt)
                                      for w in range(n)]))
                nxt += 1

        for _ in range(DEPTH):
            post()
        # Two result buffers: piece c's sends may still read one while c+1 is reduced into
        # the other; piece c+2 waits for piece c's sends first.
        outs = [torch.empty(size, dtype=dtype) for _ in range(2)]
        sending: list[list] = [[], []]
        for c in range(len(pieces)):
            post()
            bufs, works = posted.popleft()
            for w in works:
                w.wait(self.timeout)
            a, b = pieces[c]
            for s in sending[c % 2]:
                s.wait(self.timeout)
            res = outs[c % 2][:b - a]
            _reduce([x[:b - a] for x in bufs], op, res)
            sending[c % 2] = [group.send([res], w, 1 + c) for w in range(n)]
            pool.append(bufs)
        for s in sending[0] + sending[1]:
            s.wait(self.timeout)


def serve(store, index: int, reducers: int, workers: int | None,
          stop: threading.Event | None = None) -> None:
    """Serve every channel registered in `store` (the job's root store) as reducer `index`."""
    from torch._C._distributed_c10d import PrefixStore

    ns = PrefixStore(rs.NAMESPACE, store)
    stop = stop or threading.Event()
    seen = 0
    threads = []
    while not stop.is_set():
        key = f"channel/{seen}"
        try:
            ns.wait([key], datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - no new channel yet
            continue
        name, size, timeout_s = ns.get(key).decode().split("|")
        seen += 1
        if workers and int(size) != workers and name.startswith("0."):
            _log(f"channel {name} has {size} workers, --workers said {workers}")
        # A store client of its own per channel: this thread's long waits for the next
        # channel must not hold the connection a channel's rendezvous goes through.
        own = PrefixStore(rs.NAMESPACE, rs.own_client(store, 300.0))
        server = ChannelServer(own, name, int(size), float(timeout_s), index, reducers)
        t = threading.Thread(target=server.run, name=f"reducer-{name}", daemon=True)
        t.start()
        threads.append(t)


def connect(endpoint: str | None, timeout_s: float):
    """The job's TCPStore, as a client: HOST:PORT, else MASTER_ADDR/MASTER_PORT."""
    from torch.distributed import TCPStore

    from gradientflow.config import rendezvous_endpoint

    if endpoint:
        host, _, port = endpoint.rpartition(":")
        where = (host, int(port))
    else:
        where = rendezvous_endpoint()
        if where is None:
            raise SystemExit("gradientflow.reducer: give --store HOST:PORT or set MASTER_ADDR "
                             "and MASTER_PORT to the workers' rendezvous store")
    return TCPStore(where[0], where[1], is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradientflow.reducer",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, required=True, help="workers in the job (N)")
    ap.add_argument("--reducers", type=int, default=1, help="reducers in the job (R)")
    ap.add_argument("--index", type=int, default=None,
                    help="serve as reducer J only (default: start all R here)")
    ap.add_argument("--store", default=None,
                    help="HOST:PORT of the workers' store (default: MASTER_ADDR:MASTER_PORT)")
    ap.add_argument("--connect-timeout", type=float, default=300.0,
                    help="seconds to wait for the store to be up")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.reducers < 1:
        ap.error("--workers and --reducers must be at least 1")
    if args.index is None:
        procs = []
        for j in range(args.reducers):
            cmd = [sys.executable, "-m", "gradientflow.reducer", "--workers", str(args.workers),
                   "--reducers", str(args.reducers), "--index", str(j),
                   "--connect-timeout", str(args.connect_timeout)]
            if args.store:
                cmd += ["--store", args.store]
            procs.append(subprocess.Popen(cmd))
        try:
            return max(p.wait() for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
    if not 0 <= args.index < args.reducers:
        ap.error(f"--index must be in 0..{args.reducers - 1}")
    torch.set_num_threads(1)
    store = connect(args.store, args.connect_timeout)
    _log(f"reducer {args.index} of {args.reducers} joined the store")
    try:
        serve(store, args.index, args.reducers, args.workers)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
