"""A 6,000-token prompt beside 96 short streams, with the context at 8192 and 128 running requests, in a
1.5 GiB KV pool: does the service start, does everything complete, and what do the replicas' RSS reach?

    python -m benchmarks.serving.long_context            # writes results/long_context.{json,png}
    python -m benchmarks.serving.long_context --streams 8 --out /tmp/lc   # a quick look

Starts a one-node local cluster (cluster/local_cluster.py) with ``engine.max_model_len: 8192``,
``engine.max_num_seqs: 128``, ``engine.kv_cache_memory_gb: 1.5`` and the shipped draft worker, sends the
long prompt (completions, 16 output tokens) while ``--streams`` chat streams of 32 tokens run, and samples
the RSS of the target replica and the draft worker (psutil, by the pid their ``placement()`` reports)
every 0.25 s: RSS, not the pools' sizes, is what the replica costs the machine (a pool is zeroed, so
committed, at startup: ``rss_gb_idle`` already holds it). Before the paged pools, the draft worker alone
reserved ``draft.max_num_seqs x max_model_len`` positions; ``draft_kv`` in the result gives both sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS_DIR, env_info, save_result

ARGS = {
    "engine": {"max_model_len": 8192, "max_num_seqs": 128, "kv_cache_memory_gb": 1.5, "num_threads": 2},
    "target": {"max_ongoing_requests": 160, "max_queued_requests": 256},
    "ingress": {"request_timeout_s": 1500},  # a busy shared machine prefills slowly; this measures memory, not time
    "draft": {"max_num_seqs": 256},
}
GOAL_RSS_GB = 4.5


def draft_kv_sizes() -> dict[str, Any]:
    """Bytes of the shipped draft worker's KV: the slot cache it had (draft.max_num_seqs x max_model_len, at the
    old and the new defaults) and the pools it has (draft.kv_cache_memory_gb). Arithmetic on the model configs."""
    from cluster.config import AppConfig
    from cluster.local_cluster import shipped_config
    from deployments.draft import draft_kv_blocks
    from workers.eagle_head import load_head
    from workers.kv_blocks import kv_bytes_per_token
    from workers.model_loader import resolve_local_dir

    args = AppConfig.model_validate(shipped_config()["applications"][0]["args"])
    d = args.draft
    import json

    mc = json.loads((resolve_local_dir(d.model) / "config.json").read_text())
    per_token = [kv_bytes_per_token(mc["num_hidden_layers"], mc["num_key_value_heads"], mc["head_dim"], 4)]  # fp32
    if d.eagle:
        h = load_head(d.eagle).cfg
        per_token.append(kv_bytes_per_token(1, h.num_key_value_heads, h.head_dim, 4))
    bs, max_len = args.engine.block_size, args.engine.max_model_len
    blocks = draft_kv_blocks(d.kv_cache_memory_gb, per_token, bs, max_len, d.max_num_seqs)
    return {
        "bytes_per_token": per_token,
        "slot_cache_old_defaults_gib": 64 * 2048 * sum(per_token) / 2**30,  # draft.max_num_seqs 64 x 2048
        "slot_cache_new_defaults_gib": d.max_num_seqs * max_len * sum(per_token) / 2**30,
        "pool_gib": blocks * bs * sum(per_token) / 2**30,
        "pool_tokens_per_proposer": blocks * bs,
    }


class RssSampler:
    """The RSS of some pids every ``interval_s`` seconds, in a thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.samples: list[dict[str, float]] = []
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = {"t": time.monotonic() - self._t0}
            for name, p in self.procs.items():
                row[name] = p.memory_info().rss / 1e9
            self.samples.append(row)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, name: str) -> float:
        return max(s[name] for s in self.samples)


async def load(base_url: str, streams: int, long_tokens: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    model = "SmolLM2-135M-Instruct"

    async def long() -> dict[str, Any]:
        t0 = time.monotonic()
        out = await client.completions.create(model=model, prompt=" word" * long_tokens, max_tokens=16)
        assert out.usage is not None
        return {
            "prompt_tokens": out.usage.prompt_tokens,
            "completion_tokens": out.usage.completion_tokens,
            "latency_s": time.monotonic() - t0,
        }

    async def stream(i: int) -> int:
        s = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from {i} upwards, one number a line."}],
            max_tokens=32,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                n += 1
        return n

    t0 = time.monotonic()
    streams_task = asyncio.gather(*(stream(i) for i in range(streams)), return_exceptions=True)
    await asyncio.sleep(0.5)  # the streams are running when the long prompt arrives
    try:
        long_out = await long()
    except openai.OpenAIError as e:  # recorded: the RSS samples still say what memory did
        long_out = {"error": repr(e)}
    chunks = await streams_task
    errors = [repr(c) for c in chunks if isinstance(c, BaseException)]
    return {
        "long": long_out,
        "streams_done": sum(1 for c in chunks if isinstance(c, int) and c > 0),
        "stream_errors": errors[:5],
        "wall_s": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    from cluster.local_cluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=6000)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "long_context")
    a = ap.parse_args(argv)
    env = env_info()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), args_patch=ARGS, nodes=1)
        t0 = time.monotonic()
        try:
            cluster.start()
            start_s = time.monotonic() - t0
            pids = {
                "target": cluster.call("TargetWorker", "placement")["pid"],
                "draft": cluster.call("DraftWorker", "placement")["pid"],
            }
            idle = {n: psutil.Process(p).memory_info().rss / 1e9 for n, p in pids.items()}
            with RssSampler(pids) as rss:
                run = asyncio.run(load(cluster.base_url, a.streams, a.long_tokens))
            draft_stats = cluster.call("DraftWorker", "stats")
        finally:
            cluster.stop()
    result = {
        "env": env,
        "config": ARGS,
        "streams": a.streams,
        "start_s": round(start_s, 1),
        **run,
        "rss_gb_idle": idle,
        "rss_gb_peak": {n: rss.peak(n) for n in pids},
        "goal_target_rss_gb": GOAL_RSS_GB,
        "target_rss_under_goal": rss.peak("target") < GOAL_RSS_GB,
        "draft_stats_after": draft_stats,
        "draft_kv": draft_kv_sizes(),
        "samples": rss.samples,
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in pids:
        ax.plot([s["t"] for s in rss.samples], [s[name] for s in rss.samples], label=f"{name} replica RSS")
    ax.axhline(GOAL_RSS_GB, color="red", ls="--", lw=0.8, label="goal for the target")
    ax.set_xlabel("s since the load started")
    ax.set_ylabel("GB")
    ax.legend(fontsize=8)
    save_result(
        a.out, result, fig, title=f"{a.long_tokens}-token prompt + {a.streams} streams, max_model_len 8192, KV 1.5 GiB"
    )
    print({k: result[k] for k in ("start_s", "long", "streams_done", "wall_s", "rss_gb_idle", "rss_gb_peak")})
    return 0 if result["target_rss_under_goal"] and result["streams_done"] == a.streams else 1


if __name__ == "__main__":
    raise SystemExit(main())
