"""Small shared helpers for the training scripts: paths, a progress logger with ETA, atomic saves.

No Ray here. Progress goes both to stdout and to a log file, so a job started with ``nohup`` can be
followed with ``tail -f`` and a resumed job appends to the same log.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from workers.model_loader import cache_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DRAFT_DIR = MODELS_DIR / "smollm2-draft"
EAGLE_DIR = MODELS_DIR / "smollm2-eagle"


def data_dir() -> Path:
    """Generated training data lives in the cache (hundreds of MB of hidden states), not in the repo."""
    return cache_dir() / "draft-training-data"


def work_dir(name: str) -> Path:
    """Checkpoints and logs of one training run (``name``: 'draft' or 'eagle')."""
    d = cache_dir() / "draft-training" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


class Progress:
    """``done/total`` progress lines with rate and ETA, at most every ``every_s`` seconds."""

    def __init__(
        self, total: float, log_path: Path | None, label: str, every_s: float = 10.0, done: float = 0.0
    ) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self.start_done = done
        self.done = done
        self.t0 = time.time()
        self.last = 0.0
        self.log = open(log_path, "a", buffering=1) if log_path else None

    def write(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        if self.log:
            self.log.write(line + "\n")

    def update(self, done: float, extra: str = "", force: bool = False) -> None:
        self.done = done
        now = time.time()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        el = now - self.t0
        rate = (done - self.start_done) / el if el > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        pct = 100.0 * done / self.total if self.total else 100.0
        self.write(
            f"{self.label} {done:.0f}/{self.total:.0f} ({pct:.1f}%) {rate:.2f}/s elapsed {el / 60:.1f} min "
            f"ETA {eta / 60:.1f} min {extra}"
        )


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file then rename: a job killed mid-save never leaves a torn checkpoint."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"torch threads: {n}, pid {os.getpid()}", file=sys.stderr)
