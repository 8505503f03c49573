"""The language model's corpus: the Jargon File 4.4.7, from Debian's package `jargon-text`.

Real English prose (about 1.7 MB: the hacker lexicon's entries, its appendices and tables),
public domain by its author's statement (/usr/share/doc/jargon-text/copyright), installed
offline with `apt-get install jargon-text`. Read as bytes (a byte-level tokenizer: 256 tokens,
the box-drawing characters of its tables travel as their UTF-8 bytes) and cut in three
contiguous parts: the first 90% trains, the next 5% validates (every choice and the curves),
the last 5% is the test set, read once at the end of a run.
"""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

PACKAGE = "jargon-text"
SOURCE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
SPLITS = {"train": (0.0, 0.90), "val": (0.90, 0.95), "test": (0.95, 1.0)}
VOCAB = 256  # bytes


class CorpusUnavailable(RuntimeError):
    """The corpus is not installed and cannot be installed here."""


def ensure(source: Path = SOURCE, install: bool = True) -> Path:
    """The corpus file, installing Debian's package first where it is missing, this is root
    and apt-get exists; otherwise CorpusUnavailable says what to do."""
    if source.is_file():
        return source
    if install and source == SOURCE and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", PACKAGE]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
        if source.is_file():
            return source
    raise CorpusUnavailable(f"{source} not found: install Debian's package "
                            f"(`sudo apt-get install {PACKAGE}`) or pass --corpus FILE.gz")


def load(source: Path = SOURCE, install: bool = False) -> dict:
    """{"train" | "val" | "test": uint8 tensor of the split's bytes} (installing the package
    only when asked: the ranks of a run must not race apt-get; run_lm.py installs it first)."""
    import torch

    data = gzip.decompress(ensure(source, install).read_bytes())
    n = len(data)
    return {name: torch.frombuffer(bytearray(data[int(a * n):int(b * n)]), dtype=torch.uint8)
            for name, (a, b) in SPLITS.items()}
