"""SGD applied once: under momentum correction the compressor follows the optimizer's momentum.

DGC's momentum correction accumulates the velocity in the compressor, before sparsification, so
the optimizer must step without momentum; and weight decay must enter the gradient before that
velocity, as SGD adds it before its own momentum. Two cases:

- `follow_optimizer(config, optimizer, where)`: the optimizer is known (the DistributedOptimizer
  always, a hook when registered with `optimizer=`). Its parameter groups keep the user's
  settings, so schedulers, `load_state_dict` and logging read and write them as usual. An
  `SGDFollower` reads them at each step's first gradient (`begin_step`), hands the compressor
  one `SGDTerms` per buffer (momentum, Nesterov, weight decay times the parameter), and sets
  momentum and weight decay to 0 only while the optimizer's own step runs, so neither is
  applied twice. Momentum buffers found in the optimizer's state (a dense checkpoint) move
  into the compressor's velocity.
- `guard_momentum(...)`: the optimizer is not known (a hook state built without one): the first
  step of an optimizer that would apply momentum or weight decay to a compressed parameter, or
  that is not SGD, raises, saying what to change.

Only torch.optim.SGD's own step is followed (dampening 0, one momentum for every group): what
the compressor cannot reproduce is refused at registration or at the step, with the fix.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .config import CompressionConfig
from .registry import lookup
from .sgd import SGDTerms

__all__ = ["SGDFollower", "LRFollower", "follow_optimizer", "check_optimizer", "guard_momentum"]

# What to pass to keep the optimizer as it is (the caller may name its own spelling).
OFF = "CompressionConfig(..., momentum_correction=False)"
# The group settings the compressor applies in the optimizer's place during its step.
_TAKEN = {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}
# Set on an optimizer to the follower its step hooks belong to (a later binding replaces it).
_BOUND = "_gradientflow_follower"


def _applies(config: CompressionConfig) -> bool:
    return lookup(config.method).compressor.applies_momentum(config)


def _sgd_step():
    return inspect.unwrap(vars(torch.optim.SGD)["step"])


def _steps_as_sgd(optimizer) -> bool:
    """Whether `optimizer.step` is torch.optim.SGD's own (past classes marked
    `_delegates_step`, which only wrap it: the DistributedOptimizer)."""
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls) and not vars(cls).get("_delegates_step", False):
            return inspect.unwrap(vars(cls)["step"]) is _sgd_step()
    return False


@dataclass(frozen=True)
class _Settings:
    """An SGD's settings at one moment: the momentum every group shares, and weight decay."""

    momentum: float
    nesterov: bool
    decay: dict  # id(parameter) -> weight decay, negated under maximize=True

    def differences(self, other: "_Settings") -> str:
        out = []
        if (self.momentum, self.nesterov) != (other.momentum, other.nesterov):
            out.append(f"momentum {self.momentum} -> {other.momentum}"
                       + (f", nesterov {self.nesterov} -> {other.nesterov}"
                          if self.nesterov != other.nesterov else ""))
        if self.decay != other.decay:
            out.append("weight decay")
        return "; ".join(out)


def _read(optimizer, where: str, off: str) -> _Settings:
    """The optimizer's settings now; ValueError naming the fix for any the compressor cannot
    apply (only groups with a trainable parameter count)."""
    name = type(optimizer).__name__
    groups = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    found = sorted({(float(g["momentum"]), bool(g["nesterov"])) for g in groups})
    if len(found) > 1:
        raise ValueError(
            f"{where}: the parameter groups of {name} have different (momentum, nesterov) "
            f"settings {found}; momentum correction applies one momentum to every parameter: "
            "give every group the same (a scheduler must change them alike), or pass " + off)
    m, nesterov = found[0] if found else (0.0, False)
    for g in groups:
        if m and float(g.get("dampening", 0.0)) != 0.0:
            raise ValueError(
                f"{where}: {name} has dampening={g['dampening']}; momentum correction "
                f"implements undampened momentum: use dampening=0, or pass {off}")
    if nesterov and m <= 0.0:
        raise ValueError(f"{where}: {name} has nesterov=True with momentum {m}; Nesterov "
                         "momentum needs a momentum > 0 (torch.optim.SGD refuses it too): keep "
                         "the momentum above 0, or set nesterov=False with it")
    decay = {}
    for g in groups:
        wd = float(g["weight_decay"])
        if wd:
            sign = -1.0 if g.get("maximize", False) else 1.0
            for p in g["params"]:
                decay[id(p)] = sign * wd
    return _Settings(m, nesterov, decay)


def check_optimizer(config: CompressionConfig, optimizer, where: str, off: str = OFF):
    """Refuse, naming the fix, an optimizer whose momentum `config`'s compressor cannot take over.

    Returns the optimizer's settings now (None when the method applies no momentum).
    """
    if not _applies(config):
        return None
    name = type(optimizer).__name__
    if not _steps_as_sgd(optimizer):
        raise ValueError(
            f"{where}: momentum correction (when on) applies SGD's momentum and weight "
            f"decay inside the compressor, and {name} does not step as torch.optim.SGD does "
            f"(another optimizer, or a subclass with its own step); pass {off} to keep the "
            "optimizer as it is, or use torch.optim.SGD")
    settings = _read(optimizer, where, off)
    if config.momentum is not None and float(config.momentum) != settings.momentum:
        raise ValueError(
            f"{where}: CompressionConfig(momentum={config.momentum}) but {name} has "
            f"momentum={settings.momentum}; the compressor follows the optimizer's momentum: "
            "leave the config's momentum unset (None), or give both the same value")
    return settings


class SGDFollower:
    """Follow one torch.optim.SGD's momentum and weight decay at every step, for a compressor.

    Args:
        optimizer: the SGD whose groups are read (check_optimizer accepted it).
        where: who is asking, for errors (e.g. "CSCState (rank 0)").
        take_velocity: called with {parameter: momentum buffer} found in the optimizer's state
            (a dense checkpoint); it puts them into the compressor's velocity.
        follow_lr: called at each step's first gradient with {id(parameter): its group's
            learning rate}, so the compressor keeps each residual in its rate's units
            (Compressor.follow_lr).
        off: how the caller turns momentum correction off, for errors.

    The owner calls `begin_step()` at each step's first gradient, `terms(...)` for each buffer,
    `check_step()` when the optimizer's step begins and runs that step inside `stepping(groups)`
    (or `install_step_hooks()` does the last two around every `optimizer.step()`).
    """

    def __init__(self, optimizer, where: str,
                 take_velocity: Callable[[dict], None], off: str = OFF,
                 follow_lr: Callable[[dict[int, float]], None] | None = None) -> None:
        self.optimizer = optimizer
        self.where = where
        self.off = off
        self._take_velocity = take_velocity
        self._follow_lr = follow_lr
        self._settings: _Settings | None = None  # what the compressor applies this step
        self._stepped = False  # the optimizer stepped since the settings were read
        self._reduced: set[int] = set()  # parameters whose gradients it reduced this step
        self._held: list[tuple[dict, dict]] = []  # groups' settings set aside during a step
        self._look_for_buffers = True
        self._handles: list = []
        self._replaced = False

    # --- the compressor's side ------------------------------------------------------------
    def begin_step(self) -> None:
        """Read the optimizer's settings for the step whose gradients now arrive (and take over
        momentum buffers a loaded checkpoint put into its state)."""
        if self._replaced:
            raise RuntimeError(
                f"{self.where}: {type(self.optimizer).__name__} was bound to another "
                "compression state since this one: one optimizer follows one hook state (build "
                "an optimizer per DDP model)")
        self._restore()
        if self._look_for_buffers:
            self.take_buffers()
        self._settings = _read(self.optimizer, self.where, self.off)
        self._stepped = False
        if self._follow_lr is not None:
            self._follow_lr(_rates(self.optimizer))
        self._reduced = set()

    def terms(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
              scale: float = 1.0) -> SGDTerms:
        """The SGDTerms of one buffer holding `pairs` (parameter, its slice in the buffer)
        back to back; `scale`: the buffer's units per gradient unit (the loss scale)."""
        s = self._settings
        decay, off = [], 0
        for p, part in pairs:
            n = part.numel()
            wd = s.decay.get(id(p), 0.0)
            if wd:
                decay.append((off, off + n, part.detach(), wd * scale))
            self._reduced.add(id(p))
            off += n
        return SGDTerms(s.momentum, s.nesterov, tuple(decay))

    def take_buffers(self) -> None:
        """Move the optimizer's momentum buffers (a dense run's) into the compressor (as
        copies: the buffers leave the optimizer's state)."""
        self._look_for_buffers = False
        state = self.optimizer.state
        found = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                buf = (state.get(p) or {}).get("momentum_buffer")
                if buf is not None:
                    # Under maximize SGD's buffer holds the negated gradient; ours does not.
                    found[p] = -buf if g.get("maximize", False) else buf
        if found:
            self._take_velocity(found)
            for p in found:
                del state[p]["momentum_buffer"]

    # --- the optimizer's side ---------------------------------------------------------------
    def check_step(self, strict: bool = True) -> None:
        """Refuse an optimizer step the compressor did not prepare for (call as it begins):
        one whose settings changed since backward.

        strict: also refuse a step with no backward through the compressor since the last, and
        a parameter with a gradient and momentum or weight decay that no buffer of this step
        held (a DDP hook's case; the DistributedOptimizer reduces every parameter it steps and
        refuses a step without backward itself).
        """
        self._restore()
        used = None if self._stepped else self._settings
        self._stepped = True
        now = _read(self.optimizer, self.where, self.off)
        name = type(self.optimizer).__name__
        if used is None:
            if strict and (now.momentum or now.decay):
                raise RuntimeError(
                    f"{self.where}: {name}.step() runs on gradients the compressor did not "
                    "reduce (no backward through it since the last step); momentum correction "
                    "applies the optimizer's momentum and weight decay in the compressor, so "
                    "every step must follow a backward through the compressed model")
            return
        if now != used:
            raise RuntimeError(
                f"{self.where}: {name}'s settings changed between backward() and step() "
                f"({used.differences(now)}); the compressor applied those in force during "
                "backward. Change them after optimizer.step() (call scheduler.step() after "
                "optimizer.step(), as torch documents)")
        if strict:
            for i, g in enumerate(self.optimizer.param_groups):
                if not (now.momentum or float(g["weight_decay"])):
                    continue
                for p in g["params"]:
                    if p.grad is not None and id(p) not in self._reduced:
                        raise RuntimeError(
                            f"{self.where}: a parameter of shape {tuple(p.shape)} in group {i} "
                            f"of {name} has a gradient the compressor did not reduce, and "
                            "the step would drop its momentum and weight decay (applied in the "
                            "compressor): give it an optimizer of its own")

    def set_aside(self, groups: list[dict]) -> None:
        """Set momentum and weight decay to 0 in `groups` (restored by `_restore`)."""
        for g in groups:
            self._held.append((g, {k: g[k] for k in _TAKEN}))
            g.update(_TAKEN)

    @contextlib.contextmanager
    def stepping(self, groups: list[dict]):
        """Run the optimizer's step with the settings the compressor applied set to 0."""
        self.set_aside(groups)
        try:
            yield
        finally:
            self._restore()

    def _restore(self) -> None:
        while self._held:
            g, saved = self._held.pop()
            g.update(saved)

    def install_step_hooks(self) -> None:
        """Check and set aside around every `optimizer.step()`; take over the momentum buffers
        a `load_state_dict` brings. Replaces an earlier follower's hooks."""
        opt = self.optimizer
        old = getattr(opt, _BOUND, None)
        old = old() if old is not None else None
        if old is not None:
            old.remove_hooks()
            old._replaced = True
        ref = weakref.ref(self)

        def pre(optimizer, args, kwargs):
            me = ref()
            if me is not None:
                me.check_step()
                me.set_aside(optimizer.param_groups)

        def post(optimizer, args, kwargs):
            me = ref()
            if me is not None:
                me._restore()

        def loaded(optimizer):
            me = ref()
            if me is not None:
                # Now, not at the next step: the loaded tensors may be shared with another
                # optimizer that changes them in place meanwhile.
                me.take_buffers()

        def saving(optimizer):
            me = ref()
            if me is not None:
                me._restore()

        self._handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post),
                         opt.register_load_state_dict_post_hook(loaded),
                         opt.register_state_dict_pre_hook(saving)]
        setattr(opt, _BOUND, ref)
        weakref.finalize(self, _remove, list(self._handles))

    def remove_hooks(self) -> None:
        """Remove the step hooks (the groups keep the user's settings)."""
        self._restore()
        _remove(self._handles)
        self._handles = []


def _rates(optimizer) -> dict[int, float]:
    """{id(parameter): its group's learning rate now}, what a follower's `follow_lr` takes."""
    return {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


class LRFollower:
    """Follow only an optimizer's learning rates, for a compressor that keeps a residual while
    the optimizer keeps its momentum and weight decay (momentum correction off).

    The residual is still applied at the rate of the step that sends it, so it is kept in its
    rate's units (Compressor.follow_lr) exactly as under momentum correction; the optimizer's
    own step is left as it is. It offers SGDFollower's interface, its other parts doing nothing.
    """

    def __init__(self, optimizer, follow_lr: Callable[[dict[int, float]], None]) -> None:
        self.optimizer = optimizer
        self._follow_lr = follow_lr

    def begin_step(self) -> None:
        """Hand the compressor each parameter's rate for the step whose gradients now arrive."""
        self._follow_lr(_rates(self.optimizer))

    def terms(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
              scale: float = 1.0) -> None:
        """None: the optimizer applies its momentum and weight decay itself."""
        return None

    def check_step(self, strict: bool = True) -> None:
        """Nothing to check: the optimizer's step runs as the user set it."""

    def stepping(self, groups) -> contextlib.AbstractContextManager:
        """The optimizer's step with its groups untouched."""
        return contextlib.nullcontext()

    def take_buffers(self) -> None:
        """Momentum buffers stay in the optimizer's state, where its step reads them."""

    def install_step_hooks(self) -> None:
        """No step hooks: nothing is taken from the optimizer's step."""


def follow_optimizer(config: CompressionConfig, optimizer, where: str,
                     take_velocity: Callable[[dict], None], *, off: str = OFF,
                     step_hooks: bool = True,
                     follow_lr: Callable[[dict[int, float]], None] | None = None
                     ) -> tuple[CompressionConfig, SGDFollower | LRFollower | None]:
    """Bind `optimizer` to the compressor `config` builds; return the config and the follower.

    Without momentum correction in `config`'s method nothing is taken: the follower is an
    LRFollower (with `follow_lr`, error feedback and an optimizer that steps as SGD: only its
    learning rates are followed) or None. An optimizer with momentum 0 in every group gets the
    same: momentum correction is turned off and the optimizer keeps its settings (plain error
    feedback). Otherwise `config` records the momentum at registration, and the SGDFollower
    reads it again at every step. Raises ValueError (check_optimizer) for what the compressor
    cannot reproduce.
    """
    settings = check_optimizer(config, optimizer, where, off)
    # Without momentum correction the optimizer steps as it is; a residual still follows its
    # learning rates (LRFollower).
    plain = None
    if follow_lr is not None and config.error_feedback and _steps_as_sgd(optimizer):
        plain = LRFollower(optimizer, follow_lr)
    if settings is None:
        return config, plain
    if settings.momentum == 0.0:
        # Nothing to follow: momentum 0 is plain error feedback, the optimizer steps as it is.
        return dataclasses.replace(config, momentum=0.0, nesterov=False,
                                   momentum_correction=False), plain
    config = dataclasses.replace(config, momentum=settings.momentum, nesterov=settings.nesterov)
    follower = SGDFollower(optimizer, where, take_velocity, off, follow_lr)
    if step_hooks:
        follower.install_step_hooks()
    return config, follower


def guard_momentum(owner, params: Callable[[object], set[int]], config: CompressionConfig,
                   where: str):
    """Raise at any optimizer step that would apply momentum or weight decay to a parameter
    `owner` compresses, or that is not SGD.

    `params(owner)` returns the ids of the compressed parameters (read at each step: a hook
    learns them from its buckets); it must not hold `owner` itself, which the guard only
    references weakly and outlives by nothing. Returns the hook's handle, or
    None when `config`'s method applies no momentum.
    """
    if not _applies(config):
        return None
    ref = weakref.ref(owner)

    def check(optimizer, args, kwargs):
        me = ref()
        if me is None:
            return None
        ids = params(me)
        name = type(optimizer).__name__
        for g in optimizer.param_groups:
            if not any(id(p) in ids for p in g["params"]):
                continue
            what = None
            if not _steps_as_sgd(optimizer):
                what = f"{name} would step on the velocity"
            elif float(g.get("momentum", 0.0) or 0.0) > 0:
                what = f"{name} would apply momentum={g['momentum']} again"
            elif float(g.get("weight_decay", 0.0) or 0.0) != 0:
                what = (f"{name} would add weight_decay={g['weight_decay']} after the "
                        "velocity, not before it as SGD does")
            if what is not None:
                raise RuntimeError(
                    f"{where}: momentum correction (when on) applies momentum "
                    f"{config.momentum_value} in the compressor, and {what}. Pass the "
                    "optimizer when registering (gradientflow.hooks.register(ddp, config, "
                    "optimizer=opt) or the state's optimizer= argument): an SGD's momentum "
                    "and weight decay are then applied by the compressor, step by step. Or "
                    "pass momentum_correction=False.")
        return None

    handle = register_optimizer_step_pre_hook(check)
    weakref.finalize(owner, handle.remove)
    return handle
