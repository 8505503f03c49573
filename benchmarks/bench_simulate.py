"""Scale-out cost model: calibrate on our emulated-switch runs, reproduce the papers, sweep.

Nothing is timed here: the model is fitted on committed bench_e2e results (2 ranks), its error
is stated on the 4-rank runs it never saw, and the papers' numbers are predicted under the
assumptions listed in gradientflow/simulate/reproduce.py (see docs/SIMULATE.md).

    python benchmarks/bench_simulate.py [--quick] [--out DIR]

Writes DIR/simulate.json, DIR/simulate.md, DIR/calibration.json and PNG plots of speedup
against GPU count per model (matplotlib optional).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "simulate"


def main(argv=None) -> dict:
    """Calibrate, write the report, print the reproduction table."""
    from gradientflow.simulate.calibrate import calibrate
    from gradientflow.simulate.report import write_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model's sweep (the fit is fast)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    out = Path(args.out)
    cal = calibrate()
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(cal, indent=1))
    result = write_report(out, calibration=cal, quick=args.quick)
    text = (out / "simulate.md").read_text()
    print(text[:text.index("### Sensitivity")])
    return result


if __name__ == "__main__":
    main()
