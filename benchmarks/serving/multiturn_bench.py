"""Multi-turn chat over HTTP: does each turn find the last one's KV cached, on one replica and on two?

    python -m benchmarks.serving.multiturn_bench [--quick] [--tag TAG]

Starts a local one-node cluster (cluster/local_cluster.py) with one target replica, then one with two,
and drives each with the ``openai`` client:

(a) conversations (24 by default) x 3 turns, all conversations at once, each sending its next turn
    when its last answer ends (so the turns of different conversations interleave). Each turn's prompt
    is the last prompt plus the answer plus one message; the goal is that turn 3's
    ``usage.prompt_tokens_details.cached_tokens`` covers >= 80% of turn 2's prompt plus answer. With
    two replicas that needs the Router's prefix-aware placement (deployments/prefix_affinity.py).
(b) on the one-replica cluster, at concurrency 1: a follow-up turn's TTFT (its history cached) against
    the same prompt cold (a different first token, so nothing but the chat template's head is cached);
    the goal is >= 3x lower.
(c) on the one-replica cluster: closed-loop chat throughput (aggregate output tok/s) at c=32 and c=64,
    alternated; the goal is c=64 >= c=32.

Writes benchmarks/results/multiturn_bench[_TAG].json and .png. The result's ``env`` records the load
average; ``--contended`` marks a run taken while other work shared the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, percentile, save_result
from benchmarks.serving.loadgen import MODEL, closed_loop
from benchmarks.speculation.spec_bench import CHAT_PROMPTS
from cluster.local_cluster import LocalCluster

FULL = dict(conversations=24, turns=3, max_tokens=48, probes=4, probe_words=700, tput_rounds=2, tput_per_c=2)
QUICK = dict(conversations=8, turns=3, max_tokens=32, probes=2, probe_words=500, tput_rounds=1, tput_per_c=1)

SENTENCES = [
    "The harbour town woke slowly, its fishing boats rocking against the old stone quay.",
    "A narrow road climbed from the market square to the lighthouse on the cliff.",
    "Every spring the council argued about repairing the sea wall before the storms.",
    "The bakery on the corner sold rye bread, honey cakes and strong black coffee.",
    "Children ran along the beach at low tide, collecting shells and green glass.",
    "The museum kept maps of shipwrecks, logbooks and a brass telescope from 1871.",
    "In winter the ferry ran twice a week, weather permitting, to the northern islands.",
    "An old clockmaker repaired watches in a workshop that smelled of oil and pine.",
    "The library held town records going back three centuries, written in faded ink.",
    "Gulls circled above the fish market, where traders called out the morning prices.",
]
FOLLOW_UPS = ["Summarise that in two sentences.", "Which detail matters most, and why?", "Give it a title."]


def opening(i: int, words: int) -> str:
    """Conversation ``i``'s first message: a few hundred words of its own (the sentences in an order
    of its own), then a question, so no two conversations share more than the chat template's head."""
    out: list[str] = [f"Conversation {i}. Read these notes about a town."]
    k = 0
    while sum(len(s.split()) for s in out) < words:
        out.append(SENTENCES[(i * 7 + k * (1 + i % 3)) % len(SENTENCES)])
        k += 1
    return " ".join(out) + " What kind of place is this town?"


async def chat_turn(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request: its answer, TTFT and usage."""
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += ch.choices[0].delta.content
        if ch.usage is not None:
            usage = ch.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return {
        "text": text,
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
    }


async def conversations(url: str, plan: dict[str, Any]) -> dict[str, Any]:
    """(a): every conversation at once, each turn sent when its last answer ended."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": opening(i, 250)}]
        turns = []
        for t in range(plan["turns"]):
            r = await chat_turn(client, messages, plan["max_tokens"])
            turns.append({k: v for k, v in r.items() if k != "text"})
            messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": FOLLOW_UPS[t]}]
        return turns

    t0 = time.perf_counter()
    async with client:  # closed on this loop, not by the garbage collector after it
        convs = await asyncio.gather(*(one(i) for i in range(plan["conversations"])))
    wall = time.perf_counter() - t0
    # turn 3's cache against what turn 2 left: its prompt and answer (the last answer token is never fed)
    cover = [c[2]["cached_tokens"] / (c[1]["prompt_tokens"] + c[1]["completion_tokens"]) for c in convs]
    held = sum(c[1]["prompt_tokens"] + c[1]["completion_tokens"] for c in convs)
    return {
        "wall_s": wall,
        "turns": convs,
        "turn3_coverage": cover,
        "turn3_coverage_total": sum(c[2]["cached_tokens"] for c in convs) / held,
        "turn3_coverage_min": min(cover),
        "turn3_coverage_median": statistics.median(cover),
        "goal_met": sum(c[2]["cached_tokens"] for c in convs) / held >= 0.8,
    }


async def ttft_probes(url: str, plan: dict[str, Any]) -> dict[str, Any]:
    """(b): at concurrency 1, a follow-up turn (history cached) against the same prompt cold."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    for i in range(plan["probes"]):
        first = opening(100 + i, plan["probe_words"])
        messages = [{"role": "user", "content": first}]
        r = await chat_turn(client, messages, 32)
        messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": FOLLOW_UPS[0]}]
        warm = await chat_turn(client, messages, 8)
        cold_messages = [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] {first}"}] + messages[1:]
        cold = await chat_turn(client, cold_messages, 8)  # nothing of it cached but the template's head
        rows.append({"warm": warm | {"text": None}, "cold": cold | {"text": None}})
    await client.close()
    warm_ms = [1e3 * r["warm"]["ttft_s"] for r in rows]
    cold_ms = [1e3 * r["cold"]["ttft_s"] for r in rows]
    ratio = statistics.median(cold_ms) / statistics.median(warm_ms)
    return {
        "probes": rows,
        "prompt_tokens": statistics.median(r["warm"]["prompt_tokens"] for r in rows),
        "warm_ttft_ms_p50": statistics.median(warm_ms),
        "cold_ttft_ms_p50": statistics.median(cold_ms),
        "warm_cached_tokens_p50": statistics.median(r["warm"]["cached_tokens"] for r in rows),
        "cold_cached_tokens_p50": statistics.median(r["cold"]["cached_tokens"] for r in rows),
        "cold_over_warm": ratio,
        "goal_met": ratio >= 3.0,
    }


async def throughput(url: str, plan: dict[str, Any]) -> dict[str, Any]:
    """(c): closed-loop chat at c=32 and c=64, alternated ``tput_rounds`` times (drift favours neither)."""
    prompts = [p for _, _, p in CHAT_PROMPTS]
    cells: dict[int, list[dict[str, Any]]] = {32: [], 64: []}
    await closed_loop(url, prompts, 8, 8, 8)  # warm-up
    for rnd in range(plan["tput_rounds"]):
        for c in (32, 64) if rnd % 2 == 0 else (64, 32):
            cells[c].append(await closed_loop(url, prompts, c, plan["tput_per_c"] * c, plan["max_tokens"]))
    tok_s = {c: sum(x["tok_s"] for x in v) / len(v) for c, v in cells.items()}
    return {
        "cells": {str(c): v for c, v in cells.items()},
        "tok_s_c32": tok_s[32],
        "tok_s_c64": tok_s[64],
        "c64_over_c32": tok_s[64] / tok_s[32],
        "ttft_p50_ms_c32": percentile([x["ttft_p50_ms"] for x in cells[32]], 50),
        "ttft_p50_ms_c64": percentile([x["ttft_p50_ms"] for x in cells[64]], 50),
        "goal_met": tok_s[64] >= tok_s[32],
    }


def cluster_for(workdir: Path, replicas: int, num_threads: int) -> LocalCluster:
    return LocalCluster(
        workdir,
        nodes=1,
        args_patch={
            "engine": {
                "max_model_len": 4096,
                "max_num_seqs": 64,
                "num_threads": num_threads,
                "kv_cache_memory_gb": 1.0,  # ~23k tokens per replica: every conversation's blocks fit
                "proposers": [{"name": "ngram"}, {"name": "suffix"}],
            },
            "target": {"num_replicas": replicas, "num_cpus": 0.5},
            "draft": {"enabled": False},
        },
    )


def wait_replicas(c: LocalCluster, n: int, timeout_s: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        with contextlib.suppress(Exception):
            if sum(v["age_s"] < 2 for v in c.stats()["replicas"].values()) >= n:
                return
        time.sleep(1)
    raise TimeoutError(f"fewer than {n} target replicas report load")


def render(result: dict[str, Any], name: str) -> None:
    conv, probe, tput = result["conversations"], result["ttft"], result["throughput"]
    cols = [  # (key in a cluster size's (a) result, header, format)
        ("replicas", "replicas", "s"),
        ("turn3_coverage_total", "turn-3 cached / turn-2 prompt+answer", ".3f"),
        ("turn3_coverage_min", "min over convs", ".3f"),
        ("turn3_coverage_median", "median", ".3f"),
        ("wall_s", "wall s", ".1f"),
    ]
    rows = [{"replicas": r, **conv[r]} for r in conv]
    print(format_table(rows, cols, title="(a) multi-turn: turn 3's cached_tokens (goal >= 0.80)"))
    print(
        f"(b) TTFT at c=1, {probe['prompt_tokens']:.0f}-token prompts: follow-up {probe['warm_ttft_ms_p50']:.0f} ms "
        f"vs cold {probe['cold_ttft_ms_p50']:.0f} ms = {probe['cold_over_warm']:.1f}x lower (goal >= 3x)"
    )
    print(
        f"(c) closed-loop chat: c=32 {tput['tok_s_c32']:.1f} tok/s, c=64 {tput['tok_s_c64']:.1f} tok/s "
        f"= {tput['c64_over_c32']:.2f}x (goal >= 1)"
    )
    panels: list[dict[str, Any]] = [  # bar_panel's arguments, one panel each for (a), (b), (c)
        {
            "groups": [f"{r} replica(s)" for r in conv],
            "series": {"turn 3 cached share": [conv[r]["turn3_coverage_total"] for r in conv]},
            "ylabel": "share of turn 2's prompt + answer",
            "title": "(a) turn 3 finds turn 2's KV (goal 0.8)",
            "hline": 0.8,
        },
        {
            "groups": ["follow-up (cached)", "cold"],
            "series": {"TTFT p50": [probe["warm_ttft_ms_p50"], probe["cold_ttft_ms_p50"]]},
            "ylabel": "ms",
            "title": f"(b) TTFT, {probe['cold_over_warm']:.1f}x lower (goal 3x)",
            "fmt": "{:.0f}",
        },
        {
            "groups": ["c=32", "c=64"],
            "series": {"output tok/s": [tput["tok_s_c32"], tput["tok_s_c64"]]},
            "ylabel": "tok/s",
            "title": f"(c) closed-loop chat, {tput['c64_over_c32']:.2f}x (goal 1)",
            "fmt": "{:.1f}",
        },
    ]
    fig, axes = figure(len(panels), width=4.6, height=4.0)
    for ax, panel in zip(axes, panels):
        bar_panel(ax, **panel)
    title = "multi-turn chat" + (" (contended machine)" if result["contended"] else "")
    save_result(RESULTS_DIR / name, result, fig, title=title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 conversations, 2 probes, one throughput round")
    ap.add_argument("--replicas", default="1,2", help="cluster sizes for (a); (b) and (c) run on the first")
    ap.add_argument("--num-threads", type=int, default=1, help="engine threads per target replica")
    ap.add_argument("--contended", action="store_true", help="mark the result as taken on a shared machine")
    ap.add_argument("--tag", help="write multiturn_bench_<tag>.{json,png}")
    ap.add_argument("--render", action="store_true", help="redraw the table and PNG from the saved JSON only")
    a = ap.parse_args()
    plan = dict(QUICK if a.quick else FULL)
    name = "multiturn_bench" + (f"_{a.tag}" if a.tag else "")
    if a.render:
        render(json.loads((RESULTS_DIR / f"{name}.json").read_text()), name)
        return
    result: dict[str, Any] = {
        "env": env_info(),
        "plan": plan,
        "contended": a.contended,
        "command": "python -m benchmarks.serving.multiturn_bench"
        + (" --quick" if a.quick else "")
        + (f" --tag {a.tag}" if a.tag else "")
        + (" --contended" if a.contended else ""),
        "conversations": {},
    }
    for i, n in enumerate(int(x) for x in a.replicas.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            c = cluster_for(Path(tmp), n, a.num_threads)
            try:
                t0 = time.perf_counter()
                c.start()
                wait_replicas(c, n)
                print(f"[{n} replica(s)] up in {time.perf_counter() - t0:.0f} s", flush=True)
                httpx.post(
                    f"{c.base_url}/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                    timeout=300,
                )
                result["conversations"][str(n)] = asyncio.run(conversations(c.base_url, plan))
                conv = result["conversations"][str(n)]
                print(f"[{n} replica(s)] (a) turn-3 coverage {conv['turn3_coverage_total']:.3f}", flush=True)
                if i == 0:
                    result["ttft"] = asyncio.run(ttft_probes(c.base_url, plan))
                    result["throughput"] = asyncio.run(throughput(c.base_url, plan))
            finally:
                c.stop()
    render(result, name)


if __name__ == "__main__":
    main()
