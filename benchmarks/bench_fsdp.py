"""Bytes across HSDP's replicate dimension per step: dense against CSC, through hooks.register.

HSDP on 4 CPU ranks (2 replicas x 2 shards), an MLP of square Linear layers, each layer and the
root sharded with `fully_shard`, SGD with momentum. Per configuration, the wire bytes this rank
hands to the replicate dimension's all-reduce per step (the definition of
gradientflow/compression/stats.py: every tensor given to the collective), averaged over the
steady-state steps (after the warm-up):

- "HSDP (FSDP's own all-reduce)": no registration; FSDP2 all-reduces each group's FP32 shard
  gradient, 4 bytes per shard element (counted from the shard sizes, as nothing of ours runs).
- "HSDP dense through the hook": method "none", the same FP32 all-reduce through the hook
  (what the counters see, to check the line above).
- "HSDP + CSC 1%": CompressionConfig(density=0.01), every other field its default.

Beside the bytes, the compression state each rank keeps (residuals), against one FP32 copy of
its shard. No timing: the numbers do not depend on the machine or its load.

    python benchmarks/bench_fsdp.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_table, results_dir, write_result  # noqa: E402

NAME = "fsdp"


def worker(rank: int, world: int, width: int, layers: int, steps: int,
           method: str | None, hsdp: bool = True) -> dict:
    """One rank: HSDP (or FSDP2) training of the MLP for `steps` steps; the bytes its
    registration counted, by where they travel."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradientflow.hooks as hooks
    from gradientflow.compression import CompressionConfig

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,)))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = None
    if method == "none":
        state = hooks.register(model, CompressionConfig(method="none"), optimizer=opt)
    elif method == "csc":
        state = hooks.register(model, CompressionConfig(density=0.01), optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, width, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    state_bytes = state.state_bytes() if state is not None else 0
    out = {"rank": rank, "shard_numel": shard_numel, "losses": losses,
           "state_x_shard": state_bytes / (4.0 * shard_numel)}  # copies of the FP32 shard
    if state is not None:
        out.update(state.stats())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, few steps")
    ap.add_argument("--out", default=results_dir(NAME))
    args = ap.parse_args(argv)
    from benchmarks.launch import launch

    width, layers, steps = (256, 2, 30) if args.quick else (1024, 4, 40)
    world = 4
    rows = []
    runs = {}
    for label, method in (("HSDP (FSDP's own all-reduce)", None),
                          ("HSDP dense through the hook", "none"),
                          ("HSDP + CSC 1%", "csc")):
        res = launch("benchmarks.bench_fsdp:worker", world,
                     dict(width=width, layers=layers, steps=steps, method=method),
                     timeout_s=900)
        if not res.ok:
            print(res.error)
            return 1
        r0 = res.results[0]
        runs[label] = res.results
        if method is None:
            wire = 4.0 * r0["shard_numel"]
            steady = None
        else:
            wire = r0["replicate"]["wire_bytes_per_step"]
            steady = r0["replicate"]["steps"]
        rows.append({"config": label, "wire_bytes_per_step": wire, "steps": steps,
                     "steady_from": None if steady is None else steps - steady,
                     "final_loss": r0["losses"][-1], "state_x_shard": r0["state_x_shard"]})
    dense = rows[0]["wire_bytes_per_step"]
    for row in rows:
        row["fewer_than_dense"] = dense / row["wire_bytes_per_step"]
    # FSDP2 on a 1-D mesh: CSC replaces the reduce-scatter by an all-reduce of the selected
    # chunks. A ring sends (n-1)/n of a reduce-scatter's input and 2(n-1)/n of an all-reduce's
    # tensor from each rank: those are compared.
    fsdp_rows = []
    for label, method in (("FSDP2 (FSDP's own reduce-scatter)", None), ("FSDP2 + CSC 1%", "csc")):
        res = launch("benchmarks.bench_fsdp:worker", world,
                     dict(width=width, layers=layers, steps=steps, method=method, hsdp=False),
                     timeout_s=900)
        if not res.ok:
            print(res.error)
            return 1
        r0 = res.results[0]
        if method is None:
            handed = 4.0 * r0["shard_numel"] * world
            ring = handed * (world - 1) / world
        else:
            handed = r0["shard"]["wire_bytes_per_step"]
            ring = handed * 2 * (world - 1) / world
        fsdp_rows.append({"config": label, "handed": handed, "ring": ring,
                          "final_loss": r0["losses"][-1],
                          "state_x_shard": r0["state_x_shard"]})
    for row in fsdp_rows:
        row["fewer_than_dense"] = fsdp_rows[0]["ring"] / row["ring"]
    params = sum(width * width + width for _ in range(layers)) + width * 10 + 10
    md = "\n".join([
        "## HSDP: bytes across the replicate dimension per step",
        "",
        f"HSDP on {world} CPU ranks (2 replicas x 2 shards), MLP of {layers} Linear({width}, "
        f"{width}) layers and a Linear({width}, 10) head ({params:,} parameters), each layer "
        f"and the root sharded with fully_shard; {steps} SGD steps. Wire bytes rank 0 hands "
        "to the replicate all-reduce per step (steady state for the registered runs: after "
        "the default warm-up of 25 steps).",
        "",
        markdown_table(["config", "wire_bytes_per_step", "fewer_than_dense", "final_loss",
                        "state_x_shard"], rows,
                       ["configuration", "bytes / step (rank 0)", "x fewer than dense",
                        "final loss", "state, x FP32 shard"]),
        "",
        f"FSDP2 on a 1-D mesh of {world} ranks, the same model: CSC replaces each group's "
        "reduce-scatter by a CSC all-reduce of its flat gradient, the shard then taken "
        "(hooks/fsdp_comms.py says why). Bytes handed to the collective per step, and what a "
        "ring sends from each rank: (n-1)/n of a reduce-scatter's input, 2(n-1)/n of an "
        "all-reduce's tensor.",
        "",
        markdown_table(["config", "handed", "ring", "fewer_than_dense", "final_loss",
                        "state_x_shard"],
                       fsdp_rows, ["configuration", "bytes handed / step", "ring bytes sent "
                                   "/ step", "x fewer than dense", "final loss",
                                   "state, x FP32 shard"]),
        "",
        "State: the compression state rank 0 keeps (residuals), in copies of its FP32 shard. "
        "Under HSDP it is one copy, the residual of the replicate all-reduce; a compressed "
        "reduce-scatter keeps what the rank did not send to every shard, the world size in "
        "copies (hooks/fsdp_comms.py).",
        "",
        f"Command: `python benchmarks/bench_fsdp.py{' --quick' if args.quick else ''}`",
    ])
    write_result(args.out, NAME, {"rows": rows, "fsdp_rows": fsdp_rows, "width": width,
                                  "layers": layers, "steps": steps, "world": world}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
