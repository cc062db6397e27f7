"""Data-scaling learning curve of the EAGLE head: held-out acceptance vs training tokens.

    nice -n 19 python -m training.scaling --fracs 0.125,0.25,0.5 --threads 2   # ~20 min here

Why: the shipped head misses its target (mean acceptance length 2.5 on held-out chat, greedy,
K = 4) by a wide margin, and the learning curves over training steps say it overfits (top-1 ~0.7
on training sequences, 0.44 on held-back responses to training prompts, 0.27 on held-out
prompts). Whether more data would close the gap, and how much, is a question about the curve
over *data*: this script trains the first stage (EAGLE-1 loss, same recipe and epochs as the
shipped head) on nested random subsets of the training sequences and measures each head on the
same held-out set.

Held-out set: the target's greedy answers (through our engine, with its final-norm hidden states,
training/datagen.py's recorder) to ``--heldout-prompts`` prompts of training/prompts.py's eval
split, whose fill-in subjects never occur in training; cached in the cache directory.

Measure (teacher-forced, exact for greedy): at every response position j, the head drafts K
tokens as the proposer does (draft 1 from the target's feature f_j and token t_{j+1}, later drafts
from its own predicted features, EagleHead.forward_ttt) and we count the leading drafts equal to
the target's own next tokens. Mean acceptance length = 1 + mean leading hits: what the engine
measures when it verifies every position (it verifies only after accepted runs, a slightly
different sample of positions; benchmarks/training/draft_eval.py measures that).

The full-data first stage is the shipped head's own first stage (its checkpoint in the training
work dir) when present, else trained here with ``--train-frac 1``. Writes
benchmarks/results/eagle_scaling.{json,png} and prints the table, with a log-linear fit of
accepted drafts per step against training tokens extrapolated to the 2.5 target (an
extrapolation, and it says so).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from training.common import EAGLE_DIR, REPO_ROOT, atomic_save, data_dir, set_threads, work_dir
from training.data import Seq, collate, load_shards, make_batches
from workers.eagle_head import EagleHead, load_head
from workers.model_loader import cache_dir, load_model

TARGET_LEN = 2.5  # issue 8: held-out chat, greedy, K = 4


def heldout_sequences(num_prompts: int, max_tokens: int, threads: int) -> list[Seq]:
    """The target's greedy answers to eval-split prompts, with its hidden states (cached, one shard)."""
    d = cache_dir() / "draft-heldout-data" / f"heldout_{num_prompts}x{max_tokens}"
    if not (d / "shard_00000.pt").exists():
        from training.datagen import answer, recording_engine
        from training.prompts import make_prompts

        set_threads(threads)
        engine, rec = recording_engine(max_num_seqs=num_prompts)
        prompts = [p["text"] for p in make_prompts(num_prompts, "eval", seed=1)]  # draft_eval's prompts come first
        print(f"[scaling] held-out set: target answers {num_prompts} eval prompts x {max_tokens} tokens", flush=True)
        records = answer(engine, rec, prompts, [{"max_tokens": max_tokens, "temperature": 0.0}] * num_prompts, "h")
        d.mkdir(parents=True, exist_ok=True)
        atomic_save(records, d / "shard_00000.pt")
    return load_shards(d)


@torch.no_grad()
def heldout_acceptance(
    head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor, seqs: list[Seq], k: int
) -> dict[str, Any]:
    """Mean acceptance length at ``k`` drafts and the conditional acceptance per draft position.

    ``embed``, ``lm_head`` [V, hidden]: the target's (SmolLM2 ties them). Anchors are the positions
    the engine drafts from: every committed response token t_{j+1}, j + 1 >= the prompt length.
    (The proposer never drafts EOS; on greedy answers EOS only ends a sequence, so this ignores it.)"""
    head.eval()
    w_draft = lm_head[head.d2t]  # [V_draft, hidden]
    lead = []  # per anchor: leading drafts equal to the target's tokens
    for idxs in make_batches(seqs, 4096, seed=0):
        b = collate(seqs, idxs)
        feats, nxt, mask = b["feats"], b["next_ids"], b["loss_mask"]  # [B, T, hidden], [B, T], [B, T]
        T = feats.shape[1]
        if T <= k:
            continue
        preds = head.forward_ttt(feats[:, :-1], embed[nxt[:, :-1]], k)  # k x [B, T-1, hidden]; [s-1][:, j] = f^_{j+s}
        n = T - k  # anchors j whose k drafts all have a target token: j + k <= T - 1
        hits = []
        for s, pred in enumerate(preds, start=1):
            guess = head.d2t[(pred[:, :n] @ w_draft.t()).argmax(-1)]  # [B, n] target ids
            hits.append(guess == nxt[:, s : s + n])  # t_{j+s+1}
        run = torch.stack(hits, -1).long().cumprod(-1).sum(-1)  # [B, n] leading hits
        anchor = mask[:, :n] & b["valid"][:, k : k + n]  # t_{j+1} is a response token; the chain is in range
        lead.extend(run[anchor].tolist())
    total = len(lead)
    reached = [sum(1 for x in lead if x >= s) for s in range(k + 1)]  # reached[s]: anchors with >= s hits
    return {
        "mean_acceptance_length": 1.0 + sum(lead) / max(total, 1),
        "anchors": total,
        "conditional_per_pos": [round(reached[s] / max(reached[s - 1], 1), 4) for s in range(1, k + 1)],
    }


def head_from_checkpoint(best_pt: Path, like: EagleHead) -> EagleHead:
    """A head with ``like``'s config and the weights of a training loop's best.pt."""
    head = EagleHead(like.cfg)
    head.load_state_dict(torch.load(best_pt, weights_only=False)["model"])
    return head.eval()


SCALING_DIR = cache_dir() / "draft-training" / "scaling"


def train_subset(frac: float, args: argparse.Namespace) -> Path:
    """Train (or find trained) the first stage on ``frac`` of the training sequences of the shards
    present now; named by the shard count too, so points survive adding data (training/datagen.py)."""
    tag = f"s{len(list(data_dir().glob('shard_*.pt')))}-frac{frac:g}"
    out = SCALING_DIR / f"eagle-{tag}"
    if not (out / "training.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "training.train_eagle",
            "--train-frac",
            str(frac),
            "--epochs",
            str(args.epochs),
            "--threads",
            str(args.threads),
            "--max-minutes",
            str(args.max_minutes),
            "--out",
            str(out),
            "--work-name",
            f"scaling-{tag}",
        ]
        print(f"[scaling] {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return out


def fit_log_linear(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares of y = a + b * log2(x); None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    xs = [math.log2(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--fracs",
        default="0.125,0.25,0.5",
        help="training-data shares to train now (1 = every shard present; '' = only evaluate)",
    )
    ap.add_argument("--epochs", type=float, default=12.0, help="as the shipped head's first stage")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=30.0, help="per training run")
    ap.add_argument("--heldout-prompts", type=int, default=48)
    ap.add_argument("--heldout-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args(argv)
    t0 = time.time()
    fracs = sorted({float(f) for f in args.fracs.split(",") if f.strip()})
    heldout = heldout_sequences(args.heldout_prompts, args.heldout_tokens, args.threads)
    set_threads(args.threads)
    target = load_model("smollm2").model
    embed = target.model.embed_tokens.weight.detach().float()  # [V, hidden]
    lm_head = target.lm_head.weight.detach().float()  # [V, hidden] (tied: the same tensor)
    shipped = load_head(EAGLE_DIR)
    shipped_record = json.loads((EAGLE_DIR / "training.json").read_text())
    full_record = shipped_record.get("init_training") or {}

    for f in fracs:
        train_subset(f, args)
    rows: list[dict[str, Any]] = []  # every point trained so far, on whatever data existed then
    for out in sorted(SCALING_DIR.glob("eagle-s*-frac*")):
        if (out / "training.json").exists():
            rec = json.loads((out / "training.json").read_text())
            rows.append(
                {
                    "frac": rec["args"]["train_frac"],
                    "label": out.name.removeprefix("eagle-"),
                    "source": str(out),
                    "head": load_head(out),
                    "record": rec,
                }
            )
    stage1_best = work_dir("eagle") / "best.pt"
    if stage1_best.exists() and full_record:  # the shipped head's own first stage: the same recipe, all 10 shards
        rows.append(
            {
                "frac": 1.0,
                "label": "s10-frac1 (shipped's stage 1)",
                "source": str(stage1_best),
                "head": head_from_checkpoint(stage1_best, shipped),
                "record": full_record,
            }
        )
    rows.sort(key=lambda r: r["record"].get("train_response_tokens") or 0)
    results = []
    for r in rows + [
        {
            "frac": None,
            "label": "shipped (+ training-time test)",
            "source": str(EAGLE_DIR),
            "head": shipped,
            "record": shipped_record,
        }
    ]:
        m = heldout_acceptance(r["head"], embed, lm_head, heldout, args.k)
        curve = r["record"].get("curve", {})
        val_top1 = max(curve.get("val_top1", [float("nan")]))
        results.append(
            {
                "frac": r["frac"],
                "train_response_tokens": r["record"].get("train_response_tokens"),
                "val_top1_best": val_top1,
                "source": r["source"],
                "label": r["label"],
                **m,
            }
        )
    first = [x for x in results if x["frac"] is not None]
    fit = fit_log_linear([(x["train_response_tokens"], x["mean_acceptance_length"] - 1.0) for x in first])
    need = None
    if fit is not None and fit[1] > 0:
        need = 2 ** ((TARGET_LEN - 1.0 - fit[0]) / fit[1])
    print(
        f"\nEAGLE head, held-out chat ({args.heldout_prompts} prompts x {args.heldout_tokens} tokens, greedy, "
        f"K={args.k}, teacher-forced):"
    )
    print(
        f"{'first stage on (shards, share)':32s} {'train tokens':>12s} {'val top1':>8s} {'held-out len':>12s}  "
        "conditional per draft"
    )
    for x in results:
        print(
            f"{x['label']:32s} {x['train_response_tokens']:>12} "
            f"{x['val_top1_best']:8.3f} {x['mean_acceptance_length']:12.3f}  {x['conditional_per_pos']}"
        )
    if fit is not None:
        print(
            f"fit: accepted drafts per step = {fit[0]:.3f} + {fit[1]:.3f} * log2(train tokens)"
            + (
                f"; reaching {TARGET_LEN} by this trend needs ~{need:.3g} response tokens "
                f"({need / first[-1]['train_response_tokens']:.0f}x the largest set): an extrapolation"
                if need
                else ""
            )
        )
    out = {
        "benchmark": "eagle_scaling",
        "args": vars(args),
        "results": results,
        "fit": {"intercept": fit[0], "per_doubling": fit[1]} if fit else None,
        "tokens_for_target": need,
        "target_len": TARGET_LEN,
        "wall_s": time.time() - t0,
    }
    from benchmarks.common import RESULTS_DIR, figure, save_result

    fig, (ax,) = figure()
    xs = [x["train_response_tokens"] for x in first]
    ax.plot(xs, [x["mean_acceptance_length"] for x in first], "o-", label="first stage, held-out")
    s = results[-1]
    ax.plot([s["train_response_tokens"]], [s["mean_acceptance_length"]], "s", label="shipped (+ training-time test)")
    if fit is not None:
        hi = max(xs) * 64
        grid = [min(xs) * 2 ** (i / 4) for i in range(int(4 * math.log2(hi / min(xs))) + 1)]
        ax.plot(grid, [1 + fit[0] + fit[1] * math.log2(g) for g in grid], ":", label="log-linear fit (extrapolated)")
    ax.axhline(TARGET_LEN, color="grey", lw=0.8, ls="--", label=f"target {TARGET_LEN}")
    ax.set_xscale("log")
    ax.set_xlabel("training response tokens")
    ax.set_ylabel(f"mean acceptance length, K={args.k}")
    ax.legend(fontsize=8)
    save_result(RESULTS_DIR / "eagle_scaling", out, fig, title="EAGLE head: held-out acceptance vs training data")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
