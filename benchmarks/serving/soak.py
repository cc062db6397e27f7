"""Soak test: mixed load against a running specserve app, with disconnects sprinkled in.

    python -m benchmarks.serving.soak --url http://127.0.0.1:8000 --duration 60 --concurrency 32 \
        [--warmup 10] [--dashboard http://127.0.0.1:8265] [--api-key KEY] [--json out.json]

``concurrency`` closed-loop clients send, for ``warmup`` + ``duration`` seconds, a random mix
(seeded, reproducible) of chat / text completions, streaming / not, greedy / sampled,
speculation on (ngram, suffix, draft_model) / off / auto, and ``disconnect_rate`` of them hang
up early on purpose (a streaming client closes after its first chunk, a non-streaming one
times out). Bounded in time and count (``--max-requests``); loopback URLs only, so it cannot
be pointed at someone else's service by mistake.

Checked, and reported as one JSON object (exit status 1 when a check fails):
- unexpected errors: any non-200, a transport error that was not a planned disconnect, an
  error event or a missing ``[DONE]`` in a stream, a malformed body;
- greedy consistency: every greedy answer to the same (prompt, route, max_tokens) is the
  same text, whatever path (speculative / plain / draft model) and batch produced it;
- resident memory (RSS) of every Serve replica process (found through the Ray dashboard's
  Serve REST API, read locally with psutil; with ``--local`` also the Serve controller and the
  HTTP proxy) at start, after warm-up, every ``rss_every_s`` and at the end: the median over the
  last ``rss_window_s`` of the load must be within ``rss_tolerance`` of the median over the last
  ``rss_window_s`` of the warm-up, and no replica may have restarted. The
  warm-up must outlast the memory a process takes once and keeps (first-touch pages, library
  caches filling up: docs/operations.md), so that the baseline is the plateau;
- nothing left running: after the load stops (requests still in flight ``grace_s`` after the
  end are hung up on, which cancels them), every target replica's ``running`` and ``waiting``
  (from ``/v1/speculation/stats``) return to 0 within ``drain_timeout_s``; with ``--local``, the
  draft worker holds no request state after ``draft.state_ttl_s`` (+ a sweep period), and once
  the cluster is stopped none of its processes is left.

A progress line goes to stderr every ``progress_every_s``; with ``--json`` a PNG of RSS over
time per process is written beside the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.common import save_result

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Fix the typo and repeat the sentence: 'The cat sat on teh mat and looked at the door.'",
    'Copy this JSON and change the age to 31: {"name": "Ada", "age": 30, "city": "London"}',
    "Write one sentence about the sea.",
    "List three colours.",
]
PROPOSERS = ["ngram", "suffix", "draft_model"]


@dataclass
class Tally:
    started: int = 0
    ok: int = 0
    disconnected: int = 0  # planned early hang-ups
    errors: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(what[:300])


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------- replica memory


def serve_system_pids(procs: list[Any]) -> dict[str, int]:
    """The Serve controller and HTTP proxy among a local cluster's processes (Ray names them ``ray::<Actor>``)."""
    out: dict[str, int] = {}
    for p in procs:
        try:
            title = " ".join(p.cmdline()[:1])
        except Exception:  # psutil.Error: gone, or not ours to read
            continue
        for actor in ("ServeController", "ProxyActor"):
            if title.startswith(f"ray::{actor}"):
                out[f"{actor}#{p.pid}"] = p.pid
    return out


def replica_pids(dashboard: str | None) -> dict[str, int]:
    """Running Serve replicas (``Deployment#replica`` -> pid), from the Ray dashboard's Serve REST API."""
    if not dashboard:
        return {}
    r = httpx.get(dashboard.rstrip("/") + "/api/serve/applications/", timeout=30)
    r.raise_for_status()
    out: dict[str, int] = {}
    for app in r.json().get("applications", {}).values():
        for name, dep in app.get("deployments", {}).items():
            for rep in dep.get("replicas", []):
                if rep.get("state") == "RUNNING" and rep.get("pid"):
                    out[f"{name}#{rep['replica_id']}"] = int(rep["pid"])
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float | None]:
    import psutil

    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = None  # gone: the replica died or was replaced
    return out


# ----------------------------------------------------------------------------- one request


def make_request(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["chat", "chat", "completion"])
    greedy = rng.random() < 0.6
    spec = rng.choice(["on", "on", "off", "auto"])
    prompt_i = rng.randrange(len(PROMPTS))
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": rng.choice([12, 24]) if greedy else rng.randint(4, 32),
        "temperature": 0 if greedy else rng.choice([0.7, 1.0]),
        "speculation": spec,
    }
    if spec != "off":
        body["proposer"] = rng.choice(PROPOSERS)
    if not greedy:
        body["seed"] = rng.randrange(1 << 30)
        body["top_p"] = rng.choice([1.0, 0.9])
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": PROMPTS[prompt_i]}]
    else:
        body["prompt"] = PROMPTS[prompt_i]
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {
        "kind": kind,
        "body": body,
        "greedy": greedy,
        "key": (kind, prompt_i, body["max_tokens"]),
        "hangup_s": rng.uniform(0.2, 1.0),
    }


async def run_one(
    client: httpx.AsyncClient,
    url: str,
    req: dict[str, Any],
    disconnect: bool,
    tally: Tally,
    greedy_ref: dict,
    timeout_s: float,
) -> None:
    path = "/v1/chat/completions" if req["kind"] == "chat" else "/v1/completions"
    body = req["body"]
    label = (
        f"{req['kind']} stream={body.get('stream', False)} spec={body['speculation']} "
        f"proposer={body.get('proposer')} T={body['temperature']}"
    )
    tally.started += 1
    t0 = time.monotonic()
    text: str | None = None
    try:
        if body.get("stream"):
            async with client.stream("POST", url + path, json=body, timeout=timeout_s) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.error(f"{label}: HTTP {r.status_code} {r.text[:200]}")
                    return
                parts, done, usage = [], False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        tally.error(f"{label}: error event {obj['error']}")
                        return
                    if disconnect:  # hang up after the first chunk: leaving the block closes the connection
                        tally.disconnected += 1
                        return
                    for c in obj.get("choices", []):
                        parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                    usage = obj.get("usage") or usage
                if not done or usage is None:
                    tally.error(f"{label}: stream ended without [DONE] or usage")
                    return
                text = "".join(parts)
        else:
            if disconnect:  # hang up before the answer: a client-side timeout closes the connection
                try:
                    await client.post(url + path, json=body, timeout=req["hangup_s"])
                except httpx.TimeoutException:
                    tally.disconnected += 1
                    return
                tally.ok += 1  # it was quick enough to finish first
                return
            r = await client.post(url + path, json=body, timeout=timeout_s)
            if r.status_code != 200:
                tally.error(f"{label}: HTTP {r.status_code} {r.text[:200]}")
                return
            obj = r.json()
            ch = obj["choices"][0]
            text = ch["message"]["content"] if req["kind"] == "chat" else ch["text"]
            if obj["usage"]["completion_tokens"] < 1:
                tally.error(f"{label}: no tokens")
                return
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        tally.error(f"{label}: {type(e).__name__}: {e}")
        return
    tally.ok += 1
    tally.latencies_s.append(time.monotonic() - t0)
    k = f"{req['kind']}/{'stream' if body.get('stream') else 'unary'}/{'greedy' if req['greedy'] else 'sampled'}"
    tally.by_kind[k] = tally.by_kind.get(k, 0) + 1
    if req["greedy"] and text is not None:
        ref = greedy_ref.setdefault(req["key"], text)
        tally.greedy_checked += 1
        if ref != text:
            tally.greedy_mismatches += 1
            tally.error(f"{label}: greedy output differs from an earlier answer: {ref!r} != {text!r}")


# ----------------------------------------------------------------------------- the run


async def drain(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, Any]:
    """Wait until no target replica has a request running or waiting; return the last loads seen."""
    t0 = time.monotonic()
    loads: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        try:
            r = await client.get(url + "/v1/speculation/stats", timeout=10)
            loads = {
                rid: {k: v.get(k) for k in ("running", "waiting", "kv_tokens_in_use")}
                for rid, v in r.json().get("replicas", {}).items()
                if v.get("age_s", 99) < 5
            }
            if loads and all(v["running"] == 0 and v["waiting"] == 0 for v in loads.values()):
                return {"drained": True, "seconds": round(time.monotonic() - t0, 2), "loads": loads}
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return {"drained": False, "seconds": round(time.monotonic() - t0, 2), "loads": loads}


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    tally_warm, tally = Tally(), Tally()
    greedy_ref: dict = {}
    pids = {**replica_pids(args.dashboard), **getattr(args, "system_pids", {})}
    rss = {"start": rss_mb(pids)}
    timeline: list[dict[str, Any]] = []
    t_start = time.monotonic()
    warm_end = t_start + args.warmup
    end = warm_end + args.duration
    budget = {"left": args.max_requests}

    async with httpx.AsyncClient(headers=headers, limits=httpx.Limits(max_connections=args.concurrency * 2)) as client:

        async def worker(i: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() < end and budget["left"] > 0:
                budget["left"] -= 1
                req = make_request(wrng)
                target = tally_warm if time.monotonic() < warm_end else tally
                await run_one(
                    client, url, req, wrng.random() < args.disconnect_rate, target, greedy_ref, args.request_timeout_s
                )

        async def mark_warm() -> None:
            await asyncio.sleep(max(0.0, warm_end - time.monotonic()))
            rss["after_warmup"] = rss_mb(pids)

        async def sample_rss() -> None:  # a timeline, to tell a plateau from a leak in long runs
            next_progress = args.progress_every_s
            while True:
                await asyncio.sleep(args.rss_every_s)
                t = round(time.monotonic() - t_start)
                timeline.append({"t": t, **rss_mb(pids)})
                if t >= next_progress:
                    next_progress += args.progress_every_s
                    phase = "warm-up" if time.monotonic() < warm_end else "measured"
                    mem = " ".join(f"{n.split('#')[0]}={v}" for n, v in timeline[-1].items() if n != "t")
                    print(
                        f"[soak] t={t}s/{args.warmup + args.duration:.0f}s {phase}: requests "
                        f"{tally_warm.started + tally.started} ok {tally_warm.ok + tally.ok} errors "
                        f"{tally_warm.errors + tally.errors} greedy mismatches "
                        f"{tally.greedy_mismatches + tally_warm.greedy_mismatches}; "
                        f"RSS MB {mem}",
                        file=sys.stderr,
                        flush=True,
                    )

        marker = asyncio.create_task(mark_warm())
        sampler = asyncio.create_task(sample_rss())
        tasks = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
        # after the end, requests in flight get ``grace_s`` to finish; the rest are hung up on
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, end + args.grace_s - time.monotonic()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await marker
        sampler.cancel()
        load_seconds = time.monotonic() - t_start
        drained = await drain(client, url, args.drain_timeout_s)
    rss["end"] = rss_mb(pids)

    growth: dict[str, float | None] = {}
    # RSS swings with the batch (the target's by several percent between samples), so each side is the
    # median of the samples in the last ``rss_window_s`` of the warm-up and of the load, where there are any
    windows = {
        "after_warmup": (args.warmup - args.rss_window_s, args.warmup),
        "end": (args.warmup + args.duration - args.rss_window_s, args.warmup + args.duration),
    }
    rss_median: dict[str, dict[str, float | None]] = {}
    for side, (t0, t1) in windows.items():
        rss_median[side] = {}
        for name in pids:
            vals = [x[name] for x in timeline if t0 <= x["t"] <= t1 and x.get(name) is not None]
            rss_median[side][name] = statistics.median(vals) if vals else rss[side].get(name)
    for name in pids:
        a, b = rss_median["after_warmup"][name], rss_median["end"][name]
        growth[name] = None if (a is None or b is None) else round(b / a - 1, 4)
    now_pids = {
        **replica_pids(args.dashboard),
        **{n: p for n, p in getattr(args, "system_pids", {}).items() if rss["end"].get(n) is not None},
    }
    restarted = sorted(n for n in pids if now_pids.get(n) != pids[n] or rss["end"].get(n) is None)
    lat = sorted(tally.latencies_s)
    report = {
        "url": url,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "load_seconds": round(load_seconds, 1),
        "concurrency": args.concurrency,
        "warmup": {
            "requests": tally_warm.started,
            "ok": tally_warm.ok,
            "disconnected": tally_warm.disconnected,
            "errors": tally_warm.errors,
        },
        "requests": tally.started,
        "ok": tally.ok,
        "disconnected": tally.disconnected,
        "cut_at_end": len(pending),
        "errors": tally.errors + tally_warm.errors,
        "error_samples": (tally_warm.error_samples + tally.error_samples)[:20],
        "greedy_checked": tally.greedy_checked + tally_warm.greedy_checked,
        "greedy_mismatches": tally.greedy_mismatches + tally_warm.greedy_mismatches,
        "by_kind": tally.by_kind,
        "latency_s": {"p50": round(lat[len(lat) // 2], 2), "p99": round(lat[int(len(lat) * 0.99)], 2)} if lat else {},
        "rss_mb": rss,
        "rss_median_mb": rss_median,
        "rss_growth_after_warmup": growth,
        "rss_tolerance": args.rss_tolerance,
        "rss_timeline_mb": timeline,
        "replicas": pids,
        "replicas_restarted": restarted,
        "drain": drained,
    }
    over = {n: g for n, g in growth.items() if g is not None and g > args.rss_tolerance}
    report["checks"] = {
        "no_errors": report["errors"] == 0,
        "rss_flat": not over and not report["replicas_restarted"],
        "nothing_left_running": drained["drained"],
    }
    report["passed"] = all(report["checks"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds of load, after the warm-up")
    ap.add_argument(
        "--warmup",
        type=float,
        default=300.0,
        help="seconds of the same load before the RSS baseline: long enough for every process to reach its plateau",
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests in all")
    ap.add_argument("--disconnect-rate", type=float, default=0.1)
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument(
        "--grace-s",
        type=float,
        default=60.0,
        help="after the end, how long requests in flight may finish before they are hung up on",
    )
    ap.add_argument("--drain-timeout-s", type=float, default=30.0)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument(
        "--rss-window-s",
        type=float,
        default=60.0,
        help="the RSS check compares medians of the samples in the last this many seconds of warm-up and of load",
    )
    ap.add_argument("--progress-every-s", type=float, default=30.0, help="a progress line on stderr this often")
    ap.add_argument("--rss-every-s", type=float, default=15.0, help="RSS timeline sampling period")
    ap.add_argument("--dashboard", default=None, help="Ray dashboard URL, to find the replica processes (RSS)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument(
        "--local",
        action="store_true",
        help="start a two-node local Ray cluster with ray_config.yaml (cluster/local_cluster.py), soak it, "
        "stop it; --url and --dashboard are then taken from it",
    )
    ap.add_argument(
        "--args-patch",
        default=None,
        help='with --local: JSON merged into the app\'s args per section, e.g. \'{"draft": {"model": "target"}}\'',
    )
    args = ap.parse_args(argv)
    if args.local:
        return _soak_local(args)
    if not is_loopback(args.url):
        ap.error(f"--url must be a loopback address (127.0.0.1, ::1, localhost), not {args.url}")
    return _report(asyncio.run(soak(args)), args)


def _soak_local(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from cluster.local_cluster import LocalCluster, shipped_app_args

    with tempfile.TemporaryDirectory() as tmp:
        patch = json.loads(args.args_patch) if args.args_patch else {}
        cluster = LocalCluster(Path(tmp), args_patch=patch or None)
        try:
            t0 = time.time()
            cluster.start()
            print(
                f"[soak] local cluster up in {time.time() - t0:.0f} s at {cluster.base_url}",
                file=sys.stderr,
                flush=True,
            )
            args.url, args.dashboard = cluster.base_url, f"http://127.0.0.1:{cluster.dash_port}"
            procs = cluster.processes()
            args.system_pids = serve_system_pids(procs)
            report = asyncio.run(soak(args))
            ttl = float({**shipped_app_args().get("draft", {}), **patch.get("draft", {})}.get("state_ttl_s", 60.0))
            report["draft_state"] = _draft_state_after(cluster, ttl + min(5.0, ttl / 2) + 5.0)
            report["checks"]["draft_state_freed"] = report["draft_state"].get("known") == 0
        finally:
            cluster.stop()
        report["leftover_processes"] = _leftovers(procs, timeout_s=15.0)
        report["checks"]["no_leftover_processes"] = not report["leftover_processes"]
        report["passed"] = all(report["checks"].values())
        return _report(report, args)


def _draft_state_after(cluster: Any, wait_s: float) -> dict[str, Any]:
    """The draft worker's stats once its state sweep has had time to run (``known``: requests it holds state for)."""
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    while True:
        try:
            last = cluster.call("DraftWorker", "stats")
        except Exception as e:  # no draft worker in this app, or the call failed: say so in the report
            return {"error": str(e)[-300:]}
        if last.get("known") == 0 or time.monotonic() - t0 > wait_s:
            return {**last, "seconds": round(time.monotonic() - t0, 1)}
        time.sleep(5.0)


def _leftovers(procs: list[Any], timeout_s: float) -> list[str]:
    """Processes of the stopped cluster still alive after ``timeout_s`` (same pid and start time)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    alive: list[Any] = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
    out = []
    for p in alive:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline()[:2])}"[:200])
        except psutil.Error:
            pass
    return out


def _report(report: dict[str, Any], args: argparse.Namespace) -> int:
    print(json.dumps(report, indent=2))
    if args.json:
        save_result(Path(args.json).with_suffix(""), report, fig=_plot(report), title="soak: RSS per process")
    return 0 if report["passed"] else 1


def _plot(report: dict[str, Any]) -> Any:
    """RSS over time per process, each relative to its post-warm-up value (the band is the tolerance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axr) = plt.subplots(1, 2, figsize=(12, 4.5))
    tl = report["rss_timeline_mb"]
    base = report["rss_mb"].get("after_warmup", {})
    for name in report["replicas"]:
        pts = [(s["t"], s[name]) for s in tl if s.get(name) is not None]
        if not pts:
            continue
        ts, mb = zip(*pts)
        ax.plot(ts, mb, label=name.split("#")[0])
        if base.get(name):
            axr.plot(ts, [100 * (m / base[name] - 1) for m in mb], label=name.split("#")[0])
    for a in (ax, axr):
        a.axvline(report["warmup_s"], color="grey", ls=":", label="end of warm-up")
        a.set_xlabel("seconds since start")
    tol = 100 * report.get("rss_tolerance", 0.05)
    axr.axhspan(-tol, tol, color="green", alpha=0.1)
    ax.set_ylabel("RSS (MB)")
    ax.set_yscale("log")
    axr.set_ylabel("RSS vs post-warm-up (%)")
    ax.legend(fontsize=7)
    ax.set_title(f"{report['requests']} requests, c={report['concurrency']}, {report['errors']} errors", fontsize=9)
    return fig


if __name__ == "__main__":
    sys.exit(main())
