"""The data sets the experiments read: scikit-learn's digits and Fashion-MNIST.

    python experiments/imagenet/prepare.py    # -> experiments/imagenet/data/digits
    python experiments/imagenet/prepare.py --out DIR --size 32 --val-fraction 0.2 --seed 0
    python experiments/imagenet/prepare.py --dataset fashion-mnist  # -> data/fashion-mnist

Fashion-MNIST (Zalando; 60,000 training and 10,000 test images of 28x28, 10 classes of
clothing) comes from Debian's package dataset-fashion-mnist, which installs its four IDX files
under /usr/share/datasets/fashion-mnist/. Where they are missing, the package is installed when
this runs as root on a machine with apt-get; otherwise the error says what to do. Nothing is
downloaded at run time: the files are uncompressed into OUT/FashionMNIST/raw/, where
torchvision's FashionMNIST class (download=False) reads them.

Why this data set: it ships inside the scikit-learn wheel (no download, works offline), it is
real data (1797 handwritten digits from 43 writers, UCI "optdigits"), and it is small enough to
train a torchvision ResNet-18 on 2 CPU cores in seconds per epoch. Each 8x8 image with 17 grey
levels is upscaled (bilinear) to `--size` pixels and written as an RGB PNG, so train.py reads it
through the same `ImageFolder` code path as real ImageNet (`DIR/train/<class>/*.png`,
`DIR/val/<class>/*.png`). The split is stratified and fixed by `--seed`; the default holds out
360 images, so one image is 0.28 points of top-1.
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "digits"
FASHION_OUT = Path(__file__).resolve().parent / "data" / "fashion-mnist"
FASHION_SRC = Path("/usr/share/datasets/fashion-mnist")
FASHION_PACKAGE = "dataset-fashion-mnist"
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class DataUnavailable(RuntimeError):
    """The data set's files are missing and could not be installed here; the message says how."""


def _missing(src: Path) -> list:
    return [f for f in FASHION_FILES if not (src / f"{f}.gz").is_file()]


def ensure_fashion_package(src: Path = FASHION_SRC, install: bool = True) -> Path:
    """The folder holding Fashion-MNIST's four .gz IDX files, installing Debian's package
    dataset-fashion-mnist when they are missing, this is root, and apt-get exists."""
    if not _missing(src):
        return src
    can_install = install and src == FASHION_SRC and shutil.which("apt-get") is not None
    if can_install and os.geteuid() == 0:
        cmd = ["apt-get", "install", "-y", "-q", FASHION_PACKAGE]
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        print(f"prepare.py: {src} is missing: {' '.join(cmd)}", file=sys.stderr, flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:  # a stale package list: update once
            subprocess.run(["apt-get", "update", "-q"], env=env)
            subprocess.run(cmd, env=env)
    missing = _missing(src)
    if not missing:
        return src
    how = (f"install Debian's package: `sudo apt-get install {FASHION_PACKAGE}`"
           if shutil.which("apt-get") else
           "no apt-get here: copy the four .gz IDX files of the Fashion-MNIST release "
           f"({', '.join(f + '.gz' for f in FASHION_FILES)}) into a folder and pass it as --src")
    raise DataUnavailable(f"Fashion-MNIST: {', '.join(m + '.gz' for m in missing)} not found in "
                          f"{src}; {how}")


def prepare_fashion(out: Path = FASHION_OUT, src: Path = FASHION_SRC, install: bool = True) -> Path:
    """Uncompress Fashion-MNIST's IDX files into OUT/FashionMNIST/raw/ (idempotent); return OUT,
    the root torchvision.datasets.FashionMNIST(root, download=False) and train.py take."""
    raw = out / "FashionMNIST" / "raw"
    if all((raw / f).is_file() for f in FASHION_FILES):
        return out
    src = ensure_fashion_package(src, install)
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_FILES:
        tmp = raw / f"{name}.tmp"
        with gzip.open(src / f"{name}.gz", "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        tmp.replace(raw / name)  # a file under its final name is always complete
    return out


def prepare(out: Path = DEFAULT_OUT, size: int = 32, val_fraction: float = 0.2, seed: int = 0,
            limit: int | None = None) -> Path:
    """Write the ImageFolder tree under `out` (idempotent) and return `out`.

    `limit` keeps only the first `limit` images of each split (for fast tests).
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    marker = out / f".done-size{size}-val{val_fraction}-seed{seed}-limit{limit}"
    if marker.exists():
        return out
    digits = load_digits()
    images = (digits.images / 16.0 * 255.0).round().astype(np.uint8)  # 0..16 grey levels -> 0..255
    idx_train, idx_val = train_test_split(
        np.arange(len(images)), test_size=val_fraction, random_state=seed, stratify=digits.target
    )
    for split, idx in (("train", idx_train), ("val", idx_val)):
        if limit is not None:
            idx = idx[:limit]
        for cls in range(10):
            (out / split / str(cls)).mkdir(parents=True, exist_ok=True)
        for i in idx:
            img = Image.fromarray(images[i], mode="L").resize((size, size), Image.BILINEAR)
            img.convert("RGB").save(out / split / str(digits.target[i]) / f"{i:04d}.png")
    marker.touch()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["digits", "fashion-mnist"], default="digits")
    p.add_argument(
        "--out", type=Path, default=None,
        help=f"output folder (default: {DEFAULT_OUT} or {FASHION_OUT})"
    )
    p.add_argument("--src", type=Path, default=FASHION_SRC,
                   help="Fashion-MNIST: the folder of its four .gz IDX files (default: where "
                   "Debian's package puts them)")
    p.add_argument("--size", type=int, default=32, help="side of the upscaled images in pixels")
    p.add_argument("--val-fraction", type=float, default=0.2, help="held-out fraction (stratified)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--limit", type=int, default=None, help="keep only this many images per split")
    args = p.parse_args(argv)
    if args.dataset == "fashion-mnist":
        try:
            out = prepare_fashion(args.out or FASHION_OUT, args.src)
        except DataUnavailable as exc:
            print(f"prepare.py: error: {exc}", file=sys.stderr)
            return 2
        print(f"Fashion-MNIST at {out / 'FashionMNIST' / 'raw'}: 60000 train / 10000 test "
              f"images, 28x28 grey (train.py {out})")
        return 0
    if not 8 <= args.size <= 512 or not 0.0 < args.val_fraction < 1.0:
        print(
            "prepare.py: error: --size must be in [8, 512] and --val-fraction in (0, 1)",
            file=sys.stderr,
        )
        return 2
    out = prepare(args.out or DEFAULT_OUT, args.size, args.val_fraction, args.seed, args.limit)
    n_train = sum(1 for _ in (out / "train").rglob("*.png"))
    n_val = sum(1 for _ in (out / "val").rglob("*.png"))
    print(
        f"digits ImageFolder at {out}: {n_train} train / {n_val} val images, "
        f"{args.size}x{args.size} RGB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
