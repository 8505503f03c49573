"""Entry-point registrar: makes backend="gradientflow" known to torch.distributed.

torch >= 2.14 looks up an unknown backend name in the `torch.distributed.backends` entry-point
group at init_process_group / new_group time and calls `register()`. It must be cheap,
idempotent and must never raise: it only calls `register_backend` with a creator that imports
the rest of the package lazily.
"""
from __future__ import annotations

BACKEND_NAME = "gradientflow"


def _create(dist_backend_opts, pg_options):
    # Imported here, not at module level, so that registration stays cheap and import-safe.
    from gradientflow.backend.backend import create_backend

    backend = create_backend(dist_backend_opts, pg_options)
    if backend.config.autotune:
        # autotune drives the backend from above, so the entry point attaches it: the
        # backend itself never imports the layer that tunes it
        from gradientflow.autotune import attach_auto

        attach_auto(backend)
    return backend


def register() -> None:
    """Register the gradientflow backend with torch.distributed (idempotent, never raises)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    except Exception:  # noqa: BLE001 - a registrar that raises would break every init
        return
