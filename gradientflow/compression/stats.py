"""Compression statistics, with one definition of wire bytes used everywhere.

**Wire bytes** of a step = the bytes of every tensor this rank hands to a SUM allreduce for its
gradients in that step: CSC's chunk-norm vectors, its packed chunks and its dense parts, the FP16
buffer, or the dense FP32 buffer. It is the payload each rank contributes, independent of the
transport: a ring allreduce moves 2(n-1)/n times it over each link, for dense and compressed
payloads alike, so ratios are the same either way. The **dense FP32 equivalent** is 4 bytes per
gradient element. **Steady state** = the steps whose density in force is the target (after
warm-up); the **whole-run average** includes warm-up.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..observability.stats import STATS

__all__ = ["CompressionStats", "StepRecord"]


@dataclass
class StepRecord:
    """What one step sent (summed over its buckets)."""

    wire_bytes: int = 0
    dense_fp32_bytes: int = 0
    chunks_sent: int = 0
    chunks_total: int = 0
    elements_sent_dense: int = 0
    density: float = 1.0
    warmup: bool = False


class CompressionStats:
    """Accumulate per-step wire statistics; `as_dict()` is what a hook state's `stats()` returns.

    Each bucket's selection is also reported to the process-wide sink, so
    `gradientflow.stats()["density"]` is the density the compressors really used.
    """

    def __init__(self) -> None:
        self.current = StepRecord()
        self.last: StepRecord | None = None
        self.steps = 0
        self.steady_steps = 0
        self.skipped_steps = 0
        self._total = StepRecord()
        self._steady = StepRecord()

    def add_wire(self, nbytes: int) -> None:
        """Count one tensor handed to an allreduce."""
        self.current.wire_bytes += int(nbytes)

    def add_bucket(
        self,
        *,
        numel: int,
        chunks_sent: int = 0,
        chunks_total: int = 0,
        elements_sent_dense: int = 0,
        density: float = 1.0,
        warmup: bool = False,
    ) -> None:
        """Count one bucket's dense equivalent and selection."""
        c = self.current
        c.dense_fp32_bytes += 4 * int(numel)
        c.chunks_sent += int(chunks_sent)
        c.chunks_total += int(chunks_total)
        c.elements_sent_dense += int(elements_sent_dense)
        c.density = float(density)
        c.warmup = c.warmup or bool(warmup)
        if chunks_total:
            STATS.record_chunks(int(chunks_sent), int(chunks_total))

    def end_step(self, skipped: bool = False) -> None:
        """Close the current step (a hook calls this after a backward pass's last bucket)."""
        c = self.current
        self.skipped_steps += int(skipped)
        if c.dense_fp32_bytes == 0 and c.wire_bytes == 0:
            return
        for acc in (self._total,) + (() if c.warmup else (self._steady,)):
            acc.wire_bytes += c.wire_bytes
            acc.dense_fp32_bytes += c.dense_fp32_bytes
            acc.chunks_sent += c.chunks_sent
            acc.chunks_total += c.chunks_total
            acc.elements_sent_dense += c.elements_sent_dense
        self.steps += 1
        self.steady_steps += 0 if c.warmup else 1
        self.last = c
        self.current = StepRecord(density=c.density)

    def as_dict(self) -> dict:
        """Return the statistics as plain numbers (per step: steady state and whole-run average)."""
        def per_step(acc: StepRecord, n: int) -> dict:
            if n == 0:
                return {
                    "wire_bytes": None,
                    "dense_fp32_bytes": None,
                    "ratio": None,
                    "chunks_sent": None,
                }
            return {
                "wire_bytes": acc.wire_bytes / n,
                "dense_fp32_bytes": acc.dense_fp32_bytes / n,
                "ratio": acc.dense_fp32_bytes / acc.wire_bytes if acc.wire_bytes else None,
                "chunks_sent": acc.chunks_sent / n,
                "chunks_total": acc.chunks_total / n,
                "elements_sent_dense": acc.elements_sent_dense / n,
            }
        last = self.last or self.current
        return {
            "steps": self.steps,
            "steady_steps": self.steady_steps,
            "skipped_steps": self.skipped_steps,
            "steady": per_step(self._steady, self.steady_steps),
            "average": per_step(self._total, self.steps),
            # Run totals (steps summed), also under the short names the observability counters use.
            "wire_bytes": self._total.wire_bytes,
            "dense_bytes": self._total.dense_fp32_bytes,
            "density_in_force": last.density,
            "last_step": asdict(last),
        }

    def state_dict(self) -> dict:
        """Return the counters (so a resumed run's whole-run average continues)."""
        return {
            "steps": self.steps,
            "steady_steps": self.steady_steps,
            "skipped_steps": self.skipped_steps,
            "total": asdict(self._total),
            "steady": asdict(self._steady),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counters saved by `state_dict`."""
        self.steps = int(state["steps"])
        self.steady_steps = int(state["steady_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._total = StepRecord(**state["total"])
        self._steady = StepRecord(**state["steady"])
