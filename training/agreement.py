"""Teacher-forced agreement of a draft model with the target, on held-out chat prompts.

    python -m training.agreement [--draft models/smollm2-draft] [--prompts 6] [--tokens 64]

Why: when speculation accepts little, this separates "the draft is weak" from "the proposer
path is broken". The target greedily answers each held-out prompt; the draft then reads the
same tokens in one forward, and we count, over the response positions t, how often the draft's
argmax at t equals the target's next token (top-1), and how often it does at t+1 given it did
at t. With a correct proposer, greedy mean acceptance length at K drafts is about
1 + a1 + a1 * a2 + ..., where a1 is the top-1 rate and a2.. the conditional rates. The draft's
argmax is taken as the proposer takes it: among its ``draft_vocab.json`` ids when it has one.
Measured for models/smollm2-draft: top-1 0.242, conditional 0.207, i.e. ~1.30, close to the 1.34
that benchmarks/training/draft_eval.py measures through the engine (over the whole vocabulary, as before
the draft vocabulary shipped: 0.201, 0.171, ~1.24 against 1.27).
"""

from __future__ import annotations

import argparse

import torch

from training.common import DRAFT_DIR
from training.prompts import eval_prompts
from workers.model_loader import load_model


def agreement(target_ids: list[int], draft_argmax: list[int], prompt_len: int) -> tuple[int, int, int, int]:
    """(hits, positions, consecutive hits, hits followed by a position) over the response.

    ``target_ids`` is prompt + response; ``draft_argmax[t]`` is the draft's guess for token t+1.
    """
    ok = [draft_argmax[t] == target_ids[t + 1] for t in range(prompt_len - 1, len(target_ids) - 1)]
    pairs = list(zip(ok, ok[1:]))
    return sum(ok), len(ok), sum(a and b for a, b in pairs), sum(a for a, _ in pairs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DRAFT_DIR))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    target, draft = load_model("smollm2"), load_model(a.draft)
    tok = target.tokenizer
    totals = [0, 0, 0, 0]
    for msg in eval_prompts(a.prompts):
        prompt = list(
            tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        with torch.inference_mode():
            ids = target.model.generate(torch.tensor([prompt]), max_new_tokens=a.tokens, do_sample=False)[0].tolist()
            logits = draft.model.float()(torch.tensor([ids])).logits[0]  # [len(ids), V]
            if draft.draft_vocab is not None:  # as the proposer drafts: only among the trained vocabulary
                vocab = torch.tensor(draft.draft_vocab)
                guess = vocab[logits[:, vocab].argmax(-1)].tolist()
            else:
                guess = logits.argmax(-1).tolist()
        hit, n, hit2, n2 = agreement(ids, guess, len(prompt))
        totals = [x + y for x, y in zip(totals, (hit, n, hit2, n2))]
        print(f"{msg[:60]!r}: {hit}/{n} top-1", flush=True)
    top1, cond = totals[0] / max(totals[1], 1), totals[2] / max(totals[3], 1)
    est = 1 + top1 * sum(cond**i for i in range(4))
    print(
        f"top-1 {top1:.3f}; P(hit at t+1 | hit at t) {cond:.3f}; "
        f"implied greedy mean acceptance length at K=4 ~{est:.2f}"
    )


if __name__ == "__main__":
    main()
