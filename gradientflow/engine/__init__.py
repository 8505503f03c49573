"""The ordered engine: sequencing, agreement, fusion and transport of one process group."""
from gradientflow.engine.api import flush, scheduler_of, submit_stages
from gradientflow.engine.stages import StageGen, drive, drive_lockstep

__all__ = ["StageGen", "drive", "drive_lockstep", "flush", "scheduler_of", "submit_stages"]
