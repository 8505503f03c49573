"""Timeline and statistics recorded by the engine on 2 ranks, for a known program."""
from __future__ import annotations

import json


def known_program(rank, world, path):
    import torch
    import torch.distributed as dist

    import gradientflow

    gradientflow.start_timeline(path, steps=(1, 2))
    gradientflow.reset_stats()
    sent = 0
    for step in range(4):
        gradientflow.mark_step(step)
        ts = [torch.ones(100) * rank for _ in range(8)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in works:
            w.wait()
        sent += sum(t.numel() * 4 for t in ts)

        def stages():
            yield torch.ones(16)  # the summed norms are not needed here
            packed = yield torch.ones(64, dtype=torch.float16)
            return packed

        fut = gradientflow.backend.submit_stages(dist.group.WORLD, "b0", stages(),
                                                 dense_bytes=4000)
        fut.wait()
        sent += 16 * 4 + 64 * 2
    written = gradientflow.stop_timeline()
    s = gradientflow.stats()
    return written, s, sent


def test_timeline_and_stats_through_the_engine(pools, tmp_path):
    res = pools(2).run(known_program, str(tmp_path / "trace.json"),
                       env={"GRADIENTFLOW_CYCLE_TIME_MS": "1000"})
    for rank, (written, s, sent) in enumerate(res):
        trace = json.load(open(written))
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        names = {e.get("name") for e in events}
        for phase in ("queue", "fuse", "allreduce", "unpack", "agree", "compress", "decompress"):
            assert any(n and n.lower() == phase for n in names), (phase, sorted(map(str, names)))
        steps = {e.get("args", {}).get("step") for e in events if e.get("ph") == "i"}
        steps.discard(None)
        assert steps == {1, 2}, steps  # sampling kept steps 1-2, and marked both
        assert s["wire_bytes"] == sent, (s["wire_bytes"], sent)
        assert s["operations"] == 4 * 9
        assert s["agreement_rounds"] >= 4
