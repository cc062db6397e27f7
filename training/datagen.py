"""Build the drafts' training set from the target itself: its own responses and hidden states.

    nice -n 19 python -m training.datagen --max-shards 10 --threads 1 --minutes 60   # resumable: rerun to continue

For each training prompt (training/prompts.py) the target answers through our own engine
(LLMEngine, continuous batching, fp32), greedily for most prompts and sampled at T=0.7 for
``--sampled-frac`` of them (so the drafts also see the target's less likely continuations).
A recording proposer with ``needs_hidden_states`` rides along: it never proposes anything (every
step stays plain, so the outputs are exactly plain decoding), but the engine hands it the target's
final-norm hidden state at every position it has read, prompt included, for free (they are
computed by the forward anyway). Per sequence we store the token ids and those hidden states in
fp16; the target's distribution at any position is ``softmax(lm_head(hidden))``, so the
distillation teacher needs no separate logits file.

Shards of ``--shard`` prompts are written as they finish (``shard_00000.pt``...); a rerun skips
shards that exist, and ``--minutes`` bounds the wall time of one invocation.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Sequence

import torch

from training.common import Progress, atomic_save, data_dir, set_threads
from training.prompts import make_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model
from workers.proposers.base import ProposalRequest, Proposals, Proposer


class HiddenRecorder(Proposer):
    """A proposer that proposes nothing and keeps the target's hidden states of every request."""

    name = "recorder"
    needs_hidden_states = True

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}  # request id -> latest view [num_computed, hidden]
        self.done: dict[str, tuple[list[int], torch.Tensor]] = {}

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        for r in requests:
            assert r.hidden_states is not None and r.hidden_states.shape[0] == len(r.token_ids) - 1
            self.last[r.request_id] = r.hidden_states
        return Proposals([[] for _ in requests], [None for _ in requests])

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        h = self.last.pop(request_id, None)
        if h is None:
            return
        n = h.shape[0]  # positions 0..n-1 have features; tokens 0..n are what they were read with / predict
        self.done[request_id] = (list(token_ids[: n + 1]), h.to(torch.float16).clone())


def recording_engine(max_num_seqs: int = 32) -> tuple[LLMEngine, HiddenRecorder]:
    """The target in our engine (fp32) with a :class:`HiddenRecorder` as its only proposer."""
    rec = HiddenRecorder()
    cfg = EngineConfig(
        model="smollm2",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        max_num_batched_tokens=512,
        num_speculative_tokens=1,
    )
    return LLMEngine(cfg, load_model("smollm2"), proposers={"recorder": rec}), rec


def answer(
    engine: LLMEngine, rec: HiddenRecorder, prompts: Sequence[str], params: Sequence[dict], prefix: str
) -> list[dict]:
    """The target's answer to each chat prompt, run to completion as one continuous batch: one record
    ``{"token_ids", "hidden", "num_prompt_tokens"}`` per prompt, in order (what training/data.py loads)."""
    rids, lens = [], []
    for j, (text, sp) in enumerate(zip(prompts, params)):
        ids = engine.tokenize_chat([{"role": "user", "content": text}])
        rids.append(f"{prefix}-{j}")
        lens.append(len(ids))
        engine.add_request(rids[-1], ids, sp, proposer="recorder")
    while engine.has_work():
        engine.step()
    records = []
    for rid, n_prompt in zip(rids, lens):
        toks, hid = rec.done.pop(rid)
        records.append({"token_ids": toks, "hidden": hid, "num_prompt_tokens": n_prompt})
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=1600)
    ap.add_argument("--shard", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--sampled-frac", type=float, default=0.25, help="share of prompts answered at T=0.7")
    ap.add_argument("--minutes", type=float, default=18.0, help="stop starting new shards after this long")
    ap.add_argument("--max-shards", type=int, default=None, help="only the first N shards (the shipped drafts: 10)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    out = data_dir()
    out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args.num_prompts, "train", seed=args.seed)
    (out / "meta.json").write_text(json.dumps({"args": vars(args), "num_prompts": len(prompts)}, indent=1))
    shards = [prompts[i : i + args.shard] for i in range(0, len(prompts), args.shard)][: args.max_shards]
    todo = [i for i in range(len(shards)) if not (out / f"shard_{i:05d}.pt").exists()]
    prog = Progress(len(shards), out / "datagen.log", "shards", every_s=0, done=len(shards) - len(todo))
    prog.write(f"datagen: {len(prompts)} prompts in {len(shards)} shards, {len(todo)} to do -> {out}")
    if not todo:
        return 0

    engine, rec = recording_engine()
    t_start = time.time()
    ntok = 0
    for si in todo:
        if time.time() - t_start > args.minutes * 60:
            prog.write(f"time budget of {args.minutes} min reached; rerun to continue")
            break
        rng = random.Random(f"{args.seed}-{si}")
        params, sampled = [], []
        for _ in shards[si]:
            sampled.append(rng.random() < args.sampled_frac)
            params.append(
                {
                    "max_tokens": args.max_tokens,
                    "temperature": 0.7 if sampled[-1] else 0.0,
                    "seed": rng.randrange(1 << 30) if sampled[-1] else None,
                }
            )
        answers = answer(engine, rec, [p["text"] for p in shards[si]], params, prefix=f"s{si}")
        records = []
        for a, p, smp in zip(answers, shards[si], sampled):
            ntok += len(a["token_ids"]) - a["num_prompt_tokens"]
            records.append({**a, "sampled": smp, "category": p["category"], "prompt": p["text"]})
        atomic_save(records, out / f"shard_{si:05d}.pt")
        prog.update(
            prog.done + 1, f"response tokens this run {ntok} ({ntok / (time.time() - t_start):.0f} tok/s)", force=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
