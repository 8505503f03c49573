"""Every error gradientflow raises on purpose, in one module every layer may import.

Two families: `CollectiveError` (bad arguments, refused before anything is sent: the group
stays usable) and `EngineError` (the group can no longer make progress: a peer died, ranks
issued different collectives, a stall was aborted, the group was destroyed).
"""
from __future__ import annotations

__all__ = ["CollectiveError", "CollectiveMismatchError", "EngineError", "PeerFailureError",
           "StallError"]


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
