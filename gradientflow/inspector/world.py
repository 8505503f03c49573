"""Facts about the ranks outside any transport: same world size at start, a peer's process alive."""
from __future__ import annotations

import datetime
import os
from typing import Any

from gradientflow.errors import EngineError


def pid_alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process stays a zombie until its parent reaps it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def check_world(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Refuse ranks started with different world sizes, with a sentence, before any transport.

    Every rank writes its world size; rank 0 reads everyone's, the others read rank 0's. Left
    to the transport, the ranks would fail after different timeouts with "Connect timeout".
    """
    store.set(f"gradientflow/world/{rank}", str(world_size))
    peers = range(1, world_size) if rank == 0 else [0]
    for r in peers:
        key = f"gradientflow/world/{r}"
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001
            raise EngineError(
                f"gradientflow: rank {rank}: rank {r} of the {world_size} this rank was started "
                f"with never joined within {timeout_s:.0f} s. Start every rank with the same "
                "world_size (and check that all of them run)."
            ) from exc
        theirs = int(store.get(key))
        if rank != 0:
            # Tell rank 0 this rank has read its size: rank 0 hosts the store, and if it raised
            # and exited first, this rank would only see "Connection reset by peer".
            store.set(f"gradientflow/world-ack/{rank}", "1")
        elif theirs != world_size:
            try:
                store.wait([f"gradientflow/world-ack/{r}"], datetime.timedelta(seconds=5))
            except Exception:  # noqa: BLE001 - raise the clear error below regardless
                pass
        if theirs != world_size:
            raise EngineError(
                f"gradientflow: rank {rank}: mismatched world sizes: this rank was started with "
                f"world_size={world_size}, rank {r} with world_size={theirs}. Start every rank "
                "with the same world_size.")
