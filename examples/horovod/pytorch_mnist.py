"""MNIST-style training in Horovod's style: a small CNN on scikit-learn's digits (8x8, bundled).

A Horovod script: only the import line says gradientflow. Run it with

    gradientflow-run -np 2 python examples/horovod/pytorch_mnist.py
    gradientflow-run -np 2 python examples/horovod/pytorch_mnist.py --fp16-allreduce
    torchrun --nproc-per-node 2 examples/horovod/pytorch_mnist.py
    python examples/horovod/pytorch_mnist.py              # one process

Each rank trains on its shard of the training images (DistributedSampler), the gradients are
averaged by hvd.DistributedOptimizer, and rank 0 prints the progress and the test result.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
from sklearn.datasets import load_digits
from tqdm import tqdm

import gradientflow.horovod as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate (scaled by size)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")


class Net(nn.Module):
    """Two convolutions and two dense layers, sized for 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def digits(train):
    """The digits split 80/20 (the same split on every rank), scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    cut = int(0.8 * len(x))
    return torch.utils.data.TensorDataset(*((x[:cut], y[:cut]) if train else (x[cut:], y[cut:])))


def metric_average(val, name):
    """Average a Python number over every rank."""
    return hvd.allreduce(torch.tensor(val), name=name).item()


def train(epoch, model, optimizer, sampler, loader, args):
    model.train()
    sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
    batches = tqdm(loader, desc=f"epoch {epoch}", disable=hvd.rank() != 0, leave=False)
    for batch_idx, (data, target) in enumerate(batches):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            batches.set_postfix(loss=f"{loss.item():.4f}")


def test(model, sampler, loader):
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(1).eq(target).sum().item()
    # Each rank saw its shard: average the per-rank means over every rank.
    test_loss = metric_average(test_loss / len(sampler), "avg_loss")
    accuracy = metric_average(correct / len(sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%\n",
              flush=True)
    return accuracy


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = digits(train=True)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_dataset = digits(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    # Horovod's rule: scale the learning rate by the number of ranks (Adasum: by local size).
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} process(es), {len(train_dataset)} images, "
              f"compression {'fp16' if args.fp16_allreduce else 'none'}", flush=True)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_sampler, train_loader, args)
        accuracy = test(model, test_sampler, test_loader)
    if hvd.rank() == 0:
        print(f"final accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
