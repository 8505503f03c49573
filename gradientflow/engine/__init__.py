"""The ordered engine of one process group: issue -> agreement -> messages -> completion.

See engine.py for the pipeline. The layers above reach a group's engine through
gradientflow.backend (backend_of, submit_stages, flush, allreduce_async); this package exports
only the multi-stage contract they build ops with.
"""
from gradientflow.engine.stages import StageGen, drive, drive_lockstep

__all__ = ["StageGen", "drive", "drive_lockstep"]
