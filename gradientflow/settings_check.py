"""Settings every rank of a group must share, checked once at init through the store.

The fused message cut is a pure function of the agreed batch and of the thresholds, so two
ranks with different thresholds cut different messages and pair wrong bytes; a debug check or
an inspector on some ranks only waits for peers that never answer. The ranks agree on the
settings below through the store (cross_rank.agree, rank 0 gathering); on a mismatch every rank
raises, naming the setting, its values and the ranks that hold each.

The other settings are local and may differ (tests/conformance/test_agreement.py runs ranks
with different values of each): cycle_time_ms and fusion_segments (when a round starts and
how many buffers pack it: the rounds agree on the batch regardless), kernel_threads,
local_world_size and host (as long as every rank agrees whether the group spans hosts),
stall_warning_s, stall_abort_s (how long this rank waits before it warns or
aborts) and timeline (what this rank records).
"""
from __future__ import annotations

import json
from typing import Any

from gradientflow.config import ENV_PREFIX, Config
from gradientflow.cross_rank import StoreExchange, agree

# Setting name -> how its value is read from a Config (what has to agree).
AGREED = {
    "fusion_threshold": lambda c: c.fusion_threshold,
    "solo_threshold": lambda c: c.solo_threshold,
    "solo_channel": lambda c: c.solo_channel,
    "sync_fusion_limit": lambda c: c.sync_fusion_limit,
    "debug": lambda c: c.debug,
    # Ranks on different transports would wait in different process groups.
    "cuda_transport": lambda c: c.cuda_transport,
    "algorithm": lambda c: c.algorithm,
    "reducers": lambda c: c.reducers,
    # Only whether the inspector runs: its interval is this rank's polling period.
    "inspect_interval_s": lambda c: c.inspect_interval_s > 0,
}
_KEY = "gradientflow/settings/"


class SettingsMismatch(ValueError):
    """Ranks of one group were started with different values of a setting that must agree."""


# Derived from local settings, yet decided alike on every rank: whether this rank will look
# up which ranks share a host (the algorithms' inter-host byte counts do, through the store, so
# a rank that looks alone would wait for peers that never answer).
SPANS_HOSTS = "spans_hosts"
_SPANS_HOSTS_SAYS = ("whether the group spans hosts (GRADIENTFLOW_HOST set, or torchrun's "
                     "LOCAL_WORLD_SIZE below the group's size)")


def spans_hosts(config: Config, size: int) -> bool:
    """Whether the ranks of a group of `size` are said to sit on more than one host."""
    return bool(config.host) or 0 < config.local_world_size < size


def agreed_settings(config: Config, size: int = 0) -> dict[str, Any]:
    """The settings of `config` that every rank of a group of `size` must share."""
    out = {name: read(config) for name, read in AGREED.items()}
    out[SPANS_HOSTS] = spans_hosts(config, size)
    return out


def describe(settings: list[dict[str, Any]]) -> str:
    """'' if every rank's agreed settings are the same, else one sentence per differing one."""
    parts = []
    for name in [*AGREED, SPANS_HOSTS]:
        holders: dict[str, list[int]] = {}
        for rank, held in enumerate(settings):
            holders.setdefault(json.dumps(held.get(name)), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{v} on ranks {r}" for v, r in holders.items())
            says = (_SPANS_HOSTS_SAYS if name == SPANS_HOSTS
                    else f"{name} ({ENV_PREFIX}{name.upper()})")
            parts.append(f"{says} is {values}")
    return ". ".join(parts)


def check(store: Any, rank: int, size: int, config: Config, timeout_s: float) -> None:
    """Raise SettingsMismatch on every rank if the agreed settings differ across ranks."""
    mine = json.dumps(agreed_settings(config, size))
    found = agree(mine, StoreExchange(store, _KEY, rank, size, timeout_s), rank)
    if found is None:
        return
    verdict = describe([json.loads(d) for d in found.descriptions])
    raise SettingsMismatch(
        f"gradientflow: rank {rank}: settings differ across the {size} ranks of this "
        f"group: {verdict}. Give every rank the same {ENV_PREFIX}* environment and "
        "gradientflow.configure() options (or pg_options).")
