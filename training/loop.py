"""The training loop both drafts share: AdamW, warmup + cosine, periodic checkpoints, resume, logging.

Reproducible: the batch order of epoch ``e`` is a pure function of ``(seed, e)`` and the RNG state
is checkpointed, so a resumed run continues the same sequence of batches (up to float
non-associativity of the CPU kernels). A checkpoint is written every ``ckpt_minutes`` and at the
end; a rerun of the same command resumes from it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from training.common import Progress, atomic_save
from training.data import Seq, collate, make_batches

# batch tensors -> (loss, {metric name: value}) for one batch
LossFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class LoopConfig:
    epochs: float
    batch_tokens: int
    lr: float
    warmup_steps: int
    weight_decay: float
    seed: int
    ckpt_minutes: float
    eval_every: int
    max_minutes: float  # stop (with a checkpoint) after this long; a rerun resumes


def lr_at(step: int, total: int, cfg: LoopConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def evaluate(loss_fn: LossFn, val: list[Seq], batch_tokens: int) -> dict[str, float]:
    """Token-weighted mean of every metric over the validation sequences."""
    sums: dict[str, float] = {}
    n = 0
    with torch.no_grad():
        for idxs in make_batches(val, batch_tokens, seed=0):
            b = collate(val, idxs)
            w = int(b["loss_mask"].sum())
            _, m = loss_fn(b)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * w
            n += w
    return {k: v / max(n, 1) for k, v in sums.items()}


def train(
    params: list[torch.nn.Parameter],
    state_module: torch.nn.Module,
    loss_fn: LossFn,
    train_seqs: list[Seq],
    val_seqs: list[Seq],
    cfg: LoopConfig,
    work: Path,
    log_name: str,
    best_key: str = "top1",
) -> dict[str, list]:
    """Run (or resume) training; returns the learning curve ``{"step": [...], "val_...": [...]}``.

    On return ``state_module`` holds the weights of the evaluation with the highest validation
    ``best_key`` (the data set is small, so late epochs can overfit; the curve shows by how much).
    """
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    per_epoch = len(make_batches(train_seqs, cfg.batch_tokens, seed=cfg.seed))
    total = int(cfg.epochs * per_epoch)
    ckpt = work / "checkpoint.pt"
    step = 0
    curve: dict[str, list] = {"step": [], "minutes": []}
    prog = Progress(total, work / f"{log_name}.log", log_name, every_s=30)
    minutes_before = 0.0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        state_module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, curve, minutes_before = st["step"], st["curve"], st.get("minutes", 0.0)
        torch.set_rng_state(st["rng"])
        prog.write(f"resumed from {ckpt} at step {step}/{total}")
        prog.start_done = step
    prog.write(f"training {log_name}: {len(train_seqs)} sequences, {per_epoch} batches/epoch, {total} steps")
    t0 = time.time()
    t_ckpt = t0
    run_avg: dict[str, float] = {}

    def save() -> None:
        atomic_save(
            {
                "model": state_module.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "curve": curve,
                "rng": torch.get_rng_state(),
                "minutes": minutes_before + (time.time() - t0) / 60,
            },
            ckpt,
        )

    best_path = work / "best.pt"

    def record_eval() -> None:
        m = evaluate(loss_fn, val_seqs, cfg.batch_tokens)
        prev = max(curve.get("val_" + best_key, []), default=float("-inf"))
        if m[best_key] > prev:
            atomic_save({"model": state_module.state_dict(), "step": step, best_key: m[best_key]}, best_path)
        curve["step"].append(step)
        curve["minutes"].append(round(minutes_before + (time.time() - t0) / 60, 2))
        for k, v in m.items():
            curve.setdefault("val_" + k, []).append(round(v, 4))
        prog.write(f"eval @ step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in m.items()))

    if step == 0:
        record_eval()
    while step < total:
        epoch = step // per_epoch
        batches = make_batches(train_seqs, cfg.batch_tokens, seed=cfg.seed * 1000 + epoch)
        b = collate(train_seqs, batches[step % per_epoch])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        loss, m = loss_fn(b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        for k, v in m.items():
            run_avg[k] = 0.95 * run_avg.get(k, v) + 0.05 * v
        prog.update(step, " ".join(f"{k}={v:.3f}" for k, v in run_avg.items()) + f" lr={lr_at(step, total, cfg):.2e}")
        if step % cfg.eval_every == 0 or step == total:
            record_eval()
        if time.time() - t_ckpt > cfg.ckpt_minutes * 60 or step == total:
            save()
            t_ckpt = time.time()
        if (time.time() - t0) / 60 > cfg.max_minutes:
            if step % cfg.eval_every:  # evaluate the last weights too, so the best-kept choice sees them
                record_eval()
            save()
            prog.write(f"stopping at step {step}/{total} after {cfg.max_minutes} min; rerun to resume")
            break
    if best_path.exists():
        best = torch.load(best_path, weights_only=False)
        state_module.load_state_dict(best["model"])
        curve["best_step"] = [best["step"]]
        prog.write(f"kept the weights of step {best['step']} (val {best_key} {best[best_key]:.4f})")
    curve["finished"] = [step >= total]
    curve["train_minutes"] = [round(minutes_before + (time.time() - t0) / 60, 1)]
    return curve
