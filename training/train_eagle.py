"""Train the EAGLE draft head for SmolLM2-135M-Instruct on the target's own features (CPU).

    nice -n 19 python -m training.datagen                 # once: the target's responses + hidden states
    nice -n 19 python -m training.train_eagle             # resumable; writes models/smollm2-eagle/

Loss (EAGLE, arXiv 2401.15077, section 3): smooth-L1 between the predicted and the true next
feature, plus ``--p-weight`` x the cross-entropy of the head's token distribution against the
target's (both through the target's frozen LM head, restricted to the draft vocabulary). Inputs
get uniform noise of ``--noise`` x the feature RMS, as EAGLE does, so the head tolerates its own
slightly wrong features when it drafts several tokens in a row.

Training-time test (``--ttt-steps S``, EAGLE-3): the loss also covers drafts 2 .. S of the chain,
where the head reads its own predicted feature (EagleHead.forward_ttt), weighted ``--ttt-decay``
per step; the validation score that picks the kept checkpoint is then the expected acceptance
length over S drafts from the per-step top-1 agreement, 1 + a1 + a1 a2 + ... .

Initialisation: the decoder layer starts as a copy of the target's last layer, and ``fc`` as
``[I | I]`` (feature + embedding), which trains faster than random on this budget; or, with
``--init DIR``, from a trained head (fine-tuning a step-1 head with the unrolled loss).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from training.common import EAGLE_DIR, set_threads, work_dir
from training.data import coverage, draft_vocab, load_shards, split
from training.loop import LoopConfig, train
from workers.eagle_head import EagleHead, head_config_for, load_head, save_head
from workers.model_loader import load_model


def init_from_target(head: EagleHead, target) -> None:
    """Layer <- the target's last decoder layer (residual branches scaled by 0.1); fc <- [I | I]."""
    L = target.model.layers[-1]
    a, mlp = L.self_attn, L.mlp
    H = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], 1))
        head.in_norm.copy_(L.input_layernorm.weight)
        head.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0))
        head.o.weight.copy_(a.o_proj.weight)
        head.post_norm.copy_(L.post_attention_layernorm.weight)
        head.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0))
        head.down.weight.copy_(mlp.down_proj.weight)
        # The last layer writes updates sized for the target's (large, pre-norm) residual stream; the head's
        # stream is post-norm features (RMS ~2). Shrinking the residual branches keeps the initial prediction
        # near fc's output instead of swamping it (measured: initial smooth-L1 9.6 at scale 1).
        head.o.weight.mul_(0.1)
        head.down.weight.mul_(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--p-weight", type=float, default=0.5, help="weight of the token cross-entropy")
    ap.add_argument("--noise", type=float, default=0.1, help="uniform input noise, x feature RMS")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=45.0)
    ap.add_argument("--ttt-steps", type=int, default=1, help="drafting steps unrolled in the loss (1 = EAGLE-1)")
    ap.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of step s: decay ** (s - 1)")
    ap.add_argument("--init", help="start from this trained head directory instead of the target's last layer")
    ap.add_argument(
        "--train-frac",
        type=float,
        default=1.0,
        help="train on this share of the training sequences (the data-scaling curve, training/scaling.py)",
    )
    ap.add_argument("--out", default=str(EAGLE_DIR))
    ap.add_argument(
        "--work-name", help="checkpoint / log directory name in the training cache (default: from the stage)"
    )
    args = ap.parse_args(argv)
    set_threads(args.threads)
    if not 0.0 < args.train_frac <= 1.0:
        raise SystemExit(f"--train-frac must be in (0, 1], got {args.train_frac}")
    torch.manual_seed(args.seed)
    name = "eagle" if args.ttt_steps == 1 and not args.init else f"eagle-ttt{args.ttt_steps}"
    if args.work_name is None:  # a subset never resumes the full set's run
        args.work_name = name if args.train_frac == 1.0 else f"{name}-frac{args.train_frac:g}"
    work = work_dir(args.work_name)
    t_start = time.time()

    target = load_model("smollm2")
    tcfg = target.model.config
    seqs = load_shards()
    train_seqs, val_seqs = split(seqs, seed=args.seed)
    train_seqs = train_seqs[: max(1, round(len(train_seqs) * args.train_frac))]  # split shuffled: a random subset
    eos = [int(tcfg.eos_token_id)] if tcfg.eos_token_id is not None else []
    d2t = draft_vocab(train_seqs, args.draft_vocab, always=eos)  # [V_draft]
    cov = coverage(val_seqs, d2t)
    if args.init:
        head = load_head(args.init)
        if not torch.equal(head.d2t, d2t):
            raise SystemExit(
                f"--init {args.init}: its draft vocabulary differs from this data's top {args.draft_vocab}"
            )
    else:
        head = EagleHead(head_config_for(tcfg, len(d2t)))
        init_from_target(head, target.model)
        head.d2t.copy_(d2t)
    embed = target.model.model.embed_tokens.weight.detach()  # [V, hidden] frozen
    w_draft = embed[d2t].clone()  # [V_draft, hidden]: the tied LM head's rows for the draft vocabulary
    full_to_draft = torch.full((tcfg.vocab_size,), -100, dtype=torch.long)
    full_to_draft[d2t] = torch.arange(len(d2t))
    feat_rms = float(torch.cat([s.hidden[:64].float() for s in train_seqs[:200]]).pow(2).mean().sqrt())
    del target

    def step_loss(pred: torch.Tensor, tgt: torch.Tensor, m: torch.Tensor, hard_ids: torch.Tensor):
        """One drafting step: pred/tgt [B, T', hidden], m [B, T'] -> (loss, top-1 vs the target, hit on its token)."""
        pred_m, tgt_m = pred[m], tgt[m]  # [N, hidden]
        vloss = F.smooth_l1_loss(pred_m, tgt_m)
        s_logits = pred_m @ w_draft.t()  # [N, V_draft]
        with torch.no_grad():
            t_logits = tgt_m @ w_draft.t()
            t_prob = t_logits.softmax(-1)
        ploss = -(t_prob * s_logits.log_softmax(-1)).sum(-1).mean()
        with torch.no_grad():
            top1 = (s_logits.argmax(-1) == t_logits.argmax(-1)).float().mean()
            hard = full_to_draft[hard_ids[m]]  # the token the target actually wrote next
            hit = ((s_logits.argmax(-1) == hard) & (hard >= 0)).float().mean()
        return vloss, ploss, float(top1), float(hit)

    def loss_fn(b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        feats = b["feats"]  # [B, T, hidden]
        T = feats.shape[1]
        x_feats = feats[:, :-1]  # f_j
        if head.training and args.noise > 0:
            x_feats = x_feats + (torch.rand_like(x_feats) * 2 - 1) * (args.noise * feat_rms)
        next_emb = embed[b["next_ids"][:, :-1]]  # [B, T-1, hidden] embed(t_{j+1})
        preds = head.forward_ttt(x_feats, next_emb, min(args.ttt_steps, T - 1))
        loss = feats.new_zeros(())
        metrics: dict[str, float] = {}
        accept_len, reach = 1.0, 1.0
        for s, pred in enumerate(preds, start=1):  # pred[:, j] = f^_{j+s}, j < T-1; valid for j + s <= T-1
            n = T - s  # anchors with a target feature
            vloss, ploss, top1, hit = step_loss(pred[:, :n], feats[:, s:], b["loss_mask"][:, s:], b["next_ids"][:, s:])
            loss = loss + args.ttt_decay ** (s - 1) * (vloss + args.p_weight * ploss)
            sfx = "" if s == 1 else f"_{s}"
            metrics.update(
                {f"vloss{sfx}": float(vloss), f"ploss{sfx}": float(ploss), f"top1{sfx}": top1, f"acc_next{sfx}": hit}
            )
            reach *= top1
            accept_len += reach
        metrics["loss"] = float(loss)
        metrics["accept_len"] = accept_len
        return loss, metrics

    cfg = LoopConfig(
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        warmup_steps=30,
        weight_decay=0.0,
        seed=args.seed,
        ckpt_minutes=4.0,
        eval_every=100,
        max_minutes=args.max_minutes,
    )
    params = [p for p in head.parameters() if p.requires_grad]
    head.train()
    curve = train(
        params,
        head,
        lambda b: _train_or_eval(head, loss_fn, b),
        train_seqs,
        val_seqs,
        cfg,
        work,
        "eagle",
        best_key="accept_len" if args.ttt_steps > 1 else "top1",
    )
    head.eval()
    from pathlib import Path

    out = Path(args.out)
    init_record = None  # the run that made the --init head (read before --out, possibly the same dir, is written)
    if args.init and (Path(args.init) / "training.json").exists():
        init_record = json.loads((Path(args.init) / "training.json").read_text())
    save_head(head, out)
    (out / "training.json").write_text(
        json.dumps(
            {
                "init_training": init_record,
                "args": vars(args),
                "num_train_sequences": len(train_seqs),
                "num_val_sequences": len(val_seqs),
                "train_response_tokens": sum(s.n - s.num_prompt_tokens + 1 for s in train_seqs),
                "draft_vocab_coverage_val": round(cov, 4),
                "feature_rms": feat_rms,
                "curve": curve,
                "wall_minutes_this_invocation": round((time.time() - t_start) / 60, 1),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"saved {out}")
    return 0


def _train_or_eval(head: EagleHead, loss_fn, b):
    """The loop calls the loss under no_grad for evaluation: switch off the input noise there."""
    if not torch.is_grad_enabled():
        head.eval()
        try:
            return loss_fn(b)
        finally:
            head.train()
    return loss_fn(b)


if __name__ == "__main__":
    raise SystemExit(main())
