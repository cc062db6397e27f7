"""Distil a small draft model from SmolLM2-135M-Instruct on the target's own responses (CPU).

    nice -n 19 python -m training.datagen                 # once: the target's responses + hidden states
    nice -n 19 python -m training.train_draft             # resumable; writes models/smollm2-draft/

The draft is a plain Hugging Face Llama (so ``load_model(<dir>)``, the draft-model proposer and
the draft worker use it unchanged) with the target's tokenizer, embeddings and tied LM head
(frozen) and ``--layers`` of the target's decoder layers as its initialisation (default: the first
two and the last two, an early-exit skeleton whose last layers already write into the LM head's
space). Its per-token cost is a few layers plus the LM head: see the MANIFEST for the measured
ratio to the target.

Loss: KL(target || draft) of the next-token distributions (the target's comes from its stored
final-norm features through the shared LM head, so no logits were stored), plus ``--ce-weight`` x
cross-entropy on the token the target actually wrote. Both are computed over the draft vocabulary
(the most frequent tokens of the target's outputs, covering ~99% of them): the LM head over 8k
rows instead of 49k makes a training step ~2x cheaper, and the frozen head keeps the other rows'
logits where the target's embedding puts them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from training.common import DRAFT_DIR, set_threads, work_dir
from training.data import coverage, draft_vocab, load_shards, split
from training.loop import LoopConfig, train
from workers.model_loader import DRAFT_VOCAB_FILE, load_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def build_draft(target: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """A Llama with the target's config but ``len(layers)`` layers, copied from the target's ``layers``."""
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[: len(layers)]
    draft = LlamaForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": target.model.embed_tokens.weight, "model.norm.weight": target.model.norm.weight}
    tsd = target.state_dict()
    for new_i, old_i in enumerate(layers):
        pre = f"model.layers.{old_i}."
        for k, v in tsd.items():
            if k.startswith(pre):
                sd[f"model.layers.{new_i}." + k[len(pre) :]] = v
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    draft.tie_weights()
    return draft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="0,1,28,29", help="target layers the draft starts from")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=45.0)
    ap.add_argument("--out", default=str(DRAFT_DIR))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    work = work_dir("draft")
    t_start = time.time()

    target = load_model("smollm2")
    tcfg = target.model.config
    layers = [int(x) for x in args.layers.split(",")]
    draft = build_draft(target.model, layers)
    draft.model.embed_tokens.weight.requires_grad_(False)  # tied with lm_head: the target's, frozen
    seqs = load_shards()
    train_seqs, val_seqs = split(seqs, seed=args.seed)
    eos = [int(tcfg.eos_token_id)] if tcfg.eos_token_id is not None else []
    d2t = draft_vocab(train_seqs, args.draft_vocab, always=eos)
    cov = coverage(val_seqs, d2t)
    w_draft = target.model.model.embed_tokens.weight.detach()[d2t].clone()  # [V_draft, hidden]
    full_to_draft = torch.full((tcfg.vocab_size,), -100, dtype=torch.long)
    full_to_draft[d2t] = torch.arange(len(d2t))

    def loss_fn(b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        h = draft.model(input_ids=b["ids"], attention_mask=b["valid"].long()).last_hidden_state  # [B, T, hidden]
        m = b["loss_mask"]  # position p predicts t_{p+1}, a response token
        s_logits = h[m] @ w_draft.t()  # [N, V_draft]
        with torch.no_grad():
            t_logits = b["feats"][m] @ w_draft.t()  # the target's logits from its own features
            t_logp = t_logits.log_softmax(-1)
        s_logp = s_logits.log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        hard = full_to_draft[b["next_ids"][m]]  # [N] the target's next token, -100 outside the draft vocab
        ce = F.cross_entropy(s_logits, hard, ignore_index=-100)
        with torch.no_grad():
            top1 = (s_logits.argmax(-1) == t_logits.argmax(-1)).float().mean()
        loss = kl + args.ce_weight * ce
        return loss, {"loss": float(loss), "kl": float(kl), "ce": float(ce), "top1": float(top1)}

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
    params = [p for p in draft.parameters() if p.requires_grad]
    draft.train()
    curve = train(params, draft, loss_fn, train_seqs, val_seqs, cfg, work, "draft")
    draft.eval()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(str(out))  # bf16 on disk (load_model reads it back as fp32)
    # the vocabulary the loss covered: the proposer drafts only among these ids (workers/proposers/draft_model.py)
    (out / DRAFT_VOCAB_FILE).write_text(
        json.dumps(
            {
                "why": f"the {len(d2t)} most frequent tokens of the target's training responses (at most --draft-vocab, "
                "+ EOS): the rows of the tied LM head the distillation trained; drafting outside them loses agreement",
                "token_ids": d2t.tolist(),
            }
        )
        + "\n"
    )
    src = Path(target.path)
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    (out / "training.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "init_layers": layers,
                "num_train_sequences": len(train_seqs),
                "num_val_sequences": len(val_seqs),
                "train_response_tokens": sum(s.n - s.num_prompt_tokens + 1 for s in train_seqs),
                "draft_vocab_coverage_val": round(cov, 4),
                "curve": curve,
                "wall_minutes_this_invocation": round((time.time() - t_start) / 60, 1),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
