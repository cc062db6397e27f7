"""Coupled verification vs rejection sampling: acceptance of the trained drafts on sampled chat.

    python -m benchmarks.fidelity.verification_bench [--prompts 8] [--tokens 48]

The real SmolLM2 with the shipped draft model and EAGLE head, K=4, sampled requests at T=0.7 and
T=1.0 (seeded), the same prompts and seeds for both verification rules, in one run. Coupled: a draft
is accepted iff it equals the target's position-keyed sample, drafts sampled with the same noise.
Rejection: Leviathan et al., accept with min(1, p/q). Reports the acceptance rate, the mean
acceptance length and the acceptance per draft position (accepted at position i / verifies), and
writes benchmarks/results/verification_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    format_table,
    progress,
    save_result,
    set_threads,
)
from training.common import DRAFT_DIR, EAGLE_DIR
from training.prompts import eval_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model
from workers.proposers.draft_model import DraftModelProposer
from workers.proposers.eagle import EagleProposer

K = 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    set_threads(2)
    target = load_model("smollm2")
    draft = load_model(str(DRAFT_DIR))
    n = args.prompts
    engines = {}
    for rule in ("coupled", "rejection"):
        proposers = {
            "draft_model": DraftModelProposer(
                draft.model,
                num_slots=n,
                max_model_len=1024,
                target_vocab_size=target.model.config.vocab_size,
                vocab_ids=draft.draft_vocab,
            ),
            "eagle": EagleProposer(str(EAGLE_DIR), target.model, num_slots=n, max_model_len=1024),
        }
        engines[rule] = LLMEngine(
            EngineConfig(
                max_num_seqs=n,
                max_model_len=1024,
                num_speculative_tokens=K,
                verification=rule,
                proposers=[{"name": p} for p in proposers],
            ),
            target,
            proposers=proposers,
        )
    prompts = [engines["coupled"].tokenize_chat([{"role": "user", "content": m}]) for m in eval_prompts(n)]
    rows: list[dict[str, Any]] = []
    cases = [(t, p, rule) for t in (0.7, 1.0) for p in ("draft_model", "eagle") for rule in ("coupled", "rejection")]
    for temp, prop, rule in progress(cases, desc="cases"):
        eng = engines[rule]
        eng.stats.clear()
        for i, prompt in enumerate(prompts):
            eng.add_request(
                f"{rule}-{prop}-{temp}-{i}",
                prompt,
                {"max_tokens": args.tokens, "temperature": temp, "seed": 1000 + i},
                speculation="on",
                proposer=prop,
            )
        while eng.has_work():
            eng.step()
        st = eng.stats[prop]
        per_pos = [a / max(st.num_drafts, 1) for a in st.accepted_per_pos] + [0.0] * (K - len(st.accepted_per_pos))
        rows.append(
            {
                "temperature": temp,
                "proposer": prop,
                "verification": rule,
                "acceptance_rate": st.acceptance_rate,
                "mean_acceptance_length": st.mean_acceptance_length,
                "verifies": st.num_drafts,
                "per_pos": per_pos,
                **{f"pos{i + 1}": v for i, v in enumerate(per_pos)},
            }
        )
    table = format_table(
        rows,
        [
            ("temperature", "T", ".1f"),
            ("proposer", "proposer", "s"),
            ("verification", "verification", "s"),
            ("acceptance_rate", "acceptance rate", ".3f"),
            ("mean_acceptance_length", "mean acc. length", ".3f"),
            ("pos1", "pos 1", ".3f"),
            ("pos2", "pos 2", ".3f"),
            ("pos3", "pos 3", ".3f"),
            ("pos4", "pos 4", ".3f"),
            ("verifies", "verifies", "d"),
        ],
        title=f"Acceptance per draft position, K={K}, {n} held-out chat prompts x {args.tokens} tokens, seeded",
    )
    env = env_info()
    print(table)
    print(f"CPU: {env['cpu']}; engine dtype {engines['coupled'].dtype}")
    fig, axes = figure(ncols=4, width=4.2)
    for ax, (temp, prop) in zip(axes, [(t, p) for t in (0.7, 1.0) for p in ("draft_model", "eagle")]):
        sel = {r["verification"]: r["per_pos"] for r in rows if r["temperature"] == temp and r["proposer"] == prop}
        bar_panel(ax, [f"pos {i + 1}" for i in range(K)], sel, title=f"{prop}, T={temp}", ylabel="accepted / verifies")
    result = {"env": env, "args": vars(args), "k": K, "rows": rows, "dtype": str(engines["coupled"].dtype)}
    save_result(RESULTS_DIR / "verification_bench", result, fig, title="Coupled vs rejection")
    return 0


if __name__ == "__main__":
    sys.exit(main())
