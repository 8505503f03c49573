"""The tuner: trials measured on every rank, decided on rank 0, applied by all at one step.

Protocol (every rank, the same calls in the same order, on the thread that issues the group's
collectives): `step()` marks the end of a training step. Between trial boundaries it only reads
the clock. Every `warmup + steps` steps (the same count on every rank, so the same step) the
ranks exchange two rows by all_gather on the group itself:

1. REPORT: each rank's score of the trial (block_score of its step times, warm-up steps
   discarded), with checks
   (marker, phase, trial number, the CRC of the tuner's settings). A row that differs raises
   AutotuneMismatch on every rank, naming what each rank holds (cross_rank.disagreement),
   since every rank sees every row.
2. DECIDE: rank 0 scores the trial (the slowest rank's score), tells the study, and puts the
   next trial's settings in its row; every rank reads rank 0's row.

An all_gather is an ordered collective like any other: it takes the same sequence number on
every rank, behind the step's allreduces. Each rank then drains its engine (everything issued
before is finished, so no batch or message straddles two configurations) and swaps its config
(GradientFlowBackend.reconfigure) before its next collective. So every rank routes, fuses and
cuts from the same op on with the same values, and no gradient is touched by the swap.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Sequence

import torch
from torch._C._distributed_c10d import AllgatherOptions

from gradientflow.autotune import space
from gradientflow.autotune.search import Search
from gradientflow.config import read_config_file, write_config_file
from gradientflow.cross_rank import disagreement
from gradientflow.errors import AutotuneMismatch

log = logging.getLogger("gradientflow.autotune")

MAGIC = 271828.0  # first word of every row: a row from anything else is a mismatch
REPORT, DECIDE = 1.0, 2.0
FAILED = -1.0  # rank 0's done flag when its search raised
_HEAD = 5  # MAGIC, phase, trial, settings id, value (a score, or rank 0's done flag)


class Tuner:
    """Autotune of one process group's engine settings (see the module doc and AUTOTUNE.md).

    `group`: the process group (None: the default one). Unset arguments come from the
    group's Config (GRADIENTFLOW_AUTOTUNE_*). `params`: the settings to tune (default
    space.DEFAULT_PARAMS, plus `chunk_size` when `compression` is given and `algorithm` where
    the topology offers a choice). `compression`: a DDP hook state (CSCState) whose chunk size
    is tuned through its `set_chunk_size`. `confirm`: race rounds after the search, in which
    the `finalists` best searched settings and the defaults are measured side by side (the
    best of many noisy medians is optimistic); the choice and the gain come from those rounds.
    Call `step()` once per training step on every rank (after optimizer.step()), or use
    `enable(..., hook=True)`.
    """

    def __init__(self, group: Any = None, *, params: Sequence[Any] | None = None,
                 trials: int | None = None, steps: int | None = None,
                 warmup: int | None = None, seed: int | None = None,
                 sampler: str | None = None, log_path: str | None = None,
                 out: str | None = None, confirm: int = 2, finalists: int = 2,
                 compression: Any = None, backend: Any = None) -> None:
        if backend is None:
            from gradientflow.backend.registry import backend_of

            backend = backend_of(group)
            if backend is None:
                raise ValueError("autotune: the process group does not use the gradientflow "
                                 "backend (init_process_group(backend='gradientflow'))")
        self._backend = backend
        cfg = backend.config
        self.rank = backend.rank()
        self.world_size = backend.size()
        self.compression = compression
        self.params = self._space(params, compression, backend)
        self.trials = cfg.autotune_trials if trials is None else int(trials)
        self.steps = cfg.autotune_steps if steps is None else int(steps)
        self.warmup = cfg.autotune_warmup if warmup is None else int(warmup)
        self.seed = cfg.autotune_seed if seed is None else int(seed)
        self.sampler = cfg.autotune_sampler if sampler is None else sampler
        self.log_path = (cfg.autotune_log if log_path is None else log_path).replace(
            "{rank}", str(self.rank))
        self.out = cfg.autotune_out if out is None else out
        self.confirm = int(confirm)
        self.finalists = int(finalists)
        if (self.trials < 1 or self.steps < 1 or self.warmup < 0 or self.confirm < 0
                or self.finalists < 0):
            raise ValueError("autotune: trials and steps must be >= 1, warmup, confirm and "
                             "finalists >= 0")
        self._fix_space()
        self.trial = 0  # the trial being measured
        self.calls = 0  # step() calls so far
        self.history: list[tuple[int, dict]] = []  # (step() call, settings applied after it)
        self.summary: dict | None = None
        self.done = False
        self.loaded_from: str | None = None
        self._samples: list[float] = []
        self._t_last: float | None = None
        self._search: Search | None = None
        self._hook = None
        loaded = self.done_loading(cfg)
        if self.rank == 0 and not loaded:
            try:
                import optuna  # noqa: F401 - fail here, not at the first trial boundary
            except ImportError:
                raise ImportError("autotune needs optuna on rank 0: pip install "
                                  "'gradientflow[autotune]' (or optuna)") from None
        if loaded:
            # Settings a previous search chose: use them, do not search again.
            self.loaded_from = cfg.config_file
            self.done = True
            if self.rank == 0:
                log.info("autotune: using the settings tuned earlier in %s", cfg.config_file)

    def _fix_space(self) -> None:
        """The defaults of the tuned settings and the settings id the ranks compare."""
        self.defaults = {p.name: getattr(self._holder(p), p.name) for p in self.params}
        self._settings_id = float(space.settings_id(self.params, self.trials, self.steps,
                                                    self.warmup, self.confirm, self.finalists,
                                                    self.world_size))

    def tune_compression(self, state: Any) -> None:
        """Tune `state`'s CSC chunk size too (a DDP hook state, CSCState), from the first trial.

        For a tuner made before the hook (GRADIENTFLOW_AUTOTUNE=1 makes it with the group):
        call it on every rank before the first training step. A tuner that loaded its settings
        from a file (GRADIENTFLOW_CONFIG) applies the chunk size that file holds instead.
        """
        if self.done:
            if self.loaded_from:
                chunk = tuned_compression(self.loaded_from).get("chunk_size")
                if chunk is not None:
                    state.set_chunk_size(int(chunk))
            return
        if self.calls > 0:
            raise RuntimeError(f"gradientflow autotune: rank {self.rank}: tune_compression() "
                               "after tuning started; call it before the first training step")
        _check_chunked(state)
        self.compression = state
        if "chunk_size" not in {p.name for p in self.params}:
            self.params = (*self.params, space.PARAMS["chunk_size"])
        self._fix_space()

    @staticmethod
    def _space(names: Sequence[Any] | None, compression: Any, backend: Any
               ) -> tuple[space.Param, ...]:
        """The Params to tune: the named ones (or the defaults, plus the chunk size with a
        compression state and the algorithm where there is a choice), choices fitted to this
        group's topology (read through the store, the same on every rank)."""
        params = list(space.params_of(names))
        named = {p.name for p in params}
        if names is None and compression is not None and _chunked(compression):
            params.append(space.PARAMS["chunk_size"])
        if "chunk_size" in named | {p.name for p in params}:
            if compression is None:
                raise ValueError("autotune: tuning chunk_size needs the DDP hook state it "
                                 "belongs to: Tuner(..., compression=state)")
            _check_chunked(compression)
        algos = getattr(backend, "algorithms", None)
        topo = algos.known_topology() if algos is not None else None
        choices = space.algorithm_choices(
            topo.num_hosts if topo is not None else 1,
            topo.max_local if topo is not None else backend.size(),
            getattr(algos, "reducers", 0))
        if names is None and len(choices) > 1:
            params.append(space.PARAMS["algorithm"])
        out = []
        for p in params:
            if p.name == "algorithm" and p.choices:
                p = space.with_choices(p, choices)
                if len(p.choices) < 2:
                    log.info("autotune: algorithm not tuned: this group's topology offers "
                             "%s only", p.choices or ("ring",))
                    continue
            out.append(p)
        return tuple(out)

    def _holder(self, p: space.Param) -> Any:
        """What holds `p`'s value: the group's Config or the compression state's config."""
        return self.compression.config if p.target == "compression" else self._backend.config

    @staticmethod
    def done_loading(cfg: Any) -> bool:
        """Whether `cfg` was loaded from a file autotune wrote (then it does not tune again)."""
        return bool(cfg.config_file) and "autotune" in read_config_file(cfg.config_file)

    # ------------------------------------------------------------------ the protocol
    def step(self) -> None:
        """Mark the end of a training step (every rank, same calls, no collective in flight
        on another thread). At a trial boundary, all ranks agree on the next settings."""
        if self.done:
            return
        now = time.perf_counter()
        self.calls += 1
        if self._t_last is not None:
            self._samples.append(now - self._t_last)
        self._t_last = now
        if len(self._samples) < self.warmup + self.steps:
            return
        measured = self._samples[self.warmup:]
        rows = self._exchange(REPORT, block_score(measured), [])
        rank_scores = [float(r) for r in rows[:, 4]]
        decision: list[float] = []
        done = 0.0
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                done, decision = self._decide(max(rank_scores), rank_scores, measured)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not hang
                failure, done, decision = exc, FAILED, space.encode(self.params, self.defaults)
        rows = self._exchange(DECIDE, done, decision)
        if rows[0, 4] == FAILED:
            self.done = True
            cause = repr(failure) if failure is not None else "rank 0's error says why"
            raise RuntimeError(
                f"gradientflow autotune: rank {self.rank}: rank 0's search failed at trial "
                f"{self.trial} ({cause}); tuning stopped on every rank with the settings "
                "unchanged, and the group is still usable") from failure
        settings = space.decode(self.params, rows[0, _HEAD:].tolist())
        self._apply(settings)
        self.trial += 1
        self._samples = []
        if rows[0, 4] == 1.0:
            self._finish()
        self._t_last = time.perf_counter()  # the exchange and the drain are not a step

    def _decide(self, score: float, rank_scores: list[float],
                samples: list[float]) -> tuple[float, list[float]]:
        """Rank 0: record the trial, pick the next one; (done flag, its settings encoded)."""
        if self._search is None:
            self._search = Search(self.params, self.defaults, self.trials, self.seed,
                                  self.sampler, self.confirm, self.finalists)
        record = self._search.record(score, rank_scores, samples)
        self._log({"event": "trial", **record})
        nxt = self._search.next()
        done = 0.0
        if nxt is None:
            done = 1.0
            self.summary = self._search.summary()
            nxt = self.summary["settings"]
        return done, space.encode(self.params, nxt)

    def _exchange(self, phase: float, value: float, values: list[float]) -> torch.Tensor:
        """All-gather this rank's row; check every rank is at the same point; all rows."""
        width = _HEAD + len(self.params)
        row = torch.zeros(width, dtype=torch.float64)
        row[:_HEAD] = torch.tensor([MAGIC, phase, float(self.trial), self._settings_id,
                                    value],
                                   dtype=torch.float64)
        if values:
            row[_HEAD:] = torch.tensor(values, dtype=torch.float64)
        out = [torch.zeros(width, dtype=torch.float64) for _ in range(self.world_size)]
        try:
            self._backend.allgather([out], [row], AllgatherOptions()).wait()
        except RuntimeError:
            # The group failed meanwhile (the inspector saw a mismatch: this exchange met
            # another collective): its explained error says more than the transport's.
            self._backend.engine.check_usable("the autotune exchange")
            raise
        rows = torch.stack(out)
        # The row is the exchange (one ordered collective carries the check and the data):
        # every rank's point of tuning is read from it, not gathered again.
        found = disagreement([_point(row) for row in rows[:, :4].tolist()], self.rank)
        if found is not None:
            raise AutotuneMismatch(
                f"gradientflow autotune: rank {self.rank}: the ranks are not at the same "
                f"point of tuning ({found.sentence()}). Call Tuner.step() once per training "
                "step on every rank, with the same tuner arguments on every rank.")
        return rows

    def _apply(self, settings: dict) -> None:
        """Drain the engine and swap its config, the algorithm and the chunk size (the same
        call with the same values on every rank)."""
        backend = self._backend
        engine = {p.name: settings[p.name] for p in self.params if p.target == "engine"}
        comp = {p.name: settings[p.name] for p in self.params if p.target == "compression"}
        if any(getattr(backend.config, k) != v for k, v in engine.items()):
            backend.reconfigure(backend.config.replace(**engine))  # drains first
            if "algorithm" in engine:
                # The group's channels read the algorithm's name per message (Channel.pick);
                # with the engine drained, every rank switches between the same two messages.
                backend.algorithms.name = engine["algorithm"]
        if "chunk_size" in comp and comp["chunk_size"] != self.compression.config.chunk_size:
            # The hook's buckets run on the engine: drained, no step of the state is open.
            backend.engine.drain()
            self.compression.set_chunk_size(comp["chunk_size"])
        self.history.append((self.calls, dict(settings)))

    def _finish(self) -> None:
        # The optimizer hook stays (a no-op now) until the group is destroyed: torch cannot
        # remove a hook while it runs its hooks.
        self.done = True
        if self.rank != 0:
            return
        summary = self.summary
        self._log({"event": "final", **summary})
        if self.out:
            # The engine's settings go where GRADIENTFLOW_CONFIG loads them; the compression
            # state's (chunk size) are not Config fields: they sit beside them, for
            # tuned_compression() to read back into the CompressionConfig of a later run.
            engine = {p.name for p in self.params if p.target == "engine"}
            extra = {"autotune": {k: v for k, v in summary.items() if k != "settings"}}
            comp = {k: v for k, v in summary["settings"].items() if k not in engine}
            if comp:
                extra["compression"] = comp
            write_config_file(self.out, {k: v for k, v in summary["settings"].items()
                                         if k in engine}, extra)
        log.info("%s", summary_text(summary))

    def _log(self, record: dict) -> None:
        if self.log_path and self.rank == 0:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ hooks
    def attach_optimizer_hook(self) -> None:
        """Call step() after every optimizer.step() of this process (until close())."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._hook is None and not self.done:
            self._hook = register_optimizer_step_post_hook(lambda *_: self.step())

    def close(self) -> None:
        """Stop marking steps from the optimizer hook (the backend's shutdown calls it)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _point(head: list[float]) -> str:
    """A rank's point of tuning, from the head of its row: what every rank must share."""
    marker, phase, trial, settings = head
    if marker != MAGIC:
        return "not in an autotune exchange (another collective)"
    return (f"trial {int(trial)}, {'report' if phase == REPORT else 'decide'}, "
            f"settings {int(settings):08x}")


def block_score(samples: Sequence[float]) -> float:
    """A trial's score on one rank: the mean of the faster half of its step times.

    On a shared machine the noise is one-sided: another job's burst only ever adds time to a
    step, and one step in four or five often meets one. The median of four steps still moves
    with two such steps; the faster half's mean drops them and, unlike the minimum, does not
    rest on one lucky step.
    """
    xs = sorted(samples)
    half = xs[:max(1, (len(xs) + 1) // 2)]
    return sum(half) / len(half)


def _chunked(state: Any) -> bool:
    """Whether a hook state's method has a chunk size to tune (CSC's option)."""
    return hasattr(state.config, "chunk_size")


def _check_chunked(state: Any) -> None:
    if not _chunked(state):
        raise ValueError(f"autotune: the chunk size is CSC's option, and this state's method "
                         f"{state.config.method!r} has none: tune the engine's settings only, "
                         "or give a CSC state")


def tuned_compression(path: str) -> dict:
    """The compression settings (e.g. {"chunk_size": 2048}) autotune wrote to the settings
    file `path` ({} if it tuned none); pass them to CompressionConfig(...) in a later run."""
    return dict(read_config_file(path).get("compression") or {})


def summary_text(summary: dict) -> str:
    """One paragraph: what autotune chose, its gain over the defaults, what mattered most."""
    chosen = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in summary["settings"].items())
    imp = summary.get("importance") or {}
    top = max(imp, key=imp.get) if imp else "n/a"
    return (f"autotune chose {chosen} after {summary['trials']} trials: "
            f"{summary['score_s'] * 1e3:.2f} ms/step against {summary['default_score_s'] * 1e3:.2f}"
            f" ms/step with the defaults ({summary['gain'] * 100:+.1f}%, measured side by side "
            f"in this run); the setting that mattered most: {top} "
            f"({summary.get('importance_method', 'n/a')})")
