"""Rank 0's side of autotune: the optuna study, the trial plan, the choice and its summary.

The plan: trial 0 measures the defaults; trials 1..n-1 are asked of the sampler (TPE or GP,
seeded); then `confirm` rounds measure the best trial and the defaults again, alternately, so
the choice and its gain come from measurements taken side by side, not from the minimum of
many noisy medians (which flatters whichever trial was lucky).
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from gradientflow.autotune.space import Param


class Search:
    """The study and the trial plan (rank 0 only; imports optuna)."""

    def __init__(self, params: Sequence[Param], defaults: dict, trials: int, seed: int,
                 sampler: str, confirm: int) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.params = tuple(params)
        self.defaults = dict(defaults)
        self.trials = trials
        self.confirm = confirm
        if sampler == "gp":
            smp = optuna.samplers.GPSampler(seed=seed)
        else:
            smp = optuna.samplers.TPESampler(seed=seed,
                                             n_startup_trials=max(1, min(4, trials // 3)))
        self.study = optuna.create_study(direction="minimize", sampler=smp)
        d = optuna.distributions
        self.dists = {p.name: (d.IntDistribution(int(p.low), int(p.high), log=p.log)
                               if p.integer else d.FloatDistribution(p.low, p.high, log=p.log))
                      for p in self.params}
        self.records: list[dict] = []
        self._plan: list[tuple[str, dict]] = []  # confirmation trials still to run
        self._current = ("default", dict(self.defaults))
        self._asked: Any = None  # the optuna trial being measured
        self._best: dict | None = None

    def record(self, score: float, rank_medians: list[float], samples: list[float]) -> dict:
        """The trial just measured scored `score` (s/step, the slowest rank's median)."""
        kind, settings = self._current
        if kind == "default":
            try:  # the defaults are a trial of the study when they lie in its ranges
                self.study.add_trial(self._optuna.trial.create_trial(
                    params=settings, distributions=self.dists, value=score))
            except ValueError:
                pass
        elif kind == "search":
            self.study.tell(self._asked, score)
        rec = {"trial": len(self.records), "kind": kind, "settings": settings, "score_s": score,
               "rank_medians_s": rank_medians, "samples_s": samples}
        self.records.append(rec)
        return rec

    def next(self) -> dict | None:
        """The settings of the next trial, or None when the search is over."""
        searched = sum(r["kind"] in ("default", "search") for r in self.records)
        if searched < self.trials:
            self._asked = self.study.ask(self.dists)
            settings = {p.name: p.clip(self._asked.params[p.name]) for p in self.params}
            self._current = ("search", settings)
            return settings
        if self._best is None:
            self._best = min((r for r in self.records), key=lambda r: r["score_s"])["settings"]
            if self._best != self.defaults:
                self._plan = [(k, s) for _ in range(self.confirm)
                              for k, s in (("confirm-best", self._best),
                                           ("confirm-default", self.defaults))]
        if self._plan:
            self._current = self._plan.pop(0)
            return self._current[1]
        return None

    def summary(self) -> dict:
        """The choice, its score against the defaults', and which setting mattered most."""
        def med(kind: str) -> float | None:
            xs = [r["score_s"] for r in self.records if r["kind"] == kind]
            return statistics.median(xs) if xs else None

        best = self._best if self._best is not None else self.defaults
        b, dflt = med("confirm-best"), med("confirm-default")
        if b is None:  # no confirmation rounds: the search's own scores
            dflt = med("default")
            b = min(r["score_s"] for r in self.records if r["settings"] == best)
        chosen, score = (best, b) if b < dflt else (self.defaults, dflt)
        importance, method = self.importance()
        searched = [r for r in self.records if r["kind"] in ("default", "search")]
        return {"settings": dict(chosen), "score_s": score, "default_score_s": dflt,
                "gain": dflt / score - 1.0, "best_searched": dict(best),
                "trials": len(self.records), "importance": importance,
                "importance_method": method, "spread": spread(self.params, searched)}

    def importance(self) -> tuple[dict, str]:
        """Per-setting importance: optuna's PED-ANOVA where it can (fast: no forest to fit,
        while the other ranks wait in the exchange), else the spread of scores."""
        searched = [r for r in self.records if r["kind"] in ("default", "search")]
        if len(self.study.trials) >= 4:
            try:
                imp = self._optuna.importance.get_param_importances(
                    self.study, evaluator=self._optuna.importance.PedAnovaImportanceEvaluator())
                return {k: float(v) for k, v in imp.items()}, "optuna PED-ANOVA"
            except (RuntimeError, ValueError, ImportError):
                pass
        return spread(self.params, searched), "score spread between halves"


def spread(params: Sequence[Param], records: list[dict]) -> dict:
    """For each setting, the gap between the median scores of the trials below and above its
    median value, as a fraction of the sum of gaps (0 where it never varied)."""
    gaps = {}
    for p in params:
        xs = sorted(records, key=lambda r: r["settings"][p.name])
        mid = len(xs) // 2
        lo, hi = xs[:mid], xs[mid:]
        if not lo or lo[-1]["settings"][p.name] == hi[0]["settings"][p.name] == xs[0][
                "settings"][p.name] == xs[-1]["settings"][p.name]:
            gaps[p.name] = 0.0
            continue
        gaps[p.name] = abs(statistics.median(r["score_s"] for r in hi)
                           - statistics.median(r["score_s"] for r in lo))
    total = sum(gaps.values())
    return {k: (v / total if total else 0.0) for k, v in gaps.items()}
