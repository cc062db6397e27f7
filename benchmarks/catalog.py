"""Every benchmark, the question it answers and its canonical result file; the results index.

    python -m benchmarks            # one line per benchmark: group, module, question
    python -m benchmarks --index    # writes benchmarks/results/INDEX.md
    python -m benchmarks --check    # exit 1 if INDEX.md is stale (tests/test_benchmarks_catalog.py)

A new benchmark gets an entry in ``BENCHMARKS``; a new shared module one in ``HELPERS``. The test fails
on a module under benchmarks/ that is in neither, and on a file in results/ that the index does not list.
No imports beyond the standard library: listing must not load torch or Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS_DIR = ROOT / "results"
INDEX = RESULTS_DIR / "INDEX.md"
GROUPS = ("engine", "fidelity", "speculation", "structured", "training", "serving")


@dataclass(frozen=True)
class Benchmark:
    group: str
    module: str  # python -m <module>
    question: str
    result: str  # the canonical file in results/, "" when it writes none by default


BENCHMARKS = [
    Benchmark(
        "engine",
        "benchmarks.engine.gather_ab",
        "What does paging cost a decode step: KV in runs of blocks vs scattered over the pool, paired?",
        "gather_ab.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.engine_bench",
        "How fast is plain decode against HF generate, and how does throughput grow with concurrency?",
        "engine_bench.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.attention_bench",
        "How fast is the native invariant attention against torch ops and SDPA?",
        "attention_bench.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.decode_floor",
        "How far is a decode step (engine, draft, HTTP) above the memory floor, and where does the rest go?",
        "decode_floor.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.sampling_cost",
        "What does sampling (temperature, top-p, top-k) cost a decoded token against greedy, in one engine?",
        "sampling_cost.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.gemm_ab",
        "Do the native invariant linears beat oneDNN's prepacked GEMMs (or tiled weights plain ones): decode, "
        "verify, prefill, GB/s at M=1?",
        "gemm_ab.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.read_patterns",
        "How fast does a core read weights in a one-row GEMM's order, plain vs tiled, against a plain read?",
        "read_patterns.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.commit_ab",
        "Is the decode step at one commit faster or slower than at another (whole trees, alternating processes, "
        "each cell against its bandwidth window)?",
        "commit_ab.json",
    ),
    Benchmark(
        "engine",
        "benchmarks.engine.step_ab",
        "Is the runner at a git ref faster or slower than the working tree's, paired in one process?",
        "step_ab.json",
    ),
    Benchmark(
        "fidelity",
        "benchmarks.fidelity.invariance_bench",
        "What do batch-invariant kernels cost against the library kernels, decode and prefill?",
        "invariance_bench.json",
    ),
    Benchmark(
        "fidelity",
        "benchmarks.fidelity.sampler_bench",
        "What does the shipped sampler (keyed race, top-k / top-p) cost against its definitions?",
        "sampler_bench.json",
    ),
    Benchmark(
        "fidelity",
        "benchmarks.fidelity.verification_bench",
        "How often does coupled verification accept drafts against rejection sampling?",
        "verification_bench.json",
    ),
    Benchmark(
        "speculation",
        "benchmarks.speculation.spec_bench",
        "How much faster than plain is each proposer, at c=1 and under load?",
        "spec_bench.json",
    ),
    Benchmark(
        "structured",
        "benchmarks.structured.grammar_libs",
        "Which grammar library masks SmolLM2's vocabulary fastest and right: llguidance, xgrammar, outlines-core?",
        "grammar_libs.json",
    ),
    Benchmark(
        "structured",
        "benchmarks.structured.structured_bench",
        "How much do grammar drafts and proposers speed up constrained decoding on the schema suite, "
        "at what grammar cost per step, and what do they cost unconstrained neighbours?",
        "structured_bench.json",
    ),
    Benchmark(
        "training",
        "benchmarks.training.draft_eval",
        "How well do the trained drafts draft: acceptance per position and speed at c=1?",
        "draft_eval.json",
    ),
    Benchmark(
        "training",
        "training.scaling",
        "How does the EAGLE head's held-out acceptance grow with training data?",
        "eagle_scaling.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.http_overhead",
        "What does the Serve layer add to a token at c=1, plain and with a remote draft?",
        "http_overhead.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.service_vs_hf",
        "How fast is the default service over HTTP against HF generate in process?",
        "service_vs_hf.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.http_sweep",
        "Does the goodput policy match the better of never / always over HTTP, c=1-32?",
        "http_sweep.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.multiturn_bench",
        "Does each turn of a chat find the last one's KV cached, on 1 and 2 replicas; how much TTFT does it save?",
        "multiturn_bench.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.long_context",
        "With max_model_len 8192, 128 running requests and a 1.5 GiB KV pool, does a 6,000-token prompt complete "
        "beside 96 streams, and what RSS do the target and draft replicas reach?",
        "long_context.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.serving_profile",
        "Where does the CPU go per output token, process by process?",
        "serving_profile.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.env_ab",
        "Does one cluster environment serve faster than another? (the paired A/B harness)",
        "serve_request_path_ab4.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.replica_path_ab",
        "Does a change shorten what the serving path adds to each token over HTTP? (two checkouts, paired)",
        "replica_path_ab.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.telemetry_overhead",
        "What do metrics and traces cost in throughput?",
        "telemetry_overhead.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.guidellm_load",
        "How does the service hold up under guidellm's load, against the engine in process?",
        "guidellm_load.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.guidellm_paired",
        "Does the service meet its serving goals, paired in time with the engine alone?",
        "guidellm_paired_ttft400.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.soak",
        "Does a running service stay correct and leak-free through minutes of mixed load with disconnects?",
        "soak_hour.json",
    ),
    Benchmark(
        "serving",
        "benchmarks.serving.fuzz",
        "Does a property-based fuzzer over /openapi.json find a 5xx, a hang or an undescribed answer?",
        "fuzz.json",
    ),
]

# Shared modules, not run on their own.
HELPERS = {
    "benchmarks.common": "timing, the closed-loop driver, HF reference timing, tables, save_result (JSON + PNG + CPU)",
    "benchmarks.catalog": "this list, `python -m benchmarks` and the results index",
    "benchmarks.serving.loadgen": "HTTP load generators (closed loop, continuous load)",
    "benchmarks.serving.switchback": "switchback windows for `http_sweep --switchback-rounds`",
    "benchmarks.engine.step_split": "timers around one engine's step phases (GEMMs with GB/s, attention, Python)",
    "benchmarks.serving.step_profile": "engine steps read the same way in process and in the replica",
    "benchmarks.serving.guidellm_workload": "the guidellm workload, shared by the two guidellm benchmarks",
    "benchmarks.serving.guidellm_report": "guidellm's report and the steady-state view of it",
    "benchmarks.structured.schema_suite": "the JSON schemas the structured-output benchmarks and tests share",
}

# Result files kept beside the canonical ones: earlier or variant runs that docs/benchmarks.md cites, and
# one-off A/Bs whose scripts are in git history only.
RECORDS = {
    "attention_kv_dtype": "attention_bench --kv-dtype-ab: the native kernel over an fp32 vs a bf16 KV cache",
    "commit_ab_python": "commit_ab --base 7dc5538 --rounds 8 --steps 32: the decode step, less Python a step",
    "commit_ab_notensor": "commit_ab --base 2c1349d --rounds 8 --steps 32: the decode step without a tensor made",
    "commit_ab_steps": "commit_ab --base 30f8a24 --rounds 6 --steps 32: the default step after decode_steps landed",
    "commit_ab_steps_c1": "commit_ab --base 30f8a24 --rounds 14 --concurrency 1 --dtypes bfloat16: the same c=1 cell",
    "commit_ab_sampler_t1": "commit_ab --base ac41526 --rounds 5 --concurrency 1,4,16,32 --sampling temperature 1: "
    "the sampled step before and after the native race",
    "commit_ab_sampler_topp": "commit_ab --base ac41526 --rounds 5, temperature 0.8 top-p 0.95: the same, top-p",
    "commit_ab_sampler_topk": "commit_ab --base ac41526 --rounds 5, temperature 0.7 top-k 50: the same, top-k",
    "commit_ab_sampler_greedy": "commit_ab --base ac41526 --rounds 5: the greedy step across the sampler change",
    "commit_ab_sampler_greedy_c1": "commit_ab --base ac41526 --rounds 12 --concurrency 1 --dtypes bfloat16: c=1",
    "commit_ab_steps_sampled": "commit_ab --base 1db17f9 --decode-steps 4, temperature 1: sampled decode_steps",
    "commit_ab_steps_greedy": "commit_ab --base 1db17f9 --decode-steps 4 --concurrency 1,4: the greedy steps unchanged",
    "commit_ab_race": "commit_ab --base 4433a0b --rounds 6 --concurrency 1,4,16,32 --dtypes bfloat16, temperature 1: "
    "the plain step with the race from the logits",
    "commit_ab_race_steps": "commit_ab --base 4433a0b --decode-steps 4 --concurrency 1,4,16, temperature 1: the "
    "races in the native decode_steps call",
    "commit_ab_race_topp": "commit_ab --base 4433a0b --decode-steps 4 --concurrency 1,4,16, T 0.8 top-p 0.95: the same",
    "cpu_priority_ab": "engine-first priorities vs Ray's own (one-off A/B, script in git history)",
    "decode_floor_avx2": "decode_floor --http --http-reps 8 on an AVX2-only CPU (fp32 served, native GEMMs)",
    "decode_floor_avx2_before": "decode_floor --http --http-reps 6 on the same AVX2-only CPU, before its kernel fixes",
    "decode_floor_v3_proxy": "decode_floor --march x86-64-v3: an AVX2-only CPU's kernels on a Zen 4 host's memory",
    "decode_floor_v3_proxy_before": "decode_floor --march x86-64-v3, the same host, before the AVX2 kernel fixes",
    "decode_floor_zen4": "decode_floor --http --http-reps 6 on a Zen 4 (AVX512-BF16), after the L2 prefetch",
    "decode_floor_zen4_before": "decode_floor --http --http-reps 6 on the same Zen 4, before the L2 prefetch",
    "decode_floor_zen4_tiled": "decode_floor --http --http-reps 6 on the same Zen 4, the GEMM weights tiled",
    "decode_floor_zen4_onecall": "decode_floor --http --http-reps 6 on the Zen 4, a step's forward one native call",
    "decode_floor_zen4_python": "decode_floor --http --http-reps 6 on the Zen 4, less Python a step (index, argmax)",
    "decode_floor_zen4_python_first": "the same an hour earlier at 2a2fb90 (before the snapshot change), steady host",
    "decode_floor_zen4_notensor": "decode_floor --http --http-reps 6 on the Zen 4, no tensor a step (host slow mode)",
    "decode_floor_zen4_notensor_fast": "the same, the host in its fast mode (63.6 GB/s best read)",
    "decode_floor_zen4_steps": "decode_floor --http --http-reps 6 on the Zen 4 with decode_steps 8 cells (fast mode)",
    "decode_floor_v3_proxy_tiled": "decode_floor --march x86-64-v3 on the Zen 4, the GEMM weights tiled",
    "decode_floor_http": "decode_floor --http --rounds 3: the same cells plus c=1 TPOT over HTTP, quiet machine",
    "draft_eval_chat24": "draft_eval on 24 held-out prompts",
    "fuzz_before_fix": "fuzz before response_format text was validated (10 refused requests answered 200)",
    "gemm_ab_avx2": "gemm_ab --rounds 3 on an AVX2-only CPU, both dtypes",
    "gemm_ab_avx2_fp32": "gemm_ab --rounds 5 --dtypes float32 on an AVX2-only CPU, fp32 rows one at a time",
    "gemm_ab_cpu1": "gemm_ab --threads 1 --clock cpu: per-core work of each backend, contended machine",
    "gemm_ab_tiled": "gemm_ab --backends native-plain,native: the native GEMMs on plain vs tiled weights, Zen 4",
    "gemm_ab_tiled_v3_proxy": "gemm_ab --backends native-plain,native --march x86-64-v3: the same, AVX2 kernels",
    "guidellm_load_burner_bound": "guidellm_load, an older run whose bound burnt guidellm's whole-run CPU",
    "guidellm_load_steady_slow": "guidellm_load, the steady-state rerun on a slow hour",
    "guidellm_paired": "guidellm_paired with max_ttft_ms 700",
    "guidellm_paired_run1": "guidellm_paired, an earlier 3-round run",
    "http_sweep_diag_c16": "http_sweep, copy c=16 diagnosis",
    "http_sweep_pc_off": "http_sweep with prefix caching off",
    "http_sweep_pc_on": "http_sweep with prefix caching on (its pair)",
    "http_sweep_s10_copy_6rounds": "http_sweep, copy mix, 6 rounds (session 10)",
    "serve_env_ab": "Serve's slower polling, serving_profile pairs from before env_ab",
    "serve_request_path_ab": "env_ab, all five request-path settings, an earlier run",
    "serve_router_loop_ab": "env_ab, handle routing on the caller's loop",
    "serving_profile_report_every_50ms": "serving_profile with load reports every 50 ms",
    "soak_5min": "soak --local, 5 min after a 120 s warm-up, with the oneDNN row bound (load 28-40)",
    "soak_10min_native": "soak --local --duration 600 --warmup 300 with the native GEMMs, fused layers, huge-page KV",
    "soak_long": "soak, 600 s on a two-node local cluster (2026-11-29), before the oneDNN row bound",
    "step_ab_fused": "step_ab --ref <before> --threads 1 --clock cpu: the layers as one native call vs call by call",
}


def listing() -> str:
    width = max(len(b.module) for b in BENCHMARKS)
    lines = [f"{b.group:<12} python -m {b.module:<{width}}  {b.question}" for b in BENCHMARKS]
    lines += ["", "Helpers (not run on their own):"]
    lines += [f"  {m}: {what}" for m, what in HELPERS.items()]
    lines += ["", "How to run each and what it measured: docs/benchmarks.md; results: benchmarks/results/INDEX.md"]
    return "\n".join(lines)


def _machine(stem: str) -> tuple[str, str]:
    """(CPU, date) from a result file's ``env``; "not recorded" where it has none."""
    path = RESULTS_DIR / f"{stem}.json"
    env = json.loads(path.read_text()).get("env") if path.exists() else None
    if not isinstance(env, dict):
        return "not recorded", "not recorded"
    return str(env.get("cpu") or "not recorded"), str(env.get("time") or "")[:10] or "not recorded"


def _files(stem: str) -> str:
    return ", ".join(f"[{p.name}]({p.name})" for p in sorted(RESULTS_DIR.glob(f"{stem}.*")))


def index() -> str:
    """benchmarks/results/INDEX.md: generated from BENCHMARKS, RECORDS and the result files."""
    out = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks --index` from `benchmarks/catalog.py` and the files here; do not edit.",
        "One canonical result per benchmark; what each measured, on which machine: `docs/benchmarks.md`.",
        "",
        "| group | benchmark | question | result | CPU | date |",
        "|---|---|---|---|---|---|",
    ]
    for b in BENCHMARKS:
        stem = Path(b.result).stem
        cpu, date = _machine(stem)
        files = _files(stem) if b.result else "none by default"
        out.append(f"| {b.group} | `{b.module}` | {b.question} | {files} | {cpu} | {date} |")
    out += ["", "## Other recorded runs", "", "| result | what | CPU | date |", "|---|---|---|---|"]
    for stem, what in sorted(RECORDS.items()):
        cpu, date = _machine(stem)
        out.append(f"| {_files(stem)} | {what} | {cpu} | {date} |")
    return "\n".join(out) + "\n"


def unlisted_results() -> list[str]:
    """Files in results/ that the index does not name."""
    stems = {Path(b.result).stem for b in BENCHMARKS if b.result} | set(RECORDS)
    return sorted(p.name for p in RESULTS_DIR.iterdir() if p.name != INDEX.name and p.stem not in stems)


def unlisted_modules() -> list[str]:
    """Modules under benchmarks/ that are neither a benchmark nor a helper."""
    known = {b.module for b in BENCHMARKS} | set(HELPERS)
    found = {
        ".".join(("benchmarks", *p.relative_to(ROOT).with_suffix("").parts))
        for p in ROOT.rglob("*.py")
        if not p.name.startswith("__")
    }
    return sorted(found - known)
