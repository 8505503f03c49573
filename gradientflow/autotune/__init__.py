"""Autotune: search the engine's settings during the first steps of training (docs/AUTOTUNE.md).

Rank 0 runs an optuna study; every rank applies the same settings from the same step, after an
ordered exchange and a drain of its engine (tuner.py says why that cannot pair different
messages or touch a gradient). Turn it on with GRADIENTFLOW_AUTOTUNE=1 or
pg_options={"autotune": True} (the step is then marked by every optimizer.step()), or with
`enable(group)` / `Tuner(group)` and a `tuner.step()` per training step.
"""
from __future__ import annotations

from typing import Any

from gradientflow.autotune.space import DEFAULT_PARAMS, PARAMS, Param
from gradientflow.autotune.tuner import AutotuneMismatch, Tuner, summary_text, tuned_compression

__all__ = ["AutotuneMismatch", "DEFAULT_PARAMS", "PARAMS", "Param", "Tuner", "enable",
           "summary_text", "tuned_compression", "tuner_of"]


def enable(group: Any = None, hook: bool = False, **options: Any) -> Tuner:
    """Start tuning `group` (None: the default group); returns its Tuner.

    `hook=True`: every optimizer.step() in this process marks a step (one optimizer step per
    training step on every rank); otherwise call `tuner.step()` after each training step.
    `options`: Tuner's arguments (params, trials, steps, warmup, seed, sampler, log_path, out,
    confirm, finalists, compression: a CSCState whose chunk size is tuned too).
    """
    from gradientflow.backend.registry import backend_of

    backend = backend_of(group)
    if backend is None:
        raise ValueError("autotune: the process group does not use the gradientflow backend")
    return attach(backend, hook=hook, **options)


def attach(backend: Any, hook: bool = True, **options: Any) -> Tuner:
    """The tuner of `backend` (made on first call); the backend closes it at shutdown."""
    tuner = getattr(backend, "tuner", None)
    if tuner is None:
        tuner = backend.tuner = Tuner(backend=backend, **options)
    if hook:
        tuner.attach_optimizer_hook()
    return tuner


def attach_auto(backend: Any) -> Tuner | None:
    """Autotune turned on by the config: a tuner marked by optimizer steps, for the first such
    group of this process only (one optimizer hook per process; tune other groups with
    `enable`)."""
    from gradientflow.backend import registry

    others = [b for b in registry.backends()
              if b is not backend and getattr(b, "tuner", None) is not None]
    if others:
        return None
    return attach(backend, hook=True)


def tuner_of(group: Any = None) -> Tuner | None:
    """The Tuner of `group`, or None."""
    from gradientflow.backend.registry import backend_of

    backend = backend_of(group)
    return None if backend is None else getattr(backend, "tuner", None)
