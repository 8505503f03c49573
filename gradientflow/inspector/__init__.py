"""The stall inspector: check-ins, mismatch detection and clear peer-failure errors.

One `Inspector` per process group. The engine records every collective into it (issue
order, under the engine's lock) and asks it to explain its first error; its background
thread publishes check-ins to the store and fails the group on a mismatch or an aborted
stall. It imports nothing of the engine: it sees Works and sequence numbers only.
"""
from gradientflow.inspector.debug import DebugCheck
from gradientflow.inspector.inspector import Inspector
from gradientflow.inspector.world import check_world, pid_alive

__all__ = ["DebugCheck", "Inspector", "check_world", "pid_alive"]
