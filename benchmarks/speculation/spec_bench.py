"""Speculative decoding benchmark: proposers vs plain at batch 1, then always-spec vs plain under load.

    python -m benchmarks.speculation.spec_bench [--quick] [--ks 4,8]

fp32, greedy, SmolLM2-135M-Instruct, one run, side by side:

A. Concurrency 1, per prompt (all methods interleaved on each prompt): copy-heavy prompts
   (verbatim repeat, one-word edit, one JSON field changed, sentence extraction) and open-chat
   prompts; engine plain vs ngram vs suffix vs draft_model (the target as its own draft: every
   draft is accepted, so this is the ceiling of a draft model's overhead) at each K, and HF
   ``generate`` greedy, ``generate(prompt_lookup_num_tokens=K)`` and
   ``generate(assistant_model=<same model>, K constant)`` as outside references. Requests stop
   at EOS or ``max_tokens`` (greedy: every method writes the same tokens). Every speculative
   output is checked against plain; a difference prints a loud MISMATCH. Each (prompt, method)
   runs twice (rotated order) and keeps its fastest run, so one load spike from the other jobs
   on the shared cores cannot sink a method.
   The suffix proposer gets a fresh (cold) global cache for every run: the plain run of the same
   prompt would otherwise have put the exact answer in its cache.
B. Always-spec (ngram, K=4) vs plain, closed loop of 1, 4, 16, 32 clients on the copy-heavy mix:
   aggregate tok/s, and the concurrency where always-spec falls below plain. Three rounds per
   concurrency with the order alternating (plain first, then spec first, ...); medians reported.

Writes benchmarks/results/spec_bench.{json,png}; prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    RunResult,
    bar_panel,
    env_info,
    figure,
    format_table,
    hf_generate,
    line_panel,
    loadavg,
    merge_runs,
    progress,
    ratio,
    run_closed_loop,
    save_result,
    set_threads,
    warmup_engine,
)

# ----------------------------------------------------------------------------- prompts

PARA_RIVER = (
    "The town of Millbrook grew up along the banks of the Calder River in the early eighteenth century. "
    "The first settlers were farmers who cleared the forest and planted wheat and barley in the rich soil of "
    "the valley. By 1790 a stone mill stood at the bend of the river, and the sound of its wheel could be heard "
    "from the market square. The river brought trade as well as water: barges carried grain downstream to the "
    "port and returned with salt, cloth and iron tools. In the spring floods the river often rose over its "
    "banks, and the townspeople built a long earthen wall to protect the lower streets. Today the mill is a "
    "small museum, and the old wall is a footpath where families walk on summer evenings."
)
PARA_RELEASE = (
    "Our team is pleased to announce version 2.4 of the Atlas data pipeline. This release focuses on "
    "reliability and speed. The scheduler now retries failed tasks with exponential backoff, and every retry is "
    "recorded in the job history so that operators can see what happened. Large joins run up to forty percent "
    "faster thanks to a new hash partitioning strategy, and memory use during sorting has been cut in half. We "
    "have also added a command line tool that validates configuration files before they are deployed. As "
    "always, the upgrade is backward compatible, and existing pipelines will continue to run without any "
    "changes. Please report any problems on the issue tracker."
)
PARA_BEES = (
    "Honeybees communicate the location of food through a behavior known as the waggle dance. When a forager "
    "returns to the hive after finding a rich patch of flowers, she moves in a figure-eight pattern on the "
    "vertical surface of the comb. The angle of the straight run relative to vertical shows the direction of "
    "the food relative to the sun, and the length of the run tells the other bees how far away it is. Bees that "
    "follow the dance learn the route and fly out to find the flowers themselves. Scientists have shown that "
    "the dance is accurate to within a few degrees, and that bees adjust the angle as the sun moves across the "
    "sky during the day."
)
PARA_CLINIC = (
    "The Riverside Health Clinic will change its opening hours starting on the first of March. From Monday to "
    "Friday the clinic will open at eight in the morning and close at six in the evening, one hour later than "
    "before. On Saturdays the clinic will be open from nine until one for urgent appointments only. Patients "
    "who need a repeat prescription can now request it online through the patient portal, and most requests "
    "will be ready for collection within two working days. The pharmacy counter will keep its current hours. "
    "If you have any questions about these changes, please speak to the staff at the front desk or call the "
    "main number."
)
JSON_USER = {
    "id": 10482,
    "name": "Maria Lopez",
    "email": "maria.lopez@example.com",
    "city": "Denver",
    "country": "USA",
    "plan": "premium",
    "signup_date": "2023-04-17",
    "active": True,
    "tags": ["newsletter", "beta-tester"],
    "address": {"street": "1420 Larimer Street", "zip": "80202"},
    "notes": "Prefers contact by email. Renewal due in April.",
}
JSON_ORDER = {
    "order_id": "A-55310",
    "customer_id": 7781,
    "status": "processing",
    "currency": "EUR",
    "items": [
        {"sku": "BK-1042", "title": "Field Guide to Birds", "qty": 1, "price": 24.5},
        {"sku": "MG-0007", "title": "Ceramic Mug", "qty": 2, "price": 9.0},
    ],
    "shipping": {"method": "standard", "address": "Keizersgracht 112, Amsterdam", "eta_days": 4},
    "gift_wrap": False,
}


def verbatim(p: str) -> str:
    return f"Repeat the following paragraph exactly, word for word, with no other text.\n\n{p}"


def edit(p: str, old: str, new: str) -> str:
    return (
        f'Rewrite the paragraph below exactly as it is, but replace the word "{old}" with "{new}". '
        f"Output only the rewritten paragraph.\n\n{p}"
    )


def json_edit(obj: dict, field: str, value: Any) -> str:
    return (
        f'Change the "{field}" field of this JSON object to {json.dumps(value)} and output the complete '
        f"JSON object with no other changes.\n\n{json.dumps(obj, indent=2)}"
    )


def extract(p: str, word: str) -> str:
    return (
        f'List every sentence from the paragraph below that contains the word "{word}". Copy each sentence '
        f"exactly, one per line.\n\n{p}"
    )


# (name, kind, user message). Section A uses the first of each kind; section B cycles through all.
COPY_PROMPTS = [
    ("verbatim-river", "verbatim", verbatim(PARA_RIVER)),
    ("edit-release", "edit", edit(PARA_RELEASE, "forty", "thirty")),
    ("json-user-city", "json", json_edit(JSON_USER, "city", "Boston")),
    ("extract-bees", "extract", extract(PARA_BEES, "dance")),
    ("verbatim-clinic", "verbatim", verbatim(PARA_CLINIC)),
    ("edit-river", "edit", edit(PARA_RIVER, "mill", "bakery")),
    ("json-order-status", "json", json_edit(JSON_ORDER, "status", "shipped")),
    ("extract-river", "extract", extract(PARA_RIVER, "river")),
]
CHAT_PROMPTS = [
    ("chat-story", "chat", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("chat-vaccines", "chat", "Explain how vaccines train the immune system. Use simple language."),
    ("chat-python-cpp", "chat", "What are the main differences between Python and C++? Give a few examples."),
    ("chat-interview", "chat", "Give me five tips for preparing for a job interview, with a sentence on each."),
]

# Sized for <= ~12 min on 2 shared, busy cores.
# Section A lets copy answers run to their natural length (a paragraph is ~130 tokens; a 48-token
# cap measured mostly the prompt's prefill, which speculation does not speed up).
FULL = dict(
    tokens=160,
    num_copy=4,
    num_chat=1,
    rounds_a=2,
    concurrency=[1, 4, 16, 32],
    sweep_tokens=32,
    sweep_requests={1: 2, 4: 6, 16: 16, 32: 32},
    rounds=3,
)
QUICK = dict(
    tokens=16,
    num_copy=1,
    num_chat=1,
    rounds_a=1,
    concurrency=[1, 4],
    sweep_tokens=8,
    sweep_requests={1: 1, 4: 4},
    rounds=1,
)

MAX_MODEL_LEN = 768
THREADS = 2
SWEEP_K = 4
ENGINE_METHODS = ("ngram", "suffix", "draft_model")


def crossover(sweep: list[dict[str, Any]]) -> tuple[int | None, float | None]:
    """First measured c where spec < plain, and a log2-linear estimate of where spec/plain crosses 1."""
    first = next((s["concurrency"] for s in sweep if s["spec_over_plain"] < 1.0), None)
    est = None
    for a, b in zip(sweep, sweep[1:]):
        ra, rb = a["spec_over_plain"], b["spec_over_plain"]
        if ra >= 1.0 > rb:
            la, lb = math.log2(a["concurrency"]), math.log2(b["concurrency"])
            est = 2 ** (la + (ra - 1.0) / (ra - rb) * (lb - la))
            break
    if first is not None and sweep[0]["spec_over_plain"] < 1.0:
        est = sweep[0]["concurrency"]
    return first, est


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few tokens, 2 prompts, concurrency 1 and 4 (< 3 min)")
    ap.add_argument("--ks", default="4,8", help="comma-separated K values for section A (e.g. 4,6)")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="directory for spec_bench.json / .png")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    ks = [int(k) for k in args.ks.split(",")]
    out_dir = Path(args.out)

    set_threads(THREADS)
    import transformers

    transformers.logging.set_verbosity_error()
    from workers.config import EngineConfig
    from workers.decision import fixed_k
    from workers.engine import LLMEngine
    from workers.model_loader import load_model
    from workers.proposers.draft_model import DraftModelProposer
    from workers.proposers.ngram import NgramProposer
    from workers.proposers.suffix import SuffixProposer

    t_start = time.perf_counter()
    env = env_info()
    print(
        f"[spec_bench] {'QUICK' if args.quick else 'FULL'} run; {env['cpu']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {THREADS} threads, K={ks}, loadavg {env['loadavg_start']}",
        flush=True,
    )
    loaded = load_model("smollm2")
    model = loaded.model
    max_seqs = max(cfg["concurrency"])
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_num_seqs=max_seqs,
            max_model_len=MAX_MODEL_LEN,
            num_speculative_tokens=max(ks + [SWEEP_K]),
            num_threads=THREADS,
        ),
        loaded,
        proposers={
            "ngram": NgramProposer(),
            "suffix": SuffixProposer(),
            "draft_model": DraftModelProposer(
                model,
                num_slots=2,
                max_model_len=MAX_MODEL_LEN,
                dtype="float32",
                target_vocab_size=model.config.vocab_size,
            ),
        },
    )
    eos = sorted(eng.eos_token_ids)
    assistant = copy.deepcopy(model).eval()  # HF assisted generation with the target as its own assistant
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # always draft K (no early stop)

    def chat(msg: str) -> list[int]:
        return eng.tokenize_chat([{"role": "user", "content": msg}])

    prompts_a = COPY_PROMPTS[: cfg["num_copy"]] + CHAT_PROMPTS[: cfg["num_chat"]]
    n_tok = cfg["tokens"]
    params = {"max_tokens": n_tok, "temperature": 0}

    # Methods: (label, family, runner). Engine methods report SpecDecodeStats; HF methods tokens per pass.
    def engine_run(label: str, proposer: str | None, k: int):
        def run(ids: list[int]) -> RunResult:
            if proposer == "suffix":
                eng.proposers["suffix"] = SuffixProposer()  # cold global cache: see the module docstring
            eng.decide = fixed_k(k)
            return run_closed_loop(
                eng,
                [(ids, params)],
                1,
                proposer=proposer,
                speculation="on" if k else "off",
                name=label,
                show_progress=False,
            )

        return run

    def hf_run(label: str, **kw: Any):
        def run(ids: list[int]) -> RunResult:
            if "assistant_model" in kw:
                assistant.generation_config.num_assistant_tokens = kw["_k"]
            extra = {k: v for k, v in kw.items() if k != "_k"}
            return hf_generate(model, ids, n_tok, ignore_eos=False, eos_token_id=eos, name=label, **extra)

        return run

    methods: list[tuple[str, str, Any]] = [("plain", "engine", engine_run("plain", None, 0))]
    for k in ks:
        for p in ENGINE_METHODS:
            lab = f"{p}(self)" if p == "draft_model" else p
            methods.append((f"{lab} K={k}", "engine", engine_run(f"{lab} K={k}", p, k)))
    methods.append(("HF plain", "hf", hf_run("HF plain")))
    for k in ks:
        methods.append((f"HF prompt-lookup K={k}", "hf", hf_run(f"HF prompt-lookup K={k}", prompt_lookup_num_tokens=k)))
        methods.append(
            (f"HF assisted(self) K={k}", "hf", hf_run(f"HF assisted(self) K={k}", assistant_model=assistant, _k=k))
        )

    # Warm-up: every method once, a few tokens, untimed.
    warm_ids = chat(CHAT_PROMPTS[0][2])
    for p in ("ngram", "suffix", "draft_model"):
        eng.decide = fixed_k(max(ks))
        warmup_engine(eng, warm_ids, 4, proposer=p, speculation="on")
    warmup_engine(eng, warm_ids, 4, speculation="off")
    hf_generate(model, warm_ids, 4, ignore_eos=False, eos_token_id=eos)
    hf_generate(model, warm_ids, 4, ignore_eos=False, eos_token_id=eos, prompt_lookup_num_tokens=ks[0])
    assistant.generation_config.num_assistant_tokens = ks[0]
    hf_generate(model, warm_ids, 4, ignore_eos=False, eos_token_id=eos, assistant_model=assistant)

    # ---------------------------------------------------------------- A. batch 1, per prompt
    # Each (prompt, method) runs `rounds_a` times in a rotated order and keeps its fastest run (best-of-N:
    # the run least disturbed by the other jobs on the shared cores); every run's output is checked.
    results: dict[tuple[str, str], RunResult] = {}  # (prompt name, method label) -> fastest run
    mismatches: list[str] = []
    samples: dict[str, str] = {}
    jobs = [(rnd, i) for rnd in range(cfg["rounds_a"]) for i in range(len(prompts_a))]
    for rnd, i in progress(jobs, desc="A: methods x prompts x rounds", unit="prompt"):
        name, kind, msg = prompts_a[i]
        ids = chat(msg)
        j = (i + 3 * rnd) % len(methods)  # rotate the method order so load drift favours none
        runs_now: dict[str, RunResult] = {}
        for label, _fam, run in methods[j:] + methods[:j]:
            runs_now[label] = r = run(ids)
            best = results.get((name, label))
            if best is None or r.tok_s > best.tok_s:
                results[(name, label)] = r
        ref = {"engine": runs_now["plain"].outputs()[0], "hf": runs_now["HF plain"].outputs()[0]}
        samples[name] = eng.tokenizer.decode(ref["engine"], skip_special_tokens=True)
        for label, fam, _ in methods:
            out = runs_now[label].outputs()[0]
            if out != ref[fam]:
                n = next((i for i, (a, b) in enumerate(zip(out, ref[fam])) if a != b), min(len(out), len(ref[fam])))
                mismatches.append(
                    f"{name} / {label} (round {rnd}): differs from {fam} plain at token {n} "
                    f"({len(out)} vs {len(ref[fam])} tokens)"
                )
                print(f"\n!!!!!!!! MISMATCH: {mismatches[-1]} !!!!!!!!\n", flush=True)
        if ref["engine"] != ref["hf"] and rnd == 0:
            print(
                f"  note: {name}: engine plain and HF plain greedy differ (fp32 numerics), "
                f"tokens {len(ref['engine'])} vs {len(ref['hf'])}",
                flush=True,
            )

    def summarize(names: list[str], label: str, fam: str) -> dict[str, Any]:
        run = merge_runs(label, [results[(n, label)] for n in names])
        base = merge_runs("plain", [results[(n, "plain")] for n in names])
        hf_base = merge_runs("HF plain", [results[(n, "HF plain")] for n in names])
        s = run.summary()
        sp = s["spec"]
        return {
            "method": label,
            "tokens": s["output_tokens"],
            "tok_s": s["tok_s"],
            "vs_plain": ratio(s["tok_s"], base.tok_s),
            "vs_hf_plain": ratio(s["tok_s"], hf_base.tok_s) if fam == "hf" else None,
            "acceptance_rate": sp["acceptance_rate"] if fam == "engine" and label != "plain" else None,
            "mean_acceptance_length": sp["mean_acceptance_length"] if fam == "engine" and label != "plain" else None,
            "tokens_per_pass": s["tokens_per_pass"],
            "tpot_p50_ms": s["tpot_p50_ms"],
            "summary": s,
        }

    cols = [
        ("method", "method", "s"),
        ("tokens", "tokens", "d"),
        ("tok_s", "tok/s", ".2f"),
        ("vs_plain", "vs engine plain", ".2f"),
        ("vs_hf_plain", "vs HF plain", ".2f"),
        ("acceptance_rate", "accept rate", ".3f"),
        ("mean_acceptance_length", "mean accept len", ".2f"),
        ("tokens_per_pass", "tok/target pass", ".2f"),
    ]
    section_a: dict[str, list[dict[str, Any]]] = {}
    tables: list[str] = []
    for cat, names in (
        ("copy-heavy", [n for n, k, _ in prompts_a if k != "chat"]),
        ("open chat", [n for n, k, _ in prompts_a if k == "chat"]),
    ):
        if not names:
            continue
        rows = [summarize(names, label, fam) for label, fam, _ in methods]
        section_a[cat] = rows
        tables.append(
            format_table(
                rows,
                cols,
                title=f"A. {cat} ({', '.join(names)}), fp32, concurrency 1, greedy, "
                f"max {n_tok} tokens, best of {cfg['rounds_a']} runs per prompt and method",
            )
        )
        print("\n" + tables[-1], flush=True)
    per_prompt = []
    for name, _kind, _ in prompts_a:
        base = results[(name, "plain")].tok_s
        row: dict[str, Any] = {"prompt": name, "tokens": results[(name, "plain")].output_tokens, "plain tok/s": base}
        for label, fam, _ in methods[1:]:
            r = results[(name, label)]
            row[label] = ratio(r.tok_s, base)
            acc = r.summary()["spec"]
            row[f"{label} accept"] = acc["acceptance_rate"] if fam == "engine" else None
        per_prompt.append(row)
    pp_cols = [("prompt", "prompt", "s"), ("tokens", "tokens", "d"), ("plain tok/s", "plain tok/s", ".2f")] + [
        (label, label.replace("(self)", "*").replace("prompt-lookup", "PLD").replace("assisted", "asst"), ".2f")
        for label, _, _ in methods[1:]
    ]
    tables.append(
        format_table(
            per_prompt,
            pp_cols,
            title="A. per prompt: speedup vs engine plain (* = target as its own draft; PLD = prompt lookup)",
        )
    )
    print("\n" + tables[-1], flush=True)
    print(
        f"\n  {'ALL SPECULATIVE OUTPUTS EQUAL PLAIN' if not mismatches else f'{len(mismatches)} MISMATCHES'} "
        f"({len(prompts_a)} prompts x {len(methods) - 1} speculative methods x {cfg['rounds_a']} rounds)\n",
        flush=True,
    )

    # ---------------------------------------------------------------- B. always-spec vs plain under load
    copy_ids = [chat(msg) for _, _, msg in COPY_PROMPTS]
    eng.decide = fixed_k(SWEEP_K)
    sweep: list[dict[str, Any]] = []
    sweep_mismatch = 0
    for c in cfg["concurrency"]:
        rng = random.Random(c)
        n_req = cfg["sweep_requests"][c]
        work = [
            (
                copy_ids[i % len(copy_ids)],
                {
                    "max_tokens": max(2, round(cfg["sweep_tokens"] * rng.uniform(0.5, 1.5))),
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            for i in range(n_req)
        ]
        # Alternate the order each round (plain first, then spec first, ...) and take medians, so a load
        # spike on the shared cores hits one round of one side, not the verdict.
        runs: dict[str, list[RunResult]] = {"plain": [], "spec": []}
        for rnd in range(cfg["rounds"]):
            order = ("plain", "spec") if rnd % 2 == 0 else ("spec", "plain")
            for side in order:
                if side == "plain":
                    runs[side].append(run_closed_loop(eng, work, c, speculation="off", name=f"plain r{rnd}"))
                else:
                    runs[side].append(
                        run_closed_loop(
                            eng, work, c, proposer="ngram", speculation="on", name=f"ngram K={SWEEP_K} r{rnd}"
                        )
                    )
        ref = runs["plain"][0].outputs()
        bad = sum(a != b for run in runs["plain"][1:] + runs["spec"] for a, b in zip(ref, run.outputs()))
        if bad:
            sweep_mismatch += bad
            print(
                f"\n!!!!!!!! MISMATCH: c={c}: {bad} always-spec/plain outputs differ from the first plain run "
                f"!!!!!!!!\n",
                flush=True,
            )
        round_ratios = [ratio(sr.tok_s, pr.tok_s) for pr, sr in zip(runs["plain"], runs["spec"])]
        ps, ss = merge_runs("plain", runs["plain"]).summary(), merge_runs("spec", runs["spec"]).summary()
        sweep.append(
            {
                "concurrency": c,
                "num_requests": n_req,
                "rounds": cfg["rounds"],
                "output_tokens": runs["plain"][0].output_tokens,
                "plain_tok_s": median([r.tok_s for r in runs["plain"]]),
                "spec_tok_s": median([r.tok_s for r in runs["spec"]]),
                "spec_over_plain": median(round_ratios),
                "round_ratios": round_ratios,
                "ratio_range": "/".join(f"{x:.2f}" for x in round_ratios),
                "plain_tpot_p50_ms": ps["tpot_p50_ms"],
                "spec_tpot_p50_ms": ss["tpot_p50_ms"],
                "plain_tpot_p99_ms": ps["tpot_p99_ms"],
                "spec_tpot_p99_ms": ss["tpot_p99_ms"],
                "acceptance_rate": ss["spec"]["acceptance_rate"],
                "mean_acceptance_length": ss["spec"]["mean_acceptance_length"],
                "mismatches": bad,
                "plain": ps,
                "spec": ss,
                "plain_rounds": [r.summary() for r in runs["plain"]],
                "spec_rounds": [r.summary() for r in runs["spec"]],
            }
        )
        print(
            f"  c={c:>2}: plain {sweep[-1]['plain_tok_s']:.1f} tok/s, always-spec {sweep[-1]['spec_tok_s']:.1f} "
            f"tok/s (median ratio {sweep[-1]['spec_over_plain']:.2f}x; rounds {sweep[-1]['ratio_range']})",
            flush=True,
        )
    first_below, est = crossover(sweep)
    tables.append(
        format_table(
            sweep,
            [
                ("concurrency", "c", "d"),
                ("num_requests", "requests", "d"),
                ("output_tokens", "out tokens", "d"),
                ("plain_tok_s", "plain tok/s", ".1f"),
                ("spec_tok_s", f"ngram K={SWEEP_K} tok/s", ".1f"),
                ("spec_over_plain", "spec/plain", ".2f"),
                ("ratio_range", "per round", "s"),
                ("plain_tpot_p50_ms", "plain TPOT p50", ".1f"),
                ("spec_tpot_p50_ms", "spec TPOT p50", ".1f"),
                ("plain_tpot_p99_ms", "plain TPOT p99", ".1f"),
                ("spec_tpot_p99_ms", "spec TPOT p99", ".1f"),
                ("acceptance_rate", "accept rate", ".3f"),
                ("mean_acceptance_length", "mean accept len", ".2f"),
            ],
            title=f"B. always-spec (ngram, K={SWEEP_K}) vs plain, fp32, closed loop on the copy-heavy mix "
            f"({len(COPY_PROMPTS)} prompts, mean {cfg['sweep_tokens']} tokens, 0.5x-1.5x); tok/s and spec/plain are "
            f"medians over {cfg['rounds']} alternating rounds, TPOT over all rounds",
        )
    )
    verdict = (
        f"always-spec first falls below plain at c={first_below} (measured); log-interpolated crossover ~c={est:.1f}"
        if first_below is not None and est is not None
        else f"always-spec first falls below plain at c={first_below}"
        if first_below is not None
        else f"always-spec stays at or above plain up to c={max(cfg['concurrency'])}"
    )
    print("\n" + tables[-1] + "\n  " + verdict, flush=True)
    if sweep_mismatch:
        print(f"  !!!!!!!! {sweep_mismatch} MISMATCHED OUTPUTS IN THE SWEEP !!!!!!!!", flush=True)

    # ---------------------------------------------------------------- reports
    env["loadavg_end"] = loadavg()
    env["elapsed_s"] = time.perf_counter() - t_start
    result = {
        "benchmark": "spec_bench",
        "mode": "quick" if args.quick else "full",
        "env": env,
        "config": {
            **cfg,
            "ks": ks,
            "sweep_k": SWEEP_K,
            "max_model_len": MAX_MODEL_LEN,
            "threads": THREADS,
            "model": "SmolLM2-135M-Instruct",
            "dtype": "float32",
            "hf_prompt_lookup_max_matching_ngram_size": "HF default (2)",
            "hf_assisted": "same model, num_assistant_tokens=K constant, confidence threshold 0",
            "suffix": "fresh proposer (cold global cache) per run",
        },
        "prompts": {n: {"kind": k, "message": m} for n, k, m in COPY_PROMPTS + CHAT_PROMPTS},
        "plain_output_text": samples,
        "section_a": section_a,
        "section_a_per_prompt": per_prompt,
        "mismatches": mismatches,
        "sweep": sweep,
        "sweep_mismatches": sweep_mismatch,
        "crossover": {"first_c_spec_below_plain": first_below, "interpolated_c": est, "verdict": verdict},
        "tables": tables,
    }
    fig, (a1, a2, a3) = figure(3, width=5.6)
    cats = list(section_a)
    spec_labels = [label for label, _, _ in methods[1:]]
    bar_panel(
        a1,
        cats,
        {lab: [next(r["vs_plain"] for r in section_a[c] if r["method"] == lab) for c in cats] for lab in spec_labels},
        title="Batch 1: speedup vs engine plain",
        ylabel="x engine plain tok/s",
        hline=1.0,
    )
    cs = [s["concurrency"] for s in sweep]
    line_panel(
        a2,
        cs,
        {
            "plain": [s["plain_tok_s"] for s in sweep],
            f"always-spec ngram K={SWEEP_K}": [s["spec_tok_s"] for s in sweep],
        },
        title="Copy-heavy mix: aggregate tok/s",
        xlabel="concurrent clients",
        ylabel="tok/s",
    )
    line_panel(
        a3,
        cs,
        {"spec / plain": [s["spec_over_plain"] for s in sweep]},
        title="Always-spec / plain throughput",
        xlabel="concurrent clients",
        ylabel="ratio",
    )
    a3.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    title = f"SmolLM2-135M fp32, {env['cpu']}, {THREADS} threads, {env['time']} "
    title += f"(loadavg {env['loadavg_start']} -> {env['loadavg_end']}); {verdict}"
    save_result(out_dir / "spec_bench", result, fig, title=title)
    print(f"[spec_bench] done in {env['elapsed_s']:.0f} s", flush=True)
    return 1 if (mismatches or sweep_mismatch) else 0


if __name__ == "__main__":
    sys.exit(main())
