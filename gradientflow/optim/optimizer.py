"""Horovod's DistributedOptimizer on GradientFlow: a thin wrapper over the gradient reducer.

    opt = gradientflow.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
    gradientflow.broadcast_parameters(model.state_dict(), root_rank=0)
    gradientflow.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The averaging itself (partitions, priority, compression) is the GradientReducer's (reducer.py),
which knows nothing of torch.optim. This wrapper decides when to wait: step() submits what
backward did not complete, waits only for what is still in flight, then runs the wrapped
optimizer's step. With overlap_next_forward=True it does not wait at all: the NextForwardOverlap
strategy (overlap.py) updates each partition's parameters just before the next forward uses them.

With a compressor that keeps a residual (CSC), each residual is kept in its group's learning-rate
units, read at every step. With one that applies momentum (CSC's momentum correction, an option),
the wrapped SGD's momentum and weight decay are applied by the compressor, read from the
parameter groups at every step (see compression/momentum.py); the wrapped step runs with them at
0. state_dict() carries this rank's residuals (and velocity), so a resume continues exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from gradientflow.compression import CompressionConfig, available, lookup
from gradientflow.compression import checkpoint as _ckpt
from gradientflow.compression.momentum import follow_optimizer
from gradientflow.optim.overlap import NextForwardOverlap
from gradientflow.optim.plan import Partition
from gradientflow.optim.gradient_reducer import GradientReducer, ReduceOp, ReducerOptions

__all__ = ["ReduceOp", "Average", "Sum", "DistributedOptimizer", "OptimizerOptions"]

_PREFIX = "gradientflow.DistributedOptimizer"
_STATE_KEY = "gradientflow"  # where state_dict() keeps this rank's compression state
# How a refused optimizer is kept as it is, in both APIs that reach this class.
_OFF = ("compression=CompressionConfig(method='csc', ..., momentum_correction=False) (with "
        "Horovod's API: compression=hvd.Compression.csc.configure(momentum_correction=False))")

Average = ReduceOp.Average
Sum = ReduceOp.Sum


@dataclass(frozen=True)
class OptimizerOptions(ReducerOptions):
    """The validated options of one DistributedOptimizer (fixed for its lifetime)."""

    overlap_next_forward: bool = False


def _resolve_compression(compression) -> CompressionConfig | None:
    if isinstance(compression, str):
        try:
            compression = CompressionConfig(method=lookup(compression).name)
        except ValueError:
            raise ValueError(f"{_PREFIX}: compression={compression!r} is not understood; pass "
                             f"None, one of {available()} or a "
                             "gradientflow.compression.CompressionConfig") from None
    if compression is None or isinstance(compression, CompressionConfig):
        if compression is not None and lookup(compression.method).dense:
            return None  # the dense path is the same average, without the float32-only limit
        return compression
    raise ValueError(f"{_PREFIX}: compression={compression!r} is not understood; pass None, "
                     f"one of {available()} or a gradientflow.compression.CompressionConfig")


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class (as Horovod does), so isinstance and LR
    schedulers keep working; see DistributedOptimizer for the arguments."""

    # Its step only wraps the wrapped class's (compression/momentum.py looks past it).
    _delegates_step = True

    def __init__(self, params, named_parameters, options: OptimizerOptions,
                 process_group) -> None:
        super().__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(all_params)]
        self._check_names(named, all_params)
        self._follower = None
        if options.compression is not None:
            # The compressor follows this SGD: its momentum and weight decay under momentum
            # correction, its learning rates (the residual's units) in any case.
            initialized = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank(process_group) if initialized else 0
            config, self._follower = follow_optimizer(
                options.compression, self, f"{_PREFIX} (rank {rank})", self._take_velocity,
                off=_OFF, step_hooks=False, follow_lr=self._follow_lr)
            options = dataclasses.replace(options, compression=config)
        self._opts = options
        # Frozen parameters never get a gradient: they are not part of the plan at all.
        in_opt = {id(p) for p in all_params}
        named = [(n, p) for n, p in named if p.requires_grad and id(p) in in_opt]
        self._reducer = GradientReducer(
            named, options, process_group, before_first_grad=self._before_first_grad,
            sgd_terms=None if self._follower is None else self._follower.terms)
        # (segment name, id of its parameter): what the compressor keeps residuals under, fixed
        # with the plan, read at every step (_follow_lr).
        self._segment_ids = [(seg.name, id(self._reducer.params[seg.index]))
                             for part in self._reducer.plan for seg in part.segments]
        self._overlap = None
        if options.overlap_next_forward:
            self._overlap = NextForwardOverlap(self._reducer, self._step_groups,
                                               lambda: self.param_groups)
        self._synchronized = False
        self._should_synchronize = True

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_names(named, all_params) -> None:
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"{_PREFIX}: named_parameters must be (name, parameter) pairs, "
                                 f"as model.named_parameters() yields; got {type(item).__name__}")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{_PREFIX}: parameter names {dups[:5]} appear more than once in "
                             "named_parameters; every parameter needs a unique name")
        named_ids = {id(p) for _, p in named}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"{_PREFIX}: named_parameters was given, but the optimizer's "
                             f"parameters at positions {unnamed[:8]} are not in it; pass "
                             "model.named_parameters() of the model whose parameters the "
                             "optimizer updates")

    # ------------------------------------------------------------------ the reducer's callbacks
    def _before_first_grad(self) -> None:
        self._finish_updates()  # a previous overlapped step's leftovers come first
        self._synchronized = False
        if self._follower is not None:
            self._follower.begin_step()  # the settings this step's gradients are reduced with

    def _follow_lr(self, lrs: dict[int, float]) -> None:
        """Hand the compressor each segment's learning rate ({id(parameter): rate}), by the
        segment names its residual is kept under."""
        self._reducer.compressor.follow_lr(
            {name: lrs[pid] for name, pid in self._segment_ids if pid in lrs})

    def _take_velocity(self, buffers: dict) -> None:
        """Put SGD momentum buffers ({parameter: buffer}, a dense run's) into the compressor's
        velocity, by segment name, in its buffers' units (the average is multiplied by the
        op's postscale)."""
        reducer = self._reducer
        post = reducer.postscale
        by_id = {id(p): buf for p, buf in buffers.items()}
        named = {seg.name: seg.view(by_id[id(reducer.params[seg.index])]) / post
                 for part in reducer.plan for seg in part.segments
                 if id(reducer.params[seg.index]) in by_id}
        reducer.compressor.import_velocity(named)

    def _step_groups(self, groups: list[dict]) -> None:
        full = self.param_groups
        try:
            self.param_groups = groups
            self._base_step(None)
        finally:
            self.param_groups = full

    # ------------------------------------------------------------------ step side
    def synchronize(self) -> None:
        """Wait until every gradient is averaged into p.grad (e.g. to clip it before step())."""
        self._finish_updates()
        self._reducer.submit_rest()
        self._reducer.wait_all()
        self._reducer.resparsify()
        self._reducer.reset_step()
        self._reducer.end_step()
        if self._overlap is not None:
            self._overlap.export_grads()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make step() use p.grad as it is (after synchronize()), without averaging again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average what is still in flight, then run the wrapped optimizer's step.

        With a closure (Horovod's contract): the closure is called first, once, with gradients
        enabled; it should zero the gradients, compute the loss and call backward(), which
        launches the averaging as usual. Then the step runs on the averaged gradients and the
        closure's loss is returned. Optimizers that re-evaluate the closure inside their step
        (LBFGS) are not supported: each evaluation would need its own averaging.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._follower is not None:
            # Every trainable parameter is in the plan: only the settings need checking.
            self._follower.check_step(strict=False)
        if not self._should_synchronize or self._synchronized:
            if self._should_synchronize:
                # Horovod's words lead the sentence: scripts and tests look for them.
                warnings.warn(f"{_PREFIX}: optimizer.step() called without "
                              "optimizer.skip_synchronize() after synchronize(): it steps on "
                              "the gradients synchronize() averaged; use `with "
                              "optimizer.skip_synchronize():` to say so", stacklevel=2)
            self._synchronized = False
            self._base_step(None)
            return loss
        if self._overlap is not None:
            self._finish_updates()
            self._reducer.submit_rest()
            self._overlap.defer()
            self._reducer.reset_step()
            return loss
        self.synchronize()
        self._synchronized = False
        self._base_step(None)
        return loss

    def _base_step(self, closure):
        # The wrapped class's own step, without the optimizer-hook wrapper a second time (our
        # class's step already runs the step hooks once).
        base = super().step
        fn = getattr(base, "__func__", None)
        with contextlib.ExitStack() as stack:
            if self._follower is not None:
                # The compressor applied the momentum and weight decay: 0 for this step.
                stack.enter_context(self._follower.stepping(self.param_groups))
            if fn is not None and getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
                return fn.__wrapped__(self, closure)
            return base(closure)

    def _finish_updates(self) -> None:
        if self._overlap is not None:
            self._overlap.finish()
        elif not self._reducer.futures:
            self._reducer.end_step()

    def finish_updates(self) -> None:
        """overlap_next_forward: apply every pending update now (before reading parameters
        outside a forward pass, e.g. to save or compare them)."""
        self._finish_updates()

    # ------------------------------------------------------------------ schedule
    def set_epoch(self, epoch: int) -> None:
        """Tell the compressor's warm-up the epoch (needed only with warmup_unit='epoch')."""
        if self._reducer.compressor is not None:
            self._reducer.compressor.set_epoch(epoch)

    # ------------------------------------------------------------------ misuse guards
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Refuse between backward() and step(): the gradients may still be in flight."""
        if self._reducer.seen_grads:
            raise RuntimeError(
                f"{_PREFIX}: optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited: the gradients "
                "are being averaged in the background and would be lost. Call zero_grad() "
                "before the forward pass, or after step()")
        if not set_to_none and self._overlap is not None:
            # Zeroing in place would reach gradients a partition still in flight reads from
            # (next-forward overlap): let those finish first. set_to_none=True needs no wait.
            self._overlap.wait_in_flight()
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """The wrapped optimizer's state dict, plus this rank's compression state.

        With a compressor, key "gradientflow" holds this rank's residuals and momentum by
        parameter name and the warm-up position: save one state_dict per rank (they differ),
        or gather_state_dict() for all of them in one file.
        """
        if self._overlap is not None and self._overlap.pending:
            self._finish_updates()
        sd = super().state_dict()
        if self._reducer.compressor is not None:
            sd[_STATE_KEY] = {"rank": self._reducer.rank,
                              **self._reducer.compressor.state_dict()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Load a state_dict (this rank's, or one with a full checkpoint from gather_state_dict).

        A compression state saved by another world size follows the "redistribute" policy
        (gradientflow.compression.checkpoint), with a warning.
        """
        state_dict = dict(state_dict)
        shard = state_dict.pop(_STATE_KEY, None)
        super().load_state_dict(state_dict)
        compressor = self._reducer.compressor
        if compressor is None:
            return
        if self._follower is not None:
            self._follower.take_buffers()  # a dense run's momentum (a shard, if any, wins)
        if shard is None:
            return
        me, world = self._reducer.rank, self._reducer.world_size
        if _ckpt.is_full_checkpoint(shard):
            shard = _ckpt.shard_for_rank(shard, me, world)
        elif int(shard.get("rank", me)) != me and int(shard["world_size"]) == world:
            raise ValueError(
                f"{_PREFIX}: rank {me}: this state_dict holds rank {shard['rank']}'s residuals; "
                "each rank loads the state_dict it saved itself (or the full checkpoint of "
                "gather_state_dict())")
        compressor.load_state_dict(shard)

    def gather_state_dict(self, dst: int = 0):
        """Collect every rank's state_dict compression shard on rank `dst` (a collective).

        Returns this rank's state_dict whose "gradientflow" entry holds every rank's shard
        (on `dst`; None elsewhere): one file any world size can resume from.
        """
        sd = self.state_dict()
        if _STATE_KEY not in sd:
            return sd
        full = _ckpt.gather_shards(sd[_STATE_KEY], self._reducer.process_group, dst)
        return None if full is None else {**sd, _STATE_KEY: full}

    def close(self) -> None:
        """Remove the gradient and forward hooks (the optimizer stays usable as a local one)."""
        self._finish_updates()
        self._reducer.close()
        if self._overlap is not None:
            self._overlap.close()

    @property
    def launch_log(self) -> list[int]:
        """The partition keys of the last step in issue order (the same on every rank)."""
        return list(self._reducer.launch_log)

    @property
    def plan(self) -> list[Partition]:
        """The partition plan (the same on every rank)."""
        return list(self._reducer.plan)

    @property
    def _compressor(self):
        """The reducer's compressor (None on the dense path)."""
        return self._reducer.compressor


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression=None, backward_passes_per_step: int = 1,
                         op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                         process_group=None, priority: bool = False,
                         partition_bytes: int = 25 << 20, overlap_next_forward: bool = False,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() applies gradients averaged over every rank (Horovod's API).

    Args:
        optimizer: any torch.optim optimizer; the result is an instance of its class (a
            subclass of it), with the same parameter groups and state.
        named_parameters: model.named_parameters(); names key compression state and errors.
        compression: None/"none" (dense), a registered method's name ("fp16", "csc", ...),
            or a CompressionConfig. CSC's default recipe leaves momentum and weight decay to
            the wrapped optimizer; with momentum_correction=True the compressor applies the
            wrapped SGD's, read from its groups at every step, so schedulers keep working, and
            other optimizers are refused.
        backward_passes_per_step: backward passes accumulated locally per step (summed, as
            Horovod and DDP's no_sync do; scale the loss yourself for a mean).
        op: gradientflow.Average (default) or gradientflow.Sum.
        gradient_predivide_factor: Average only: scale by 1/f before the sum and f/size after.
        process_group: the group to average over (default: the world group).
        priority: True launches, among the partitions one agreement round finds ready, the one
            the next forward needs first (TicTac); False (the default: no benchmark has shown
            it to pay, docs/DECISIONS.md) launches in backward order (FIFO), each partition an
            async allreduce routed as any other. Both are the same order on every rank. With
            compression the partitions travel fused, in backward order, whatever it says.
        partition_bytes: bytes per partition; larger parameters are cut into row blocks.
        overlap_next_forward: step() returns at once; each module's parameters are updated
            just before its next forward (call finish_updates() before reading them otherwise).
        sparse_as_dense: densify sparse gradients (else they are allgathered).

    After step(), p.grad is a view into a flat buffer that is reused the next step, as with
    DDP's gradient_as_bucket_view: clone it to keep it longer. A parameter no rank gave a
    gradient keeps grad None. optimizer.step(closure) calls the closure once (it runs
    backward), then steps on the averaged gradients.

    Example::

        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            named_parameters=model.named_parameters())
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_PREFIX}: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"{_PREFIX}: this optimizer is already distributed; wrap the "
                         "original optimizer once")
    options = OptimizerOptions(
        compression=_resolve_compression(compression),
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, priority=bool(priority),
        partition_bytes=partition_bytes, sparse_as_dense=bool(sparse_as_dense),
        overlap_next_forward=bool(overlap_next_forward))
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizer, base),
               {"__module__": __name__, "_delegates_step": True})
    groups = [dict(g) for g in optimizer.param_groups]
    opt = cls(groups, named_parameters, options, process_group)
    opt.defaults = dict(optimizer.defaults)
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt
