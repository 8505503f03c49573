"""Rank 0's side of autotune: the optuna study, the trial plan, the choice and its summary.

The plan: trial 0 measures the defaults; trials 1..n-1 are asked of the sampler (TPE or GP,
seeded). Then a race: the `finalists` best searched settings and the defaults are measured
again in `rounds` rounds, each round every candidate once, in an order rotated per round. The
choice is the candidate whose time relative to the defaults *in the same round* has the lowest
median over the rounds. Why: the best of many noisy medians flatters whichever trial was lucky,
and on a shared machine the load drifts between trials by more than the settings differ; a
ratio to a neighbour measured seconds apart cancels the drift, and a median over rounds
discards a round a burst of load spoiled. A candidate replaces the defaults only when that
median is below 1 - MARGIN: changing settings on a few rounds' evidence of a smaller gain is
as likely to lose as to win on a machine this noisy.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from gradientflow.autotune.space import Param

MARGIN = 0.03  # the race's evidence a candidate must beat the defaults by


class Search:
    """The study and the trial plan (rank 0 only; imports optuna)."""

    def __init__(self, params: Sequence[Param], defaults: dict, trials: int, seed: int,
                 sampler: str, rounds: int, finalists: int = 2) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.params = tuple(params)
        self.defaults = dict(defaults)
        self.trials = trials
        self.rounds = rounds
        self.finalists = finalists
        if sampler == "gp":
            smp = optuna.samplers.GPSampler(seed=seed)
        else:
            smp = optuna.samplers.TPESampler(seed=seed,
                                             n_startup_trials=max(1, min(4, trials // 3)))
        self.study = optuna.create_study(direction="minimize", sampler=smp)
        d = optuna.distributions

        def dist(p: Param) -> Any:
            if p.choices:
                return d.CategoricalDistribution(p.choices)
            if p.integer:
                return d.IntDistribution(int(p.low), int(p.high), log=p.log)
            return d.FloatDistribution(p.low, p.high, log=p.log)

        self.dists = {p.name: dist(p) for p in self.params}
        self.records: list[dict] = []
        self._plan: list[tuple[str, dict, int]] = []  # race trials still to run
        self._current: tuple[str, dict, int] = ("default", dict(self.defaults), -1)
        self._asked: Any = None  # the optuna trial being measured
        self._candidates: list[dict] | None = None  # the race's, defaults first

    def record(self, score: float, rank_scores: list[float], samples: list[float]) -> dict:
        """The trial just measured scored `score` (s/step, the slowest rank's block score)."""
        kind, settings, cand = self._current
        if kind == "default":
            try:  # the defaults are a trial of the study when they lie in its ranges
                self.study.add_trial(self._optuna.trial.create_trial(
                    params=settings, distributions=self.dists, value=score))
            except ValueError:
                pass
        elif kind == "search":
            self.study.tell(self._asked, score)
        rec = {"trial": len(self.records), "kind": kind, "settings": settings, "score_s": score,
               "rank_scores_s": rank_scores, "samples_s": samples}
        if kind == "race":
            rec["candidate"] = cand
            rec["round"] = sum(r["kind"] == "race" and r["candidate"] == cand
                               for r in self.records)
        self.records.append(rec)
        return rec

    def next(self) -> dict | None:
        """The settings of the next trial, or None when the search is over."""
        searched = sum(r["kind"] in ("default", "search") for r in self.records)
        if searched < self.trials:
            self._asked = self.study.ask(self.dists)
            settings = {p.name: p.clip(p.to_float(self._asked.params[p.name]))
                        for p in self.params}
            self._current = ("search", settings, -1)
            return settings
        if self._candidates is None:
            self._candidates = self._finalists()
            k = len(self._candidates)
            if k > 1:  # round r runs every candidate once, starting at candidate r mod k
                self._plan = [("race", self._candidates[(r + i) % k], (r + i) % k)
                              for r in range(self.rounds) for i in range(k)]
        if self._plan:
            self._current = self._plan.pop(0)
            return self._current[1]
        return None

    def _finalists(self) -> list[dict]:
        """The defaults, then the best distinct searched settings (at most `finalists`)."""
        out = [dict(self.defaults)]
        for r in sorted(self.records, key=lambda r: r["score_s"]):
            if len(out) > self.finalists:
                break
            if r["settings"] not in out:
                out.append(dict(r["settings"]))
        return out

    def race_ratios(self) -> dict[int, list[float]]:
        """Per candidate, its time over the defaults' in each complete round."""
        by_round: dict[int, dict[int, float]] = {}
        for r in self.records:
            if r["kind"] == "race":
                by_round.setdefault(r["round"], {})[r["candidate"]] = r["score_s"]
        k = len(self._candidates or [])
        out: dict[int, list[float]] = {c: [] for c in range(k)}
        for scores in by_round.values():
            if len(scores) == k:
                for c, s in scores.items():
                    out[c].append(s / scores[0])
        return out

    def summary(self) -> dict:
        """The choice, its score against the defaults', and which setting mattered most."""
        ratios = self.race_ratios() if self._candidates else {}
        if ratios and ratios[0]:
            med = {c: statistics.median(v) for c, v in ratios.items()}
            best = min(med, key=lambda c: (med[c], c))  # ties: the defaults (candidate 0)
            if med[best] > 1.0 - MARGIN:
                best = 0
            chosen = self._candidates[best]
            times = {c: statistics.median(r["score_s"] for r in self.records
                                          if r["kind"] == "race" and r["candidate"] == c)
                     for c in ratios}
            score, dflt, ratio = times[best], times[0], med[best]
            how = f"race: {len(ratios[0])} rounds, median time relative to the defaults"
        else:  # no race (the defaults were the only finalist): the search's own scores
            chosen = dict(self.defaults)
            score = dflt = min(r["score_s"] for r in self.records if r["kind"] == "default")
            ratio, how = 1.0, "search only: no finalist besides the defaults"
        importance, method = self.importance()
        searched = [r for r in self.records if r["kind"] in ("default", "search")]
        best_searched = min(searched, key=lambda r: r["score_s"])["settings"]
        return {"settings": dict(chosen), "score_s": score, "default_score_s": dflt,
                "gain": 1.0 / ratio - 1.0, "ratio_to_defaults": ratio, "decided_by": how,
                "finalists": self._candidates or [dict(self.defaults)],
                "race_ratios": {str(c): v for c, v in ratios.items()},
                "best_searched": dict(best_searched), "trials": len(self.records),
                "importance": importance, "importance_method": method,
                "spread": spread(self.params, searched)}

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
        def key(r: dict, p: Param = p) -> float:
            return p.to_float(r["settings"][p.name])

        xs = sorted(records, key=key)
        mid = len(xs) // 2
        lo, hi = xs[:mid], xs[mid:]
        if not lo or key(xs[0]) == key(xs[-1]):
            gaps[p.name] = 0.0
            continue
        gaps[p.name] = abs(statistics.median(r["score_s"] for r in hi)
                           - statistics.median(r["score_s"] for r in lo))
    total = sum(gaps.values())
    return {k: (v / total if total else 0.0) for k, v in gaps.items()}
