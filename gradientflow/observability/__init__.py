"""GradientFlow observability layer: timeline (Chrome trace) and statistics.

Leaf layer: imports nothing else of gradientflow (stdlib only; matplotlib lazily, to plot).
The lead re-exports `start_timeline`, `stop_timeline`, `stats.stats` and `reset_stats` as
`gradientflow.*`; the engine records through `TIMELINE` and `STATS`. The function `stats` is
deliberately not re-exported here: it would shadow the submodule `observability.stats`.
"""
from gradientflow.observability.stats import STATS, Stats, reset_stats
from gradientflow.observability.timeline import (
    TIMELINE, Timeline, merge, now_us, start_timeline, stop_timeline,
)

__all__ = ["TIMELINE", "Timeline", "start_timeline", "stop_timeline", "merge", "now_us",
           "STATS", "Stats", "reset_stats"]
