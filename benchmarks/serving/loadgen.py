"""HTTP load generators for the serving benchmarks: streaming OpenAI chat requests over loopback.

Two shapes of closed loop (a client sends its next request when its last one ends):

- :func:`closed_loop` runs a bounded number of requests at N clients and reports one cell;
- :class:`ContinuousLoad` keeps N clients streaming back to back in a thread of its own until
  stopped, and keeps every request's absolute chunk times, so that a caller can cut the run into
  time windows afterwards (benchmarks/serving/switchback.py does, one routing mode per window).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx

from benchmarks.common import percentile

MODEL = "SmolLM2-135M-Instruct"


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request (``ignore_eos``: every request writes exactly ``max_tokens``).

    Times are ``time.perf_counter()`` seconds: ``t0`` (sent), ``chunks`` (each content chunk's
    arrival; a chunk can carry several tokens when a step commits drafts), ``t1`` (stream ended)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            elif ev["choices"] and ev["choices"][0]["delta"].get("content"):
                chunks.append(time.perf_counter())
    t1 = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    return {
        "ttft": chunks[0] - t0 if chunks else t1 - t0,
        "e2e": t1 - t0,
        "tokens": n,
        "tpot": (t1 - chunks[0]) / (n - 1) if chunks and n > 1 else None,
        "gaps": [b - a for a, b in zip(chunks, chunks[1:])],
        "spec": usage.get("speculation", {}),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "t0": t0,
        "t1": t1,
        "chunks": chunks,
    }


async def closed_loop(url: str, prompts: list[str], concurrency: int, total: int, max_tokens: int) -> dict[str, Any]:
    """``total`` requests from ``concurrency`` clients; aggregate tok/s over the wall time and latencies."""
    queue = list(range(total))
    results: list[dict[str, Any]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(client, url, prompts[i % len(prompts)], max_tokens))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]]
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "tok_s": sum(r["tokens"] for r in ok) / wall,
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
        "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in ok], 50),
        # the slowest start and the slowest request: one stall shows here and in wall_s, not in the medians
        "ttft_max_ms": 1e3 * max((r["ttft"] for r in ok), default=float("nan")),
        "e2e_max_s": max((r["e2e"] for r in ok), default=float("nan")),
        "first_start_s": min((r["t0"] for r in ok), default=t0) - t0,
        "draft_tokens": sum(r["spec"].get("draft_tokens", 0) for r in ok),
        "accepted_tokens": sum(r["spec"].get("accepted_tokens", 0) for r in ok),
        "spec_steps": sum(r["spec"].get("spec_steps", 0) for r in ok),
        "plain_steps": sum(r["spec"].get("plain_steps", 0) for r in ok),
        # prefix caching: prompt tokens whose KV was reused (a miss on a long prompt costs seconds of TTFT)
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
    }


class ContinuousLoad:
    """``concurrency`` clients, each sending its next request the moment its last one ends, until
    :meth:`stop`. Runs its own event loop in a daemon thread, so the caller's thread stays free to
    switch policies and read counters while the load runs.

    Client i's j-th request is prompt ``(i + concurrency * j) mod len(prompts)``, and
    :meth:`restart` sets every client's j back to 0 at its next request. A caller that restarts
    the sequence at the start of each measured span gives every span the same prompts in the same
    order, as a bounded cell would (prompts differ in length and in how well they draft, so spans
    fed different prompts would differ for that reason alone)."""

    def __init__(self, url: str, prompts: list[str], concurrency: int, max_tokens: int) -> None:
        self.url, self.prompts, self.concurrency, self.max_tokens = url, prompts, concurrency, max_tokens
        self.records: list[dict[str, Any]] = []
        self.generation = 0  # bumped by restart()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()

    def restart(self) -> None:
        """Every client's next request starts the prompt sequence over (requests in flight finish)."""
        self.generation += 1

    def prompt_index(self, client: int, j: int) -> int:
        return (client + self.concurrency * j) % len(self.prompts)

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        self._started.set()

        async def client_loop(client: httpx.AsyncClient, i: int) -> None:
            gen, j = self.generation, 0
            while not self._stopping.is_set():
                if self.generation != gen:
                    gen, j = self.generation, 0
                prompt = self.prompts[self.prompt_index(i, j)]
                j += 1
                self.records.append(await one_request(client, self.url, prompt, self.max_tokens))

        async with httpx.AsyncClient(timeout=600) as client:
            tasks = [asyncio.create_task(client_loop(client, i)) for i in range(self.concurrency)]
            await self._stopping.wait()
            for t in tasks:  # the requests in flight are not needed: cancel them (the server aborts them)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> ContinuousLoad:
        self._thread.start()
        self._started.wait()
        return self

    def stop(self) -> list[dict[str, Any]]:
        """Cancel the requests in flight and return every finished request's record (errors included)."""
        assert self._stopping is not None
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=60)
        return list(self.records)
