"""What the Serve layer costs: in-process engine vs the same engine behind HTTP, at c=1.

    python -m benchmarks.serving.http_overhead [--quick]

One run, interleaved, same prompts and config (SmolLM2, fp32, greedy, ignore EOS):
- time per output token (TPOT) of plain decoding in process vs over HTTP (goal <= 1.10x);
- time per engine step with the draft model (the target as its own draft, K=4) in process vs
  through the draft worker deployment: the difference is the per-step cost of the remote
  draft call (serialization + RPC + the draft worker's own scheduling).
Writes benchmarks/results/http_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, env_info, format_table, save_result
from benchmarks.speculation.spec_bench import CHAT_PROMPTS
from cluster.local_cluster import LocalCluster
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model
from workers.proposers.draft_model import DraftModelProposer

MODEL = "SmolLM2-135M-Instruct"


def inproc(eng: LLMEngine, prompt: list[int], n: int, **kw: Any) -> tuple[float, int, int]:
    """(seconds from first token to last, output tokens, engine steps after the first token)."""
    rid = uuid.uuid4().hex
    eng.add_request(rid, prompt, {"max_tokens": n, "ignore_eos": True}, **kw)
    first = None
    steps = 0
    while eng.has_work():
        outs = eng.step()
        if any(o.token_ids for o in outs):
            if first is None:
                first = time.perf_counter()
            else:
                steps += 1
    return time.perf_counter() - first, n, steps


def over_http(url: str, text: str, n: int, **extra: Any) -> tuple[float, int, int]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    first = None
    usage: dict[str, Any] = {}
    import json

    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            elif first is None and ev["choices"] and ev["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    spec = usage["speculation"]
    return time.perf_counter() - first, usage["completion_tokens"], spec["spec_steps"] + spec["plain_steps"] - 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    n, reps = (12, 1) if a.quick else (48, 3)
    texts = [p for _, _, p in CHAT_PROMPTS[: 1 if a.quick else 3]]
    loaded = load_model("smollm2")
    cfg = EngineConfig(max_num_seqs=4, max_model_len=1024, num_threads=2, num_speculative_tokens=4)
    eng = LLMEngine(
        cfg,
        loaded,
        proposers={
            "draft_model": DraftModelProposer(
                loaded.model, num_slots=4, max_model_len=1024, target_vocab_size=loaded.model.config.vocab_size
            )
        },
    )
    prompts = [eng.tokenize_chat([{"role": "user", "content": t}]) for t in texts]
    acc: dict[str, list[float]] = {
        k: [] for k in ("inproc_plain", "http_plain", "inproc_draft_step", "http_draft_step")
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(
            Path(tmp),
            policy={"name": "always", "num_speculative_tokens": 4},
            args_patch={
                "engine": {"max_num_seqs": 4, "max_model_len": 1024, "num_threads": 2},
                "draft": {"num_threads": 2, "model": "target"},
            },
        )  # the in-process proposer drafts with the target too
        try:
            cluster.start()
            for kw in ({"speculation": "off"}, {"speculation": "on", "proposer": "draft_model"}):  # warm-up
                over_http(cluster.base_url, texts[0], 4, **kw)
                inproc(eng, prompts[0], 4, **kw)
            for _ in range(reps):
                for text, prompt in zip(texts, prompts):
                    s, k, _ = inproc(eng, prompt, n, speculation="off")
                    acc["inproc_plain"].append(s / (k - 1))
                    s, k, _ = over_http(cluster.base_url, text, n, speculation="off")
                    acc["http_plain"].append(s / (k - 1))
                    s, k, steps = inproc(eng, prompt, n, speculation="on", proposer="draft_model")
                    acc["inproc_draft_step"].append(s / max(steps, 1))
                    s, k, steps = over_http(cluster.base_url, text, n, speculation="on", proposer="draft_model")
                    acc["http_draft_step"].append(s / max(steps, 1))
        finally:
            cluster.stop()
    med = {k: 1e3 * statistics.median(v) for k, v in acc.items()}
    rows = [
        {
            "what": "plain TPOT (ms)",
            "in_process": med["inproc_plain"],
            "http": med["http_plain"],
            "ratio": med["http_plain"] / med["inproc_plain"],
        },
        {
            "what": "draft-model step (ms)",
            "in_process": med["inproc_draft_step"],
            "http": med["http_draft_step"],
            "ratio": med["http_draft_step"] / med["inproc_draft_step"],
        },
    ]
    extra = med["http_draft_step"] - med["inproc_draft_step"] - (med["http_plain"] - med["inproc_plain"])
    print(
        format_table(
            rows,
            [
                ("what", "", "s"),
                ("in_process", "in process", ".1f"),
                ("http", "over HTTP", ".1f"),
                ("ratio", "ratio", ".2f"),
            ],
            title=f"Serve overhead at c=1, {n} tokens, median of runs",
        )
    )
    print(f"remote draft call cost per step (beyond the HTTP overhead): {extra:.1f} ms")
    result = {
        "env": env_info(),
        "rows": rows,
        "remote_draft_extra_ms": extra,
        "samples_ms": {k: [1e3 * x for x in v] for k, v in acc.items()},
    }
    save_result(RESULTS_DIR / "http_overhead", result)


if __name__ == "__main__":
    main()
