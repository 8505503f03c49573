"""Every error gradientflow raises on purpose, in one module every layer may import.

Three families: `CollectiveError` (bad arguments, refused before anything is sent: the group
stays usable), `StepFailed` (one message failed alike on every rank, the group goes on) and
`EngineError` (the group can no longer make progress: a peer died, ranks
issued different collectives, a stall was aborted, the group was destroyed).
"""
from __future__ import annotations

__all__ = ["AutotuneMismatch", "CollectiveError", "CollectiveMismatchError", "EngineError",
           "PeerFailureError", "StallError", "StepFailed"]


class CollectiveError(ValueError):
    """A collective was called with arguments gradientflow cannot run correctly."""


class EngineError(RuntimeError):
    """The engine can no longer make progress (a peer died, a round timed out, shutdown)."""


class CollectiveMismatchError(EngineError):
    """Ranks issued different collectives (op, dtype, shape, root, reduce op) or in another
    order."""


class StallError(EngineError):
    """A collective waited longer than stall_abort_s for ranks that never joined it."""


class PeerFailureError(EngineError):
    """A collective failed because a peer died or closed its connections."""


class StepFailed(RuntimeError):
    """A message failed on every rank alike (agreed), leaving the process group consistent.

    The engine fails only the operations of that message with it, not the whole group: the
    next message (the next step) may go on, e.g. once a dead reducer was restarted.
    """


class AutotuneMismatch(RuntimeError):
    """The ranks are not at the same point of the tuning protocol (raised on every rank)."""
