"""The state shared by GradientFlow's DDP compression hooks, and how a hook submits its stages.

Private: the public state classes (CSCState, FP16State) live beside their hooks.
"""
# No `from __future__ import annotations`: DDP compares the hook's return annotation to the real
# torch.futures.Future[torch.Tensor] object, and a string would not match.

import dataclasses
import itertools
from typing import Iterable

import torch
import torch.distributed as dist

from ..compression import (CompressionConfig, Compressor, Layout, QueuedBuffer, make_compressor,
                           queue_name, reduce_queued)
from ..compression import checkpoint as _ckpt
from ..backend.api import submit_part
from ..compression.adaptive import check_adaptive
from ..compression.momentum import follow_optimizer, guard_momentum
from ..engine.stages import StageGen

__all__ = ["CompressionState", "compression_hook"]

_uid = itertools.count()


def group_config(process_group):
    """Return the gradientflow Config `process_group` was created with.

    A group of another backend (gloo, nccl) carries none: it gets the options of
    `gradientflow.configure()` and the environment, resolved by config.py as for a new group.
    """
    from ..backend.registry import config_of
    from ..config import Config, current_overrides

    config = config_of(process_group)
    return config if config is not None else Config.resolve(current_overrides())


def _share_cores(process_group, world_size: int) -> None:
    """Give the compression kernels this rank's share of the host's cores
    (config.kernel_threads)."""
    from .. import kernels
    from ..config import kernel_threads

    kernels.set_num_threads(kernel_threads(group_config(process_group), world_size))


class CompressionState:
    """Hold what a compression hook needs across steps: the compressor, parameter names, loss scale.

    Args:
        process_group: the group to average over (None: the default group).
        config: a CompressionConfig; or leave it None and pass its fields as keyword arguments.
        grad_scaler: a GradScaler whose current scale the gradients carry (optional; see
            `set_loss_scale` for the alternative). Residuals are rescaled when it changes.
        optimizer: the torch.optim.SGD that steps these parameters; the residuals follow its
            learning rates. Under momentum correction (an option) the compressor applies its
            momentum and weight decay, read from its parameter groups at every step
            (schedulers and load_state_dict keep working); its own step runs with them at 0.
            Under momentum correction without it, an optimizer step that would apply momentum
            or weight decay after the compressor raises.
        world_size, rank: override the group's (to simulate ranks in one process; default: the
        group's).
        **kwargs: CompressionConfig fields (only without `config`).

    Example::

        >>> state = CompressionState(None, CompressionConfig(method="csc", density=0.01))
        >>> state.bind_parameter_names(model)          # names make checkpoints survive restarts
        >>> ddp.register_comm_hook(state, compression_hook)
    """

    _method: str | None = None  # a subclass fixes the method (CSCState: "csc")

    def __init__(
        self,
        process_group=None,
        config: CompressionConfig | None = None,
        *,
        grad_scaler=None,
        optimizer=None,
        world_size: int | None = None,
        rank: int | None = None,
        **kwargs,
    ) -> None:
        if config is not None and kwargs:
            raise ValueError(
                f"{type(self).__name__}: pass either config or its fields {sorted(kwargs)}, not "
                "both"
            )
        if config is None:
            if self._method is not None:
                kwargs.setdefault("method", self._method)
            config = CompressionConfig(**kwargs)  # validates: ValueError naming the range
        if not isinstance(config, CompressionConfig):
            raise TypeError(
                f"{type(self).__name__}: config must be a CompressionConfig, got "
                f"{type(config).__name__}"
            )
        if self._method is not None and config.method != self._method:
            raise ValueError(
                f"{type(self).__name__}: config.method={config.method!r} but this state is for "
                f"{self._method!r}"
            )
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = (
            world_size
            if world_size is not None
            else (dist.get_world_size(process_group) if initialized else 1)
        )
        self.rank = (
            rank if rank is not None else (dist.get_rank(process_group) if initialized else 0)
        )
        # The optimizer's SGD settings, followed at every step: its learning rates (the
        # residual's units), and its momentum and weight decay under momentum correction.
        self._follower = None
        if optimizer is not None:
            config, self._follower = follow_optimizer(
                config, optimizer, f"{type(self).__name__} (rank {self.rank})",
                self._take_velocity, follow_lr=self._follow_lr)
            # After the momentum checks: their refusal names the more specific fix.
            check_adaptive(config, optimizer, f"{type(self).__name__} (rank {self.rank})")
        # --- tuned by the user ---
        self.process_group = process_group
        self.config = config
        self.grad_scaler = grad_scaler
        # --- internal ---
        _share_cores(process_group, self.world_size)
        self.compressor: Compressor = make_compressor(config, self.world_size)
        self._uid = next(_uid)
        self._op_name = queue_name(config)
        self._names: dict[int, str] = {}  # id(parameter) -> name
        self._auto_names = 0  # first-appearance names when none were bound
        self._layouts: dict[tuple, Layout] = {}
        self._loss_scale = 1.0
        self._step_open = False
        # Without the optimizer, refuse its first step if it would apply momentum a second time.
        self._took_momentum = optimizer is not None
        self._guard_momentum()

    def _guard_momentum(self) -> None:
        """Without the optimizer, refuse its first step if it would apply momentum a second time."""
        self._guard = None if self._took_momentum else guard_momentum(
            self, _compressed_ids, self.config, type(self).__name__)

    def _follow_lr(self, lrs: dict[int, float]) -> None:
        """Hand the compressor each named parameter's learning rate ({id(parameter): rate});
        a parameter not named yet has no residual yet."""
        names = self._names
        self.compressor.follow_lr({names[i]: lr for i, lr in lrs.items() if i in names})

    def _take_velocity(self, buffers: dict) -> None:
        """Put SGD momentum buffers ({parameter: buffer}, a dense checkpoint's) into the
        compressor's velocity, by parameter name."""
        named = {}
        for p, buf in buffers.items():
            name = self._names.get(id(p))
            if name is None:
                raise ValueError(
                    f"{type(self).__name__} (rank {self.rank}): the optimizer holds a momentum "
                    f"buffer for a parameter of shape {tuple(p.shape)} that has no name here; "
                    "the compressor keeps velocity by parameter name: call "
                    "state.bind_parameter_names(model) (gradientflow.hooks.register does) "
                    "before the first step")
            named[name] = buf
        self.compressor.import_velocity(named)

    # --- parameter names --------------------------------------------------------------------------
    def bind_parameter_names(
        self, named: "torch.nn.Module | Iterable[tuple[str, torch.Tensor]]"
    ) -> None:
        """Name the parameters (a module, or (name, tensor) pairs) so residuals are keyed by name.

        Without it, parameters are named "param<i>" by first appearance in the hook, which is the
        same across restarts only if the model and DDP's bucket size are the same.
        """
        pairs = list(named.named_parameters() if isinstance(named, torch.nn.Module) else named)
        for name, p in pairs:
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(
                    f"{type(self).__name__}: parameter {name!r} is {p.dtype}; gradient compression "
                    "needs float32 gradients (keep FP32 master parameters under autocast, or "
                    "leave this model uncompressed)"
                )
        self._names = {id(p): name for name, p in pairs}
        self._layouts.clear()

    def _name(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            name = self._names[id(p)] = f"param{self._auto_names}"
            self._auto_names += 1
        return name

    def layout_of(self, bucket) -> Layout:
        """Return the Layout of a DDP GradBucket (parameters back to back, by name)."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout.from_shapes(
                (self._name(p), tuple(p.shape)) for p in params
            )
        buf = bucket.buffer()
        if layout.numel != buf.numel():
            raise ValueError(
                f"{type(self).__name__}: bucket {bucket.index()} has {buf.numel()} elements but "
                "its "
                f"{len(params)} parameters add up to {layout.numel}; sparse or padded buckets are "
                "not supported"
            )
        return layout

    # --- schedule and loss scale ------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell the warm-up schedule the epoch (call at the start of every epoch)."""
        self.compressor.set_epoch(epoch)

    def set_step(self, step: int) -> None:
        """Set the step counter of a step-based warm-up (it otherwise counts completed backward
        passes)."""
        self.compressor.set_step(step)

    def set_loss_scale(self, scale: float) -> None:
        """Tell the state the loss scale of the gradients to come (instead of giving a
        grad_scaler)."""
        if not (scale > 0 and torch.isfinite(torch.tensor(float(scale)))):
            raise ValueError(
                f"{type(self).__name__}.set_loss_scale: scale={scale!r} must be a finite number > 0"
            )
        self._loss_scale = float(scale)

    def _current_loss_scale(self) -> float:
        s = self.grad_scaler
        if s is not None and s.is_enabled():
            return float(s.get_scale())
        return self._loss_scale

    # --- the op -----------------------------------------------------------------------------------
    def _part(self, bucket) -> "_BucketPart":
        """What the engine's batch takes for one bucket (its buffer, layout, whether it is the
        step's last, the loss scale).

        Checked here, on the caller's thread, so errors reach the caller, not the engine's.
        """
        if not self._step_open:
            self.compressor.check_schedule()
            if self._follower is not None:
                self._follower.begin_step()
            self._step_open = True
            # one read per step: get_scale() syncs on CUDA
            self._step_scale = self._current_loss_scale()
        layout = self.layout_of(bucket)
        layout.check(bucket.buffer(), f"{type(self).__name__} (bucket {bucket.index()})")
        terms = None
        if self._follower is not None:
            # The buffer is in loss-scaled units: so is the weight decay added to it.
            params = bucket.parameters()
            terms = self._follower.terms(zip(params, params), self._step_scale)
        return _BucketPart(self.compressor, bucket.buffer(), layout, bucket.is_last(),
                           self._step_scale, terms)

    def _fuse(self, parts: list) -> StageGen:
        """The StageGen of a fused batch of this state's buckets (the engine's fuser): one
        compressor op for all of them; closes the step after the step's last bucket."""
        results = yield from reduce_queued(parts, final=True)
        if any(p.last for p in parts):
            self.compressor.end_step()
            self._step_open = False
        return results

    def _stages(self, bucket) -> StageGen:
        """The StageGen of one bucket alone (a batch of one), returning its result."""
        return _only(self._fuse([self._part(bucket)]))

    # --- checkpoints and statistics ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """Return this rank's shard: residual/momentum by parameter name, schedule, statistics."""
        return {
            "rank": self.rank,
            "config": self.config.as_dict(),
            **self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict, resize_policy: str = "redistribute") -> None:
        """Load this rank's shard, or pick it from a full checkpoint (every rank's shards, see
        gather_state_dict).

        A full checkpoint saved by another world size follows `resize_policy`
        ("redistribute" | "reset" | "error", see gradientflow.compression.checkpoint), with a
        warning.
        """
        if _ckpt.is_full_checkpoint(state):
            state = _ckpt.shard_for_rank(state, self.rank, self.world_size, resize_policy)
        self.compressor.load_state_dict(state)

    def gather_state_dict(self, dst: int = 0) -> dict | None:
        """Collect every rank's shard on rank `dst` (a collective: call it on every rank)."""
        return _ckpt.gather_shards(
            self.state_dict(), self.process_group if dist.is_initialized() else None, dst
        )

    def stats(self) -> dict:
        """Return the wire statistics (see gradientflow.compression.stats for the definitions)."""
        return self.compressor.stats.as_dict()

    # --- autotune: a new chunk size between steps ---------------------------------------------
    def set_chunk_size(self, chunk_size: int) -> None:
        """Use `chunk_size` from the next step on, keeping every residual and velocity.

        Call between steps, at the same step on every rank (gradientflow.autotune does, after
        its agreed exchange and a drain of the engine); raises RuntimeError while a step's
        buckets are being reduced. The compressor is rebuilt for the new size and handed the old
        one's state (state_dict): residual and momentum are kept per parameter name and element,
        never per chunk, so they carry over whole and no gradient mass is lost; plans that
        depend on the chunk size are built again at the next step.
        """
        if self._step_open:
            raise RuntimeError(
                f"{type(self).__name__}.set_chunk_size: a step is being reduced; change the "
                "chunk size between steps (after the optimizer step, with no bucket in flight)")
        config = dataclasses.replace(self.config, chunk_size=chunk_size)  # validates it
        if config == self.config:
            return
        compressor = make_compressor(config, self.world_size)
        compressor.load_state_dict(self.compressor.state_dict())
        self.config, self.compressor = config, compressor
        self._op_name = queue_name(config)  # a rank left on the old size must mismatch

    def __getstate__(self) -> dict:
        # A process group cannot be pickled, and parameter ids mean nothing in another process.
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("process_group", "grad_scaler", "_names", "_layouts", "_guard",
                              "_follower")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self.grad_scaler = None
        self._names = {}
        self._layouts = {}
        self._follower = None  # the optimizer stays in the process that bound it
        self._guard_momentum()


class _BucketPart(QueuedBuffer):
    """One DDP bucket queued in the engine, and whether it is the step's last."""

    __slots__ = ("last",)

    def __init__(self, compressor: Compressor, flat: torch.Tensor, layout: Layout, last: bool,
                 loss_scale: float, terms=None) -> None:
        super().__init__(compressor, flat, layout, loss_scale, terms)
        self.last = last


def _only(gen: StageGen) -> StageGen:
    results = yield from gen
    return results[0]


def _compressed_ids(state: CompressionState) -> set[int]:
    return set(state._names)


def compression_hook(state: CompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket with the state's compressor; return a Future of the averaged buffer.

    Example::

        >>> state = CompressionState(None, CompressionConfig(method="fp16"))
        >>> ddp.register_comm_hook(state, compression_hook)
    """
    buf = bucket.buffer()
    # Buckets queued together are fused into one compressor op by the engine (up to the fusion
    # threshold in dense bytes); the step's last bucket closes the batch, or every bucket where
    # the compressor does not fuse them (Compressor.fuses_buckets).
    close = bucket.is_last() or not state.compressor.fuses_buckets
    return submit_part(state.process_group, ("ddp", state._uid, bucket.index()),
                       state._part(bucket), state._fuse, device=buf.device, name=state._op_name,
                       dense_bytes=buf.numel() * 4, close=close)
