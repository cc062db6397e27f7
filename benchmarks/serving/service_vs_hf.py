"""The default service over HTTP at one stream vs HF transformers ``generate`` in process.

    python -m benchmarks.serving.service_vs_hf [--rounds 4] [--tokens 64]

Starts a local cluster from ray_config.yaml as shipped (``dtype: auto``, batch-invariant kernels,
the default routing policy; two Ray nodes on this machine, as the end-to-end tests run it), then
alternates, prompt by prompt: one chat request over HTTP with the official ``openai`` client
(greedy, ``ignore_eos``, ``--tokens`` tokens, streamed), and HF ``generate`` on the same chat
prompt in this process in fp32 and in bf16. Rate = output tokens / wall time of the request,
prefill included, for both. Prints the per-round and median ratios and writes
benchmarks/results/service_vs_hf.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    hf_generate,
    progress,
    save_result,
    set_threads,
)
from benchmarks.engine.engine_bench import CHAT_PROMPTS
from cluster.local_cluster import LocalCluster
from workers.model_loader import load_model

MODEL = "SmolLM2-135M-Instruct"


def over_http(client: openai.OpenAI, text: str, n: int) -> float:
    """Output tokens per second of one streamed chat request, first byte to last included."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    for ch in stream:
        if ch.usage:
            tokens = ch.usage.completion_tokens
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    set_threads(2)
    loaded = load_model("smollm2")
    hf = {"float32": loaded.model, "bfloat16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    texts = CHAT_PROMPTS[:3]
    tok = loaded.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for t in texts
    ]
    rates: dict[str, list[float]] = {"http": [], "hf_float32": [], "hf_bfloat16": []}
    with tempfile.TemporaryDirectory() as tmp:
        # ray_config.yaml as shipped; LocalCluster's test-sized engine (1 thread, 8 slots) set back to it
        cluster = LocalCluster(
            Path(tmp),
            args_patch={
                "engine": {"num_threads": 2, "max_num_seqs": 32, "max_model_len": 2048},
                "target": {"num_cpus": 1},
            },
        )
        try:
            cluster.start()
            client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
            stats = httpx.get(f"{cluster.base_url}/v1/speculation/stats", timeout=30).json()
            replica = next(iter(stats["replicas"].values()), {})
            over_http(client, texts[0], 8)  # warm-up
            for m in hf.values():
                hf_generate(m, prompts[0], 4, ignore_eos=True)
            for _ in progress(range(args.rounds), desc="rounds"):
                for text, prompt in zip(texts, prompts):
                    rates["http"].append(over_http(client, text, args.tokens))
                    for dt, m in hf.items():
                        run = hf_generate(m, prompt, args.tokens, ignore_eos=True)
                        rates[f"hf_{dt}"].append(args.tokens / run.wall_s)
        finally:
            cluster.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    pairs = [h / f for h, f in zip(rates["http"], rates["hf_float32"])]
    env = env_info()
    summary = (
        f"default service over HTTP c=1: {med['http']:.1f} tok/s (engine dtype {replica.get('dtype')}, "
        f"batch_invariant {replica.get('batch_invariant')}); HF generate fp32 {med['hf_float32']:.1f}, "
        f"bf16 {med['hf_bfloat16']:.1f}; HTTP / HF fp32: median of pairs {statistics.median(pairs):.2f}x "
        f"(min {min(pairs):.2f}, max {max(pairs):.2f}, {len(pairs)} pairs). CPU: {env['cpu']}"
    )
    print(summary)
    result = {
        "env": env,
        "args": vars(args),
        "median_tok_s": med,
        "ratio_pairs": pairs,
        "replica": replica,
        "raw": rates,
        "summary": summary,
    }
    fig, (ax,) = figure(ncols=1, width=6)
    bar_panel(
        ax,
        ["c=1"],
        {
            "service (HTTP)": [med["http"]],
            "HF generate fp32": [med["hf_float32"]],
            "HF generate bf16": [med["hf_bfloat16"]],
        },
        title="output tok/s, one stream",
        ylabel="tok/s",
        fmt="{:.1f}",
    )
    save_result(RESULTS_DIR / "service_vs_hf", result, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
