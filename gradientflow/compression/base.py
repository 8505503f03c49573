"""The compressor interface: one flat gradient buffer in, a stage generator out."""
from __future__ import annotations

import abc
import inspect
import math
from typing import Any, ClassVar, Generator, Sequence

import torch

from ..engine.stages import Final, StageGen, fuse
from .config import CompressionConfig
from .layout import Layout
from .memory import ResidualMemory
from .sgd import SGDTerms
from .stats import CompressionStats

__all__ = ["Compressor", "QueuedBuffer", "reduce_queued"]


class Compressor(abc.ABC):
    """Turn one flat float32 gradient buffer into the average over ranks, as a StageGen.

    A compressor knows nothing of process groups: `reduce` yields each tensor to be
    SUM-allreduced in place and receives it reduced (see gradientflow.engine.stages). It owns
    the per-rank state: error-feedback memory keyed by parameter name, the schedule position
    (epoch, step) and the wire statistics. A method subclasses it in one file, registers itself
    with `register_compressor` (its options beside it), and implements `reduce`; the rest has
    defaults that fit any method.
    """

    name: ClassVar[str] = "?"
    # True only for the plain dense average: the optimizer then sums in the gradients' own dtype
    # without a compressor (and without its float32-only limit).
    dense_average: ClassVar[bool] = False
    # Whether the DDP buckets of a step are reduced together, as one op closed by the step's
    # last bucket (one set of collectives for all, and for CSC one choice of chunks across
    # them); False: each bucket goes as soon as it is ready, its collectives overlapping the
    # rest of the backward, as torch's hooks do.
    fuses_buckets: ClassVar[bool] = True

    @classmethod
    def applies_momentum(cls, config: CompressionConfig) -> bool:
        """Whether this method applies momentum itself under `config` (so the optimizer must
        not)."""
        return False

    def __init__(self, config: CompressionConfig, world_size: int) -> None:
        if not isinstance(config, CompressionConfig):
            raise TypeError(
                f"{type(self).__name__}: config must be a CompressionConfig, got "
                f"{type(config).__name__}"
            )
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"{type(self).__name__}: world_size={world_size!r} must be an integer >= 1"
            )
        # --- tuned by the user ---
        self.config = config
        self.world_size = world_size
        # --- internal ---
        self.memory = ResidualMemory()
        # Parameter name -> the learning rate its residual is expressed at (follow_lr); empty
        # until a bound SGD gives them.
        self.residual_lr: dict[str, float] = {}
        self.epoch = 0
        self.step = 0
        self._epoch_told = False
        # Whether each batch of this step reduced to finite values: bools, or 0-dim bool
        # tensors left on the device until end_step reads them all at once. Any False: undo
        # the step's commits.
        self._step_finite: list = []
        # --- statistics ---
        self.stats = CompressionStats()

    # --- the op -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def reduce(self, flat: torch.Tensor, layout: Layout, *, loss_scale: float = 1.0) -> StageGen:
        """Return a StageGen that averages `flat` over the ranks (in place where it can).

        Args:
            flat: the 1-D float32 gradient buffer of this rank (may be overwritten).
            layout: which parameter lives where in `flat` (names key the residual memory).
            loss_scale: the loss scale `flat` was produced under (GradScaler's), so state kept
                across steps is rescaled when it changes. The result is in the same units.
        """

    def prepare(self, flat: torch.Tensor, layout: Layout, loss_scale: float = 1.0,
                terms: SGDTerms | None = None) -> Any:
        """Do one buffer's local work ahead of its batch (before any collective) and return it
        for `reduce_many(prepared=...)`; None: nothing to do ahead (the default).

        `terms`: the optimizer's momentum and weight decay for this step, for a method that
        applies momentum (see applies_momentum and compression/momentum.py); others get None.

        The engine runs it while it waits for the batch to close. It must not change state
        kept across steps (only spare buffers), since the batch may still fail.
        """
        return None

    def reduce_many(self, flats: Sequence[torch.Tensor], layouts: Sequence[Layout], *,
                    loss_scale: float = 1.0, final: bool = False,
                    prepared: Sequence[Any] | None = None) -> StageGen:
        """Return a StageGen that averages several buffers as one fused op; returns the list of
        their results (what `reduce` returns for each).

        The engine calls it with the buffers of one fused batch. By default their stages are
        fused generically (engine.stages.fuse); a method that can do better (CSC: chunks chosen
        across the batch) overrides it. `final`: mark the last stage Final, so the engine need
        not wait for it (only where no stage follows, as in the engine's own batches); passed
        on to a `reduce` that takes `final`. `prepared`: what `prepare` returned for each
        buffer, if it ran.
        """
        kw = {"final": final} if "final" in inspect.signature(self.reduce).parameters else {}
        return (yield from fuse([self.reduce(f, layout, loss_scale=loss_scale, **kw)
                                 for f, layout in zip(flats, layouts)]))

    def _stage(self, tensor: torch.Tensor,
               final: bool = False) -> Generator[Any, torch.Tensor, torch.Tensor]:
        """Yield one tensor to the SUM allreduce, counting its bytes as wire bytes; `final`:
        the op's last stage (engine.stages.Final)."""
        self.stats.add_wire(tensor.numel() * tensor.element_size())
        reduced = yield (Final(tensor) if final else tensor)
        return reduced

    # --- schedule ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell the compressor the epoch (for an epoch-based warm-up), like
        DistributedSampler.set_epoch."""
        self.epoch = int(epoch)
        self._epoch_told = True

    def set_step(self, step: int) -> None:
        """Set the step counter (for a step-based warm-up resumed without this state's
        checkpoint)."""
        self.step = int(step)

    def keep_state_in_place(self) -> None:
        """Update the residual (and velocity) in place instead of through a spare buffer: one
        copy of the state instead of two (compression/memory.py).

        Only where nothing must be undone: no loss scale whose overflow skips a step, and no
        batch prepared ahead of its agreement (the FSDP2 path drives each reduction itself).
        Call it before the first step.
        """
        if self.memory.state_dict() or self.step:
            raise RuntimeError(f"{type(self).__name__}.keep_state_in_place: call it before the "
                               "first step (the state kept so far is double-buffered)")
        self.memory = ResidualMemory(double_buffer=False)

    def end_step(self) -> None:
        """Close a step (every bucket of one backward pass reduced): counts steps and statistics.

        If any bucket of the step reduced to a non-finite result (the same on every rank, since it
        is decided from reduced tensors), every bucket's residual/momentum update of this step is
        undone: GradScaler skips the whole step, so none of it may stay half-applied.
        """
        non_finite = self._step_was_non_finite()
        self.memory.end_step(revert=non_finite)
        self._close_step(non_finite)
        self.stats.end_step(skipped=non_finite)
        self._step_finite = []
        self.step += 1

    def _close_step(self, non_finite: bool) -> None:
        """Keep, or undo when `non_finite`, the step's changes to state kept outside `memory`
        (a method with such state overrides it)."""

    def _note_finite(self, ok) -> None:
        """Record whether a batch of this step reduced to finite values (a bool, or a 0-dim
        bool tensor that stays on its device until end_step)."""
        self._step_finite.append(ok)

    def _step_was_non_finite(self) -> bool:
        """Whether a batch of this step was not finite: one host read of the device flags."""
        flags = self._step_finite
        if not all(f for f in flags if isinstance(f, bool)):
            return True
        tensors = [f.reshape(()) for f in flags if not isinstance(f, bool)]
        if not tensors:
            return False
        dev = tensors[0].device
        return not bool(torch.stack([t.to(dev) for t in tensors]).all())

    def check_schedule(self) -> None:
        """Refuse to run a step whose schedule could not advance (a method with a schedule
        overrides it; nothing to refuse here).

        The hook state and the optimizer call it on the user's thread before a step's first
        bucket, so the error reaches the caller instead of an engine thread.
        """

    def follow_lr(self, lrs: dict[str, float]) -> None:
        """Express each named parameter's residual at its learning rate of this step (between
        steps).

        Dense SGD applies each step's gradient (velocity) at that step's learning rate; what
        waits in the residual is applied at the rate of the step that sends it. Rescaled by
        old / new whenever its rate changes, what waits keeps its update (rate x gradient): a
        warm-up does not apply a small-rate step's gradient at the large rate, and a decay
        does not shrink what waited. At density 1 nothing waits, so nothing changes. A rate
        of 0 expresses nothing: that residual keeps the last positive one.
        """
        factors = {}
        for name, lr in lrs.items():
            lr = float(lr)
            if not (lr > 0 and math.isfinite(lr)):
                continue
            old = self.residual_lr.get(name)
            if old is not None and old != lr:
                factors[name] = old / lr
            self.residual_lr[name] = lr
        if factors:
            self.memory.scale_names("residual", factors)

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Return this rank's state: residual/momentum by parameter name (unscaled), schedule,
        stats."""
        return {
            "method": self.name,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
            "memory": self.memory.state_dict(),
            "stats": self.stats.state_dict(),
            "residual_lr": dict(self.residual_lr),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore one rank's state saved by `state_dict` (same method; see checkpoint.py for
        resizes)."""
        if state.get("method") != self.name:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the checkpoint is for method "
                f"{state.get('method')!r}, "
                f"this compressor is {self.name!r}; build the state with the checkpoint's method"
            )
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: this shard was saved with world size "
                f"{state['world_size']}, "
                f"the group now has {self.world_size}; load the whole checkpoint through "
                "gradientflow.compression.checkpoint.shard_for_rank, which applies a resize policy"
            )
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
        self._epoch_told = True
        self.memory.load_state_dict(state["memory"])
        self.stats.load_state_dict(state["stats"])
        # absent in states saved before it was kept: the residual then follows from the next step
        self.residual_lr = {n: float(v) for n, v in (state.get("residual_lr") or {}).items()}


class QueuedBuffer:
    """One buffer queued in the engine for its compressor's fused batch; `prepare()` (the
    engine thread, while it waits for the batch to close) runs the compressor's local work
    ahead, once (CSC: v and the chunk norms)."""

    __slots__ = ("compressor", "flat", "layout", "loss_scale", "terms", "prepared", "_done")

    def __init__(self, compressor: Compressor, flat: torch.Tensor, layout: Layout,
                 loss_scale: float = 1.0, terms: SGDTerms | None = None) -> None:
        self.compressor, self.flat, self.layout = compressor, flat, layout
        self.loss_scale = loss_scale
        self.terms = terms  # the optimizer's settings of this step (momentum correction only)
        self.prepared = None
        self._done = False

    def prepare(self) -> None:
        if not self._done:
            self._done = True
            if self.terms is None:
                self.prepared = self.compressor.prepare(self.flat, self.layout, self.loss_scale)
            else:
                self.prepared = self.compressor.prepare(self.flat, self.layout, self.loss_scale,
                                                        self.terms)


def reduce_queued(parts: Sequence[QueuedBuffer], **kwargs) -> StageGen:
    """The StageGen of a fused batch of queued buffers of one compressor and loss scale: their
    local work (if not done ahead), then one `reduce_many` for all of them."""
    for p in parts:
        p.prepare()
    return (yield from parts[0].compressor.reduce_many(
        [p.flat for p in parts], [p.layout for p in parts], loss_scale=parts[0].loss_scale,
        prepared=[p.prepared for p in parts], **kwargs))
