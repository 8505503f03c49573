"""Command line of the cost model.

    python -m gradientflow.simulate --model resnet50 --gpus 512 --gpus-per-node 8 --gbps 56 \\
        --method gradientflow --json
    python -m gradientflow.simulate --model alexnet --sweep 8,64,512 --method ring
    python -m gradientflow.simulate --reproduce
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from gradientflow.simulate.cluster import ALGORITHMS, PRESETS, Cluster, preset
from gradientflow.simulate.models import MODELS, load
from gradientflow.simulate.step import simulate


def _density(v: str) -> float | None:
    if v.lower() in ("none", "dense", "off"):
        return None
    d = float(v)
    if not 0 < d <= 1:
        raise argparse.ArgumentTypeError(f"--csc-density {v}: use a fraction in (0, 1] or none")
    return d


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "on", "yes"):
        return True
    if v.lower() in ("0", "false", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{v!r}: use on or off")


def parser() -> argparse.ArgumentParser:
    """The CLI's arguments (everything not given keeps the model's, cluster's or method's)."""
    ap = argparse.ArgumentParser(prog="python -m gradientflow.simulate",
                                 description="Predict step time, speedup and epoch time of "
                                             "data-parallel training on a GPU cluster.")
    ap.add_argument("--model", default="resnet50",
                    help=f"one of {', '.join(MODELS)}, or a profile .json "
                         "(gradientflow.simulate.profile; then give --batch and --throughput)")
    ap.add_argument("--method", default="gradientflow", choices=sorted(PRESETS))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    g = ap.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, default=512)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gbps", type=float, default=56.0, help="inter-node bandwidth per node")
    g.add_argument("--intra-gbps", type=float, default=100.0)
    g.add_argument("--latency-us", type=float, default=6.0, help="per step between nodes")
    g.add_argument("--intra-latency-us", type=float, default=2.0)
    g.add_argument("--link-efficiency", type=float, default=None)
    g.add_argument("--throughput", type=float, default=None,
                   help="one GPU's samples/s at the per-GPU batch (default: the model's)")
    g.add_argument("--straggler-cv", type=float, default=0.0)
    w = ap.add_argument_group("workload")
    w.add_argument("--batch", type=int, default=None, help="per-GPU batch")
    w.add_argument("--dataset-size", type=int, default=None, help="samples per epoch")
    w.add_argument("--epochs", type=float, default=None)
    m = ap.add_argument_group("method overrides")
    m.add_argument("--algorithm", choices=ALGORITHMS)
    m.add_argument("--transport", choices=["gpu", "host"])
    m.add_argument("--fusion-mb", type=float, help="fusion threshold, MiB (0: per tensor)")
    m.add_argument("--solo-mb", type=float, help="solo threshold, MB (0: none)")
    m.add_argument("--cycle-ms", type=float, help="partial-message timeout (inf: none)")
    m.add_argument("--fp16", type=_bool)
    m.add_argument("--csc-density", type=_density)
    m.add_argument("--chunk-size", type=int)
    m.add_argument("--overlap", type=_bool)
    m.add_argument("--priority", type=_bool)
    m.add_argument("--forward-gating", type=_bool)
    m.add_argument("--reducers", type=int)
    ap.add_argument("--sweep", help="comma-separated GPU counts: one row per count")
    ap.add_argument("--reproduce", action="store_true",
                    help="print the papers' numbers against the model's predictions")
    return ap


def _finite(d: dict) -> dict:
    """Infinite values (cycle_ms=inf: no cycle) as the string "inf": strict JSON has no inf."""
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in d.items()}


def _method(args):
    over = {k: getattr(args, k) for k in ("algorithm", "transport", "fp16", "chunk_size",
                                          "overlap", "priority", "forward_gating", "reducers")
            if getattr(args, k) is not None}
    if args.csc_density is not None or "--csc-density" in sys.argv:
        over["csc_density"] = args.csc_density
    if args.fusion_mb is not None:
        over["fusion_threshold"] = int(args.fusion_mb * 2**20)
    if args.solo_mb is not None:
        over["solo_threshold"] = int(args.solo_mb * 10**6)
    if args.cycle_ms is not None:
        over["cycle_ms"] = math.inf if math.isinf(args.cycle_ms) else args.cycle_ms
    return preset(args.method, **over)


def main(argv=None) -> int:
    """Run the CLI; returns the exit status."""
    args = parser().parse_args(argv)
    if args.reproduce:
        from gradientflow.simulate.reproduce import run_all

        reps = run_all()
        if args.json:
            print(json.dumps(reps))
        else:
            for r in reps:
                print(f"{r['claim']}: paper {r['target']:g} {r['unit']}, model "
                      f"{r['predicted']:.3g} ({100 * r['error']:+.1f}%)")
        return 0 if all(r["ok"] for r in reps) else 1
    try:
        model = load(args.model, batch=args.batch, dataset=args.dataset_size, epochs=args.epochs,
                     throughput=args.throughput)
        extra = {"link_efficiency": args.link_efficiency} if args.link_efficiency else {}
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                          inter_gbps=args.gbps, intra_gbps=args.intra_gbps,
                          inter_latency_us=args.latency_us,
                          intra_latency_us=args.intra_latency_us, throughput=args.throughput,
                          straggler_cv=args.straggler_cv, **extra)
        method = _method(args)
    except (ValueError, OSError) as e:
        print(f"gradientflow.simulate: {e}", file=sys.stderr)
        return 2
    counts = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.gpus]
    results = [simulate(model, cluster.with_gpus(n), method).to_dict() for n in counts]
    inputs = {"cluster_config": _finite(dataclasses.asdict(cluster)),
              "method_config": _finite(dataclasses.asdict(method))}
    if args.json:
        print(json.dumps({"results": results, **inputs} if args.sweep
                         else {**results[0], **inputs}, allow_nan=False))
        return 0
    for r in results:
        print(f"{r['model']} {r['method']} on {r['gpus']} GPUs ({r['gpus_per_node']}/node): "
              f"step {1e3 * r['step_s']:.1f} ms (compute {1e3 * r['compute_s']:.1f}, exposed "
              f"communication {1e3 * r['exposed_comm_s']:.1f}), speedup {r['speedup']:.1f}x, "
              f"efficiency {100 * r['scaling_efficiency']:.1f}%, epoch {r['epoch_time_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
