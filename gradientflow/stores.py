"""A connection of one's own to the job's store.

A TCPStore client serves one request at a time, and a blocking request (get or wait for a key
that is not there yet) holds its connection until it is answered. Two threads of a rank that
both wait on one connection therefore wait in turn: when the first waits for a key that a peer
publishes only after its own second thread got through, every rank waits on every other until
the store's timeout. Whatever may block on the store while another thread of the rank uses it
(lazily created transport groups, the topology exchange, the inspector's check-ins) takes a
connection of its own.
"""
from __future__ import annotations

from typing import Any


def own_connection(store: Any) -> Any:
    """A new client connection to the same store (PrefixStores keep their prefix); stores
    without clone() (HashStore, FileStore: nothing to hold) are returned as they are."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - clone() is not implemented by every store
        return store
