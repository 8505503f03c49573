"""Model tables for the cost model: per-layer gradient sizes and compute shares, GPU defaults.

The per-layer numbers come from gradientflow/simulate/profiles.json, measured by
gradientflow.simulate.profile on torchvision's AlexNet and ResNet-50 and on a BERT-base built
from the standard layer table (12 layers, hidden 768, FFN 3072, vocabulary 30522, 512
positions). What is measured is a *shape* (which share of the step each layer takes, when each
gradient becomes ready); the absolute compute time on a GPU is `batch / throughput`, with the
per-GPU throughput stated per model below (and overridable: Cluster.throughput, --throughput).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The measured profiles: data, written by `python -m gradientflow.simulate.profile`.
PROFILES = json.loads(Path(__file__).with_name("profiles.json").read_text())["profiles"]

IMAGENET = 1_281_167  # training images in ImageNet-1k (ILSVRC 2012)
MNLI = 392_702  # training pairs in GLUE MNLI (Reduction Server's BERT fine-tuning task)


@dataclass(frozen=True)
class Layer:
    """One layer with parameters, in backward order."""

    name: str
    numel: int  # gradient elements
    numel_1d: int  # of which in 1-D tensors (biases, norms): CSC sends them dense
    tensors: int
    ready: float  # share of the backward pass elapsed when its gradient is ready
    fwd_index: int  # position in forward order (0 = the layer the next forward needs first)
    fwd_share: float  # its share of the forward pass


@dataclass(frozen=True)
class Model:
    """A model's layers plus the per-GPU defaults the cost model scales its shape with."""

    name: str
    layers: tuple[Layer, ...]
    forward_fraction: float  # forward's share of one training step's compute
    batch: int  # per-GPU batch of the default workload
    throughput: float  # samples/s of one GPU at that batch (default GPU; see GPU_DEFAULTS)
    dataset: int  # samples per epoch
    epochs: float

    @property
    def numel(self) -> int:
        """Gradient elements in all."""
        return sum(layer.numel for layer in self.layers)

    @property
    def grad_bytes(self) -> int:
        """FP32 gradient bytes per step."""
        return 4 * self.numel


# Per-GPU defaults. The ImageNet ones are the single-GPU rates implied by the GradientFlow
# paper's own pair of numbers (epochs x 1,281,167 images / reported minutes / reported speedup):
# AlexNet 95 epochs in 1.5 min at 410.2x -> 3,296 images/s; ResNet-50 90 epochs in 7.3 min at
# 434.1x -> 606 images/s; plausible for a 2018 V100 in mixed precision. Batch 128 per GPU
# (64K images over 512 GPUs, the large-batch setting of that period; unverified). BERT-base:
# 32 sequences of 128 tokens per GPU at 400 sequences/s (an A100-class fine-tuning rate;
# unverified, a placeholder to override with --throughput).
GPU_DEFAULTS = {
    "alexnet": {"batch": 128, "throughput": 95 * IMAGENET / 90.0 / 410.2,
                "dataset": IMAGENET, "epochs": 95},
    "resnet50": {"batch": 128, "throughput": 90 * IMAGENET / (7.3 * 60) / 434.1,
                 "dataset": IMAGENET, "epochs": 90},
    "bert-base": {"batch": 32, "throughput": 400.0, "dataset": MNLI, "epochs": 3},
}
ALIASES = {"resnet-50": "resnet50", "bert": "bert-base", "bert_base": "bert-base"}
MODELS = tuple(GPU_DEFAULTS)


def from_profile(prof: dict, **workload) -> Model:
    """A Model from a profile dict (profile.measure_module's output) and its workload:
    batch, throughput (samples/s of one GPU at that batch), dataset, epochs."""
    try:
        order = {n: i for i, n in enumerate(prof["forward_order"])}
        layers = tuple(Layer(r["name"], r["numel"], r["numel_1d"], r["tensors"], r["ready"],
                             order[r["name"]], r["fwd_share"]) for r in prof["layers"])
        fraction = prof["forward_fraction"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"model profile {prof.get('model', '?')!r} lacks {e}: write it with "
                         "gradientflow.simulate.profile.measure_module") from None
    missing = [k for k in ("batch", "throughput", "dataset", "epochs") if workload.get(k) is None]
    if missing:
        raise ValueError(f"model profile {prof.get('model', '?')!r}: give {missing} "
                         "(--batch, --throughput, --dataset-size, --epochs)")
    return Model(name=prof.get("model", "custom"), layers=layers, forward_fraction=fraction,
                 **workload)


def load(name: str, **overrides) -> Model:
    """A model by name (alexnet, resnet50, bert-base) or a profile JSON file (path ending .json),
    its workload defaults optionally overridden (batch, throughput, dataset, epochs)."""
    over = {k: v for k, v in overrides.items() if v is not None}
    if name.endswith(".json"):
        prof = json.loads(Path(name).read_text())
        if "layers" not in prof and len(prof) == 1:  # profile --json writes {name: profile}
            prof = next(iter(prof.values()))
        return from_profile(prof, **{"dataset": IMAGENET, "epochs": 1, **over})
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise ValueError(f"unknown model {name!r}; use one of {list(MODELS)} or a profile .json")
    return from_profile(PROFILES[key], **{**GPU_DEFAULTS[key], **over})
