"""Evaluate the trained drafts: acceptance per proposer, K and temperature, and c=1 speed vs plain.

    nice -n 19 python -m benchmarks.training.draft_eval [--quick]

SmolLM2-135M-Instruct, fp32, our engine. Proposers: the distilled draft model
(models/smollm2-draft), the EAGLE head (models/smollm2-eagle), n-gram and suffix.

A. Acceptance: held-out chat prompts (training/prompts.py ``eval_prompts``: subjects never seen in
   training) and copy-heavy prompts (benchmarks/speculation/spec_bench.py), greedy and at temperature 0.7
   (seeded), K = 2, 4, 6. All prompts of a set run as one batch (acceptance does not depend on
   batching); mean acceptance length = 1 + accepted / drafts and acceptance rate = accepted /
   draft tokens, the engine's own definitions (workers/stats.py). Greedy outputs are checked
   token for token against plain decoding.
B. Speed at concurrency 1 on held-out chat, greedy: tokens/s of plain and of each proposer at its
   K, best of 2 rounds per (prompt, method), interleaved so load drift favours none.
C. Per-token cost: one 1-token decode step of the draft's ModelRunner vs the target's (same dtype),
   and one EAGLE drafting step, median of repeated steps.

Writes benchmarks/results/draft_eval.{json,png}; prints the tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    format_table,
    merge_runs,
    progress,
    ratio,
    run_closed_loop,
    save_result,
    set_threads,
    warmup_engine,
    write_json,
)
from benchmarks.speculation.spec_bench import COPY_PROMPTS
from training.common import DRAFT_DIR, EAGLE_DIR
from training.prompts import eval_prompts

METHODS = ("draft_model", "eagle", "ngram", "suffix")
MAX_MODEL_LEN = 1024


def step_cost_ms(runner: Any, n: int = 40) -> float:
    """Median ms of a 1-token decode step at position ~64 (after a short prefill), batch 1."""
    from workers.runner import StepBatch

    runner.forward(StepBatch([0], [0], [list(range(10, 74))], [[63]]))
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        runner.forward(StepBatch([0], [64 + i], [[100 + i]], [[0]]))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def eagle_step_cost_ms(prop: Any, hidden: int, n: int = 40) -> float:
    """Median ms of one EAGLE drafting step (one pair through fc + layer + the draft-vocab head)."""
    from workers.proposers.base import ProposalRequest

    toks = list(range(10, 75))
    hs = torch.randn(len(toks) - 1, hidden)
    prop.propose([ProposalRequest("cost", toks, 60, 1, hidden_states=hs)])
    times = []
    for i in range(n):
        toks.append(100 + i)
        hs = torch.cat([hs, torch.randn(1, hidden)])
        t0 = time.perf_counter()
        prop.propose([ProposalRequest("cost", toks, 60, 1, hidden_states=hs)])
        times.append(time.perf_counter() - t0)
    prop.finish("cost")
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts, few tokens, K=4 only (a smoke run)")
    ap.add_argument("--draft", default=str(DRAFT_DIR))
    ap.add_argument("--eagle", default=str(EAGLE_DIR))
    ap.add_argument("--num-chat", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--speed-tokens", type=int, default=96)
    ap.add_argument("--speed-rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    ks = [4] if args.quick else [2, 4, 6]
    n_chat, n_tok = (2, 12) if args.quick else (args.num_chat, args.tokens)
    set_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    from workers.config import EngineConfig
    from workers.decision import fixed_k
    from workers.engine import LLMEngine
    from workers.model_loader import load_model
    from workers.proposers.draft_model import DraftModelProposer
    from workers.proposers.eagle import EagleProposer
    from workers.proposers.ngram import NgramProposer
    from workers.proposers.suffix import SuffixProposer
    from workers.runner import ModelRunner

    t_start = time.perf_counter()
    env = env_info()
    loaded = load_model("smollm2")
    draft = load_model(args.draft)
    chat_msgs = eval_prompts(n_chat)
    copy_msgs = [m for _, _, m in COPY_PROMPTS[: 2 if args.quick else 4]]
    batch = max(n_chat, len(copy_msgs))
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_num_seqs=batch,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=512,
            num_speculative_tokens=max(ks),
            num_threads=args.threads,
        ),
        loaded,
        proposers={
            "draft_model": DraftModelProposer(
                draft.model,
                num_slots=batch,
                max_model_len=MAX_MODEL_LEN,
                dtype="float32",
                target_vocab_size=loaded.model.config.vocab_size,
                vocab_ids=draft.draft_vocab,
            ),
            "eagle": EagleProposer(args.eagle, loaded.model, num_slots=batch, max_model_len=MAX_MODEL_LEN),
            "ngram": NgramProposer(),
            "suffix": SuffixProposer(),
        },
    )

    def chat(msg: str) -> list[int]:
        return eng.tokenize_chat([{"role": "user", "content": msg}])

    sets = {"chat": [chat(m) for m in chat_msgs], "copy": [chat(m) for m in copy_msgs]}
    for p in METHODS:
        eng.decide = fixed_k(4)
        warmup_engine(eng, sets["chat"][0], 4, proposer=p, speculation="on")

    def run(prompts: list[list[int]], method: str | None, k: int, temp: float, conc: int, label: str):
        if method == "suffix":
            eng.proposers["suffix"] = SuffixProposer()  # cold cache: plain runs must not teach it the answer
        eng.decide = fixed_k(k)
        work = [
            (ids, {"max_tokens": n_tok, "temperature": temp, "seed": 1000 + i if temp else None})
            for i, ids in enumerate(prompts)
        ]
        return run_closed_loop(
            eng, work, conc, proposer=method, speculation="on" if method else "off", name=label, show_progress=False
        )

    # ---------------------------------------------------------------- A. acceptance
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    plain_out = {s: run(ps, None, 0, 0.0, len(ps), f"plain-{s}").outputs() for s, ps in sets.items()}
    jobs = [(s, t, k, m) for s in sets for t in (0.0, 0.7) for k in ks for m in METHODS]
    for s, t, k, m in progress(jobs, desc="A: acceptance", unit="run"):
        r = run(sets[s], m, k, t, len(sets[s]), f"{m}-{s}-K{k}-T{t}")
        tot = r.spec_totals()
        if t == 0.0 and r.outputs() != plain_out[s]:
            mismatches.append(f"{m} {s} K={k}: greedy output differs from plain")
            print(f"!!!!!!!! MISMATCH: {mismatches[-1]}", flush=True)
        rows.append(
            {
                "set": s,
                "temperature": t,
                "k": k,
                "method": m,
                "mean_acceptance_length": tot.mean_acceptance_length,
                "acceptance_rate": tot.acceptance_rate,
                "num_drafts": tot.num_drafts,
                "accepted_per_pos": tot.accepted_per_pos,
                "output_tokens": r.output_tokens,
            }
        )

    out_dir = Path(args.out)
    name = "draft_eval_quick" if args.quick else "draft_eval"
    write_json(
        out_dir / f"{name}.partial.json", {"acceptance": rows, "mismatches": mismatches, "chat_prompts": chat_msgs}
    )

    # ---------------------------------------------------------------- B. speed at c=1
    speed_methods = [("draft_model", 4), ("eagle", 2), ("eagle", 4), ("eagle", 6), ("ngram", 4)]
    speed_prompts = sets["chat"][: args.speed_prompts if not args.quick else 1]
    labels = ["plain"] + [f"{m} K={k}" for m, k in speed_methods]
    best: dict[tuple[int, str], Any] = {}
    jobs_b = [(rnd, i) for rnd in range(1 if args.quick else args.speed_rounds) for i in range(len(speed_prompts))]
    saved_tok = n_tok
    n_tok = 16 if args.quick else args.speed_tokens
    for rnd, i in progress(jobs_b, desc="B: c=1 speed", unit="prompt"):
        order = labels[(i + rnd) % len(labels) :] + labels[: (i + rnd) % len(labels)]
        for lab in order:
            m, k = (None, 0) if lab == "plain" else (lab.split()[0], int(lab.split("=")[1]))
            r = run([speed_prompts[i]], m, k, 0.0, 1, lab)
            if best.get((i, lab)) is None or r.tok_s > best[(i, lab)].tok_s:
                best[(i, lab)] = r
    n_tok = saved_tok
    speed = []
    base = merge_runs("plain", [best[(i, "plain")] for i in range(len(speed_prompts))])
    for lab in labels:
        mr = merge_runs(lab, [best[(i, lab)] for i in range(len(speed_prompts))])
        tot = mr.spec_totals()
        speed.append(
            {
                "method": lab,
                "tok_s": mr.tok_s,
                "vs_plain": ratio(mr.tok_s, base.tok_s),
                "mean_acceptance_length": tot.mean_acceptance_length if tot.num_drafts else None,
                "same_output": mr.outputs() == base.outputs(),
            }
        )

    # ---------------------------------------------------------------- C. per-token cost
    tgt_runner = ModelRunner(loaded.model, 1, 256, torch.float32, "cpu")
    dr_runner = ModelRunner(
        draft.model, 1, 256, torch.float32, "cpu", head_rows=draft.draft_vocab
    )  # as the proposer runs it
    t_ms, d_ms = step_cost_ms(tgt_runner), step_cost_ms(dr_runner)
    e_prop = EagleProposer(args.eagle, loaded.model, num_slots=1, max_model_len=256)
    e_ms = eagle_step_cost_ms(e_prop, loaded.model.config.hidden_size)
    cost = {
        "target_step_ms": t_ms,
        "draft_step_ms": d_ms,
        "draft_over_target": d_ms / t_ms,
        "eagle_step_ms": e_ms,
        "eagle_over_target": e_ms / t_ms,
        "draft_layers": draft.model.config.num_hidden_layers,
        "dtype": "float32",
    }

    # ---------------------------------------------------------------- report
    tables = []
    for s in sets:
        for t in (0.0, 0.7):
            sub = [r for r in rows if r["set"] == s and r["temperature"] == t]
            tables.append(
                format_table(
                    [
                        {
                            "method": m,
                            **{
                                f"K={k} len": next(
                                    r["mean_acceptance_length"] for r in sub if r["k"] == k and r["method"] == m
                                )
                                for k in ks
                            },
                            **{
                                f"K={k} rate": next(
                                    r["acceptance_rate"] for r in sub if r["k"] == k and r["method"] == m
                                )
                                for k in ks
                            },
                        }
                        for m in METHODS
                    ],
                    [("method", "method", "")]
                    + [(f"K={k} len", f"K={k} len", ".2f") for k in ks]
                    + [(f"K={k} rate", f"K={k} rate", ".2f") for k in ks],
                    title=f"Acceptance, {s} prompts ({len(sets[s])} x {n_tok} tokens), "
                    f"{'greedy' if t == 0 else f'T={t}'}: mean acceptance length / acceptance rate",
                )
            )
    tables.append(
        format_table(
            speed,
            [
                ("method", "method", ""),
                ("tok_s", "tok/s", ".1f"),
                ("vs_plain", "vs plain", ".2f"),
                ("mean_acceptance_length", "acc len", ".2f"),
                ("same_output", "same out", ""),
            ],
            title=f"Concurrency 1, held-out chat, greedy, {len(speed_prompts)} prompts x "
            f"{args.speed_tokens} tokens (best of {args.speed_rounds} rounds)",
        )
    )
    tables.append(
        format_table(
            [cost],
            [
                ("target_step_ms", "target ms", ".1f"),
                ("draft_step_ms", "draft ms", ".1f"),
                ("draft_over_target", "draft/target", ".3f"),
                ("eagle_step_ms", "eagle ms", ".2f"),
                ("eagle_over_target", "eagle/target", ".3f"),
            ],
            title="Per-token cost, 1-token step at batch 1, fp32 (median)",
        )
    )
    for tb in tables:
        print("\n" + tb)
    if mismatches:
        print("\nMISMATCHES:\n" + "\n".join(mismatches))

    result = {
        "benchmark": "draft_eval",
        "env": env,
        "ks": ks,
        "tokens": n_tok,
        "chat_prompts": chat_msgs,
        "acceptance": rows,
        "speed_c1": speed,
        "cost": cost,
        "mismatches": mismatches,
        "tables": tables,
        "wall_s": time.perf_counter() - t_start,
    }
    fig, axes = figure(ncols=3, width=5.5)
    for ax, s in zip(axes[:2], sets):
        sub = [r for r in rows if r["set"] == s and r["temperature"] == 0.0]
        bar_panel(
            ax,
            [f"K={k}" for k in ks],
            {
                m: [next(r["mean_acceptance_length"] for r in sub if r["k"] == k and r["method"] == m) for k in ks]
                for m in METHODS
            },
            title=f"{s}, greedy: mean acceptance length",
            ylabel="tokens per verify",
        )
    bar_panel(
        axes[2],
        [x["method"] for x in speed],
        {"tok/s": [x["tok_s"] for x in speed]},
        title="c=1 held-out chat, greedy",
        ylabel="tokens/s",
    )
    save_result(out_dir / name, result, fig, title="Trained drafts for SmolLM2-135M-Instruct")
    print(f"[draft_eval] done in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
