"""Ray Train's TorchTrainer over the gradientflow backend, with Horovod's API inside.

    python examples/horovod/ray_torch_trainer.py --num-workers 2 --epochs 3

TorchConfig(backend="gradientflow") makes Ray Train create each worker's process group with
our backend (torch finds it through its entry point, or `import gradientflow`); inside the
training loop `hvd.init()` adopts that group, so the loop is a Horovod loop. Needs the `ray`
extra: pip install 'ray[train]'.
"""
import argparse

import torch
from ray import train
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

parser = argparse.ArgumentParser(description="Ray Train + gradientflow")
parser.add_argument("--num-workers", type=int, default=2, help="number of training workers")
parser.add_argument("--epochs", type=int, default=3, help="passes over each worker's data")
parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")


def train_loop(config):
    """One Ray Train worker: a Horovod-style loop fitting y = x @ w on its own data."""
    import torch.distributed as dist

    import gradientflow.horovod as hvd

    hvd.init()  # adopts the group Ray Train made with backend="gradientflow"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    compression = hvd.Compression.fp16 if config["fp16"] else hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(256, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for epoch in range(config["epochs"]):
        for xb, yb in zip(x.split(32), y.split(32)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
        mean_loss = hvd.allreduce(loss.detach()).item()
        train.report({"epoch": epoch, "loss": mean_loss})
    if hvd.rank() == 0:  # Ray forwards the workers' output to the driver, prefixed
        weight = [round(w, 3) for w in model.weight.detach().flatten().tolist()]
        print(f"final loss {mean_loss:.6f} on {hvd.size()} workers, backend "
              f"{dist.get_backend()}, weight {weight}", flush=True)
    hvd.shutdown()


def main(argv=None):
    args = parser.parse_args(argv)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"lr": args.lr, "epochs": args.epochs, "fp16": args.fp16_allreduce},
        torch_config=TorchConfig(backend="gradientflow"),
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False))
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result


if __name__ == "__main__":
    main()
