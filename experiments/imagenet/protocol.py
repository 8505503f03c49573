"""The evidence protocol: choices on a validation split and screening seeds, reports on the test
set and seeds no choice saw.

- `--val-split N` (train.py) holds the last N images of a fixed permutation of the training set
  out of training; every epoch is scored on them (records say `"eval_set": "validation"`).
- The test set is read once, after the last epoch, and only with `--report-test`; its numbers go
  to fields of their own (`test_top1`, `test_top5`, `test_loss`), never to `val_*`.
- Seeds 0-9 are screening seeds (sweeps, screens, the choice of a default). A run that reports
  on the test set must use a seed outside them; the reported seeds are 10-14.
- A tool that chooses (a sweep's recommendation, a screen's ranking) reads `selection_top1`,
  which refuses a record scored on the test set; a report reads `report_top1`, which refuses a
  run without a test evaluation.
"""
from __future__ import annotations

# Seeds a choice may look at, and the seeds reported runs use.
SCREEN_SEEDS = range(0, 10)
REPORT_SEEDS = (10, 11, 12, 13, 14)
# The split's own permutation seed: the same split for every run and every training seed.
SPLIT_SEED = 0
# The validation split of each data set the experiments use (images held out of training).
VAL_SPLITS = {"fashion-mnist": 10000, "digits": 360}


class ProtocolError(ValueError):
    """A run or a tool would break the protocol (a choice on test, a report on a screen seed)."""


def split_indices(n: int, n_val: int) -> tuple[list, list]:
    """(train, validation) indices of a training set of `n` images: the validation split is the
    last `n_val` of a permutation drawn with SPLIT_SEED (ImageFolder lists images by class, so
    the literal last images would be one class)."""
    if not 0 < n_val < n:
        raise ProtocolError(f"--val-split {n_val} must be between 1 and {n - 1} (the training "
                            f"set holds {n} images)")
    import torch  # here: the tools that only read logs need no torch

    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return sorted(order[:n - n_val]), sorted(order[n - n_val:])


def carve(train_set, eval_view, n_val: int):
    """The training set less its validation split, and the split itself read through
    `eval_view` (the same images without augmentation)."""
    from torch.utils.data import Subset

    if len(eval_view) != len(train_set):
        raise ProtocolError(f"the unaugmented view holds {len(eval_view)} images, the training "
                            f"set {len(train_set)}")
    train_idx, val_idx = split_indices(len(train_set), n_val)
    return Subset(train_set, train_idx), Subset(eval_view, val_idx)


def check_report_seed(seed: int | None) -> None:
    """A run that reads the test set must use a seed no choice has seen."""
    if seed is None or seed in SCREEN_SEEDS:
        raise ProtocolError(
            f"--report-test with --seed {seed}: seeds {SCREEN_SEEDS.start}-"
            f"{SCREEN_SEEDS.stop - 1} are for choices made on the validation split; report on "
            f"seeds {REPORT_SEEDS[0]}-{REPORT_SEEDS[-1]} (or any seed >= {SCREEN_SEEDS.stop})")


def check_role(role: str, seeds) -> None:
    """A stage's seeds fit its role: "screen" uses screening seeds, "report" never does."""
    seeds = list(seeds)
    if role == "screen":
        bad = [s for s in seeds if s not in SCREEN_SEEDS]
        if bad:
            raise ProtocolError(f"a screen runs on seeds {SCREEN_SEEDS.start}-"
                                f"{SCREEN_SEEDS.stop - 1}, not {bad}: the others are kept for "
                                f"reports")
    elif role == "report":
        for s in seeds:
            check_report_seed(s)
    else:
        raise ProtocolError(f"role {role!r}: choose screen or report")


def selection_top1(record: dict) -> float:
    """The top-1 a choice may rank on: the validation split's, never the test set's."""
    if record.get("eval_set") != "validation":
        raise ProtocolError(
            f"epoch {record.get('epoch')} was scored on {record.get('eval_set', 'the test set')}"
            f", not a validation split: a choice cannot rank on it (run with --val-split)")
    return record["val_top1"]


def report_top1(log: list) -> float:
    """The test top-1 a report gives: the last epoch's test evaluation (--report-test)."""
    if not log or "test_top1" not in log[-1]:
        raise ProtocolError("the run has no test evaluation (run with --report-test on a "
                            "report seed)")
    return log[-1]["test_top1"]
