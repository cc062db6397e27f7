"""Serving under load: guidellm (an outside load generator) over HTTP vs the same workload in process.

    python -m benchmarks.serving.guidellm_load [--streams 1,4,16,32] [--seconds 40] [--prompt-tokens 128]
                                       [--output-tokens 64] [--guidellm-workers 10,1] [--no-bounds]
                                       [--skip-http] [--skip-engine]

One run, one machine, four passes over the same stream counts (the CPU is named in the JSON):

1. **Engine alone**: the closed loop on the engine in this process (the shipped EngineConfig with
   the proposers the target replica runs itself, the goodput policy on the engine's own cost
   model, prompts made as guidellm makes its synthetic ones: Faker text cut to ``--prompt-tokens``
   of the served tokenizer, so n-gram speculation finds what it finds over HTTP; exactly
   ``--output-tokens`` each, sampled as guidellm's requests are: they name no temperature, so the
   API's default 1.0 applies): time to first token and time per output token from each request's
   step times. Requests sent in the first ``--warmup`` share of a level are left out (guidellm
   leaves out those that *complete* in its warm-up window, which keeps a closed loop's first wave:
   the HTTP pass reports guidellm's figures and, as ``steady_*``, the same rule as here).
2. **Over HTTP**: the default service (ray_config.yaml as shipped, on one local Ray node as
   ``make serve`` runs it; ``--nodes 2``: the end-to-end tests' two nodes) driven by ``guidellm run``:
   closed loop (``concurrent`` profile) for ``--seconds`` per level, synthetic prompts made with the
   served model's own tokenizer (saved to a temp dir: no hub access), ``ignore_eos``,
   ``/v1/completions``. ``--guidellm-workers`` lists guidellm's worker-process counts to run at every
   level, in alternating order (guidellm's default is 10 Python processes, each polling, on the
   service's cores; one process drives 32 streams with asyncio); the first count is the headline,
   every count gets its own goals. The CPU every process used per level is read too (the target
   replica, the proxy, the ingress, the Router, the draft worker, Ray's daemons, and guidellm), in
   cores, every 0.25 s over the window its measured requests ran in (guidellm's start-up, a few
   seconds of tokenizer load and data synthesis at up to two cores, serves nothing; its own
   whole-run CPU is reported apart).
3. **Beside the idle service** (unless ``--no-bounds``): pass 1 again with the service still up and
   idle: Ray's daemons, the Serve controller, the proxy, the ingress, the Router and the idle
   replicas wake up around the engine as they do while it serves. Paired with the same pass while
   every process of the service is stopped (SIGSTOP: memory held, no CPU, no wake-ups), back to back
   in alternating order, so the idle service's cost is read within minutes, not across the run.
4. **Beside the idle service and the client's CPU**: pass 3 plus processes burning as many cores as
   guidellm itself used while its requests ran at that level (10 ms duty cycles, normal priority).
   That is what a serving path costing nothing could read on these cores: where a goal fails here
   too, what runs beside the engine on a 2-core machine is enough to miss it, whatever the serving
   path does.

Each engine step runs one OpenMP thread per core, and every parallel op waits for its slowest
thread, so on 2 cores any other runnable process stalls the step, not just a core's share of it.

Prints TTFT p50/p99, ITL p50/p99 (guidellm's: (latency - TTFT) / (tokens - 1) per request),
output tok/s and the HTTP / in-process ratio per level, and checks the serving goals against each
pass; writes benchmarks/results/guidellm_load.{json,png}. Every level also records the engine's
steps (benchmarks/serving/step_profile.py: the target replica's over HTTP, the engine's own in process):
seconds per step, decode rows and prompt tokens per step, and the median decode-only step, which
tell a served level that runs smaller batches from one that runs the same batches slower.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil

from benchmarks.common import (
    RESULTS_DIR,
    env_info,
    figure,
    line_panel,
    percentile,
    progress,
    run_closed_loop,
    save_result,
    set_threads,
)
from benchmarks.serving.guidellm_report import parse_guidellm, steady_view
from benchmarks.serving.guidellm_workload import guidellm_prompts, guidellm_sampling, local_proposers, service_config
from benchmarks.serving.serving_profile import cpu_by_role
from benchmarks.serving.step_profile import StepRecorder, compare, from_trace, since, summarize
from cluster.config import AppConfig
from cluster.local_cluster import LocalCluster, Probe
from policies import make_policy
from workers.engine import LLMEngine
from workers.model_loader import load_model

BIN = Path(sys.executable).parent


def run_guidellm(
    url: str,
    model: str,
    tokenizer_dir: str,
    streams: int,
    seconds: float,
    prompt_tokens: int,
    output_tokens: int,
    out: Path,
    warmup: float,
    workers: int | None = None,
    service: list[psutil.Process] | None = None,
) -> dict[str, Any]:
    """One guidellm closed-loop run at ``streams`` concurrent streams; returns its metrics, and the CPU
    guidellm itself used (it runs on the same cores as the service) and, given the ``service``'s
    processes, theirs by role, both in cores over the window its measured requests ran in."""
    cmd = [
        str(BIN / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
        "--profile",
        f"kind=concurrent,streams={streams},warmup={warmup}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer_dir}",
        "--constraint",
        f"kind=max_duration,seconds={seconds}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(os.environ)
    if workers:  # guidellm's worker processes (default 10): each a Python process on the service's cores
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(workers)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    samples: list[tuple[float, float]] = []  # (wall clock s, CPU s of guidellm's processes so far)
    by_role: list[tuple[float, dict[str, float]]] = []  # (wall clock s, CPU s of each service role so far)
    sampler = threading.Thread(target=_sample_cpu, args=(proc, samples, service or [], by_role), daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=seconds * 3 + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    report = json.loads(out.read_text())
    [bench] = report["benchmarks"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    window = bench["start_time"], bench["end_time"]
    roles = sorted({r for _, d in by_role for r in d})
    return {
        **parse_guidellm(report),
        # while its measured requests ran: what it takes from the engine's cores
        "client_cpu_cores": window_rate(samples, *window),
        "client_cpu_cores_whole_run": cpu / wall,  # start-up included
        # the same window: over guidellm's whole run its start-up, when nothing is served, dilutes them
        "service_cpu_cores": {r: window_rate([(t, d.get(r, 0.0)) for t, d in by_role], *window) for r in roles},
    }


def _sample_cpu(
    proc: subprocess.Popen,
    samples: list[tuple[float, float]],
    service: list[psutil.Process],
    by_role: list[tuple[float, dict[str, float]]],
    every_s: float = 0.25,
) -> None:
    """Append (time, CPU seconds of ``proc`` and its children) to ``samples``, and (time, CPU seconds of
    the ``service``'s processes by role) to ``by_role``, until ``proc`` exits."""
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        return
    seen: dict[int, psutil.Process] = {}
    while proc.poll() is None:
        try:
            for p in [root, *root.children(recursive=True)]:
                seen.setdefault(p.pid, p)
        except psutil.Error:
            pass
        total = 0.0
        for p in seen.values():
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.Error:  # gone: its last reading is lost, so a window over its exit reads low
                pass
        now = time.time()
        samples.append((now, total))
        if service:
            by_role.append((now, cpu_by_role(service)))
        time.sleep(every_s)


def window_rate(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """The rate of a cumulative counter sampled as (time, value) over [start, end], reading it at both
    ends by linear interpolation between the nearest samples (clamped to the first and last)."""
    if len(samples) < 2 or end <= start:
        return 0.0

    def at(t: float) -> float:
        if t <= samples[0][0]:
            return samples[0][1]
        for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
            if t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
        return samples[-1][1]

    return (at(end) - at(start)) / (end - start)


def run_engine(
    engine: LLMEngine, streams: int, seconds: float, prompt_tokens: int, output_tokens: int, seed: int, warmup: float
) -> dict[str, Any]:
    """The same closed loop on the engine in process: enough requests for about ``seconds``; requests
    sent in the first ``warmup`` share of the run are left out of the latencies
    (see benchmarks/serving/guidellm_report.py:steady_state)."""
    rate_guess = max(engine.num_output_tokens / max(engine.num_steps, 1), 1.0)  # tokens per step so far
    step_s = engine.step_time_ema.value or 0.05
    n = max(2 * streams, int(seconds / step_s * min(rate_guess, streams) / output_tokens))
    params = guidellm_sampling(output_tokens)
    work = [(p, dict(params)) for p in guidellm_prompts(engine.tokenizer, n, prompt_tokens, seed)]
    recorder, hook = StepRecorder(engine), engine.on_step
    engine.on_step = recorder
    try:
        res = run_closed_loop(
            engine, work, streams, speculation="auto", name=f"engine c={streams}", show_progress=False
        )
    finally:
        engine.on_step = hook
    kept = [r for r in res.records if r.submit_s >= warmup * res.wall_s] or res.records
    ttfts = [r.ttft for r in kept]
    tpots = [r.tpot for r in kept]
    return {
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * percentile(tpots, 50),
        "itl_p99_ms": 1e3 * percentile(tpots, 99),
        # at the concurrency (all streams in flight), as guidellm's rate over its active phase
        "tok_s": res.steady_tok_s or res.tok_s,
        "num_requests": len(kept),
        "num_errors": 0,
        "steps": summarize(recorder.steps),
    }


def replica_step_count(cluster: LocalCluster) -> int:
    """The target replica's step count now. A short-lived probe: a driver left idle beside the service
    would wake up on its cores during the level."""
    with Probe(cluster) as probe:
        return probe.call("TargetWorker", "load")["num_steps"]


def replica_steps_since(cluster: LocalCluster, steps_before: int) -> dict[str, Any]:
    """The target replica's steps since it had taken ``steps_before``, summarized
    (benchmarks/serving/step_profile.py), with ``trace_truncated`` set when its bounded trace dropped some."""
    with Probe(cluster) as probe:
        count = probe.call("TargetWorker", "load")["num_steps"]
        entries, truncated = since(probe.call("TargetWorker", "policy_trace")["steps"], steps_before, count)
    return {**summarize(from_trace(entries)), "trace_truncated": truncated}


_BURN = """import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * duty:
        pass
    time.sleep(0.01 * (1 - duty))
"""


@contextlib.contextmanager
def stopped(procs: list[psutil.Process]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) inside the block and continued after it: they hold their memory
    and state but take no CPU and wake no one."""
    held = []
    try:
        for p in procs:
            try:
                p.suspend()
                held.append(p)
            except psutil.Error:  # gone or not ours: nothing to stop
                pass
        # SIGSTOP lands asynchronously: on a loaded machine a process can run on for a moment after it
        deadline = time.monotonic() + 5
        for p in held:
            while time.monotonic() < deadline:
                try:
                    if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                        break
                except psutil.Error:
                    break
                time.sleep(0.01)
        yield
    finally:
        for p in held:
            try:
                p.resume()
            except psutil.Error:
                pass


def burn_cores(cores: float) -> list[subprocess.Popen]:
    """Processes that keep ``cores`` CPUs busy between them (one per whole core), as a client would."""
    procs = []
    while cores > 0.01:
        duty = min(cores, 1.0)
        cores -= duty
        procs.append(subprocess.Popen([sys.executable, "-c", _BURN, str(duty)]))
    return procs


def in_process_engine(cfg: AppConfig, loaded: Any, prompt_tokens: int) -> LLMEngine:
    """The shipped engine in this process, as the target replica runs it (its own proposers, the goodput
    policy on the engine's cost model), warmed up with one short request."""
    set_threads(cfg.engine.num_threads or 2)
    eng = LLMEngine(
        cfg.engine, loaded, proposers=local_proposers(cfg), decide=(policy := make_policy({"name": "goodput"}))
    )
    policy.use_cost_model(eng.cost_model)
    run_closed_loop(eng, [(list(range(10, 10 + prompt_tokens)), {"max_tokens": 8})], 1, show_progress=False)
    return eng


def served(workdir: Path, cfg: AppConfig, nodes: int) -> LocalCluster:
    """The shipped config as is on a local cluster (only its ports differ; LocalCluster's test sizes undone)."""
    return LocalCluster(
        workdir,
        nodes=nodes,
        args_patch={
            "engine": {
                "num_threads": cfg.engine.num_threads,
                "max_num_seqs": cfg.engine.max_num_seqs,
                "max_model_len": cfg.engine.max_model_len,
            },
            "target": {"num_cpus": cfg.target.num_cpus},
        },
    )


def warm_up_service(cluster: LocalCluster, cfg: AppConfig, prompt_tokens: int) -> None:
    """Three short requests: the first ones after a start are slower (allocations, first kernels)."""
    warm = {"model": cfg.engine.served_model_name, "prompt": "Hello " * prompt_tokens, "max_tokens": 8}
    for _ in range(3):
        httpx.post(f"{cluster.base_url}/v1/completions", json=warm, timeout=120).raise_for_status()


def goals(http: dict[int, dict[str, Any]], engine: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The serving goals at 16 streams, each with its measured value and whether it holds."""
    out: dict[str, Any] = {}
    if 16 in http:
        out["ttft_p99_16_s<=1.5"] = http[16]["ttft_p99_ms"] / 1e3
        if 1 in http:
            out["itl_p50_16/itl_p50_1<=2.5"] = http[16]["itl_p50_ms"] / http[1]["itl_p50_ms"]
            out["tok_s_16/tok_s_1>=4.5"] = http[16]["tok_s"] / http[1]["tok_s"]
        if 16 in engine:
            out["tok_s_16_http/engine>=0.8"] = http[16]["tok_s"] / engine[16]["tok_s"]
    if 1 in http and 1 in engine:
        out["tpot_1_http/engine<=1.1"] = http[1]["itl_p50_ms"] / engine[1]["itl_p50_ms"]
    limits = {
        "ttft_p99_16_s<=1.5": (1.5, "<="),
        "itl_p50_16/itl_p50_1<=2.5": (2.5, "<="),
        "tok_s_16/tok_s_1>=4.5": (4.5, ">="),
        "tok_s_16_http/engine>=0.8": (0.8, ">="),
        "tpot_1_http/engine<=1.1": (1.1, "<="),
    }
    return {
        k: {"value": round(v, 3), "met": v <= limits[k][0] if limits[k][1] == "<=" else v >= limits[k][0]}
        for k, v in out.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="share of each level's duration guidellm leaves out of its statistics (the first "
        "wave of simultaneous arrivals); the in-process run leaves out its first wave too",
    )
    ap.add_argument(
        "--guidellm-workers",
        default="10",
        help="comma-separated guidellm worker-process counts, each run at every level (10 is guidellm's default)",
    )
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument(
        "--no-bounds",
        action="store_true",
        help="skip the in-process runs beside the idle service and guidellm's measured CPU",
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="1: one Ray node, as `make serve` runs it; 2: the test clusters' two nodes",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "guidellm_load"))
    args = ap.parse_args(argv)
    levels = [int(s) for s in args.streams.split(",")]
    worker_counts = [int(w) for w in args.guidellm_workers.split(",")]
    cfg = service_config()
    loaded = load_model(cfg.engine.model)
    http_by_workers: dict[int, dict[int, dict[str, Any]]] = {w: {} for w in worker_counts}
    http = http_by_workers[worker_counts[0]]  # the headline client setting
    engine_res: dict[int, dict[str, Any]] = {}  # in process, alone on the machine
    # in process with the service up and idle beside it, and also with guidellm's measured CPU burnt beside it
    beside_service: dict[int, dict[str, Any]] = {}
    beside: dict[int, dict[str, Any]] = {}
    beside_frozen: dict[int, dict[str, Any]] = {}  # paired with beside_service: the service's processes stopped
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        loaded.tokenizer.save_pretrained(tok_dir)
        eng = None

        def engine_level(c: int) -> dict[str, Any]:  # one level of the closed loop on the in-process engine
            return run_engine(eng, c, args.seconds, args.prompt_tokens, args.output_tokens, seed=c, warmup=args.warmup)

        if not args.skip_engine:
            eng = in_process_engine(cfg, loaded, args.prompt_tokens)
            for c in progress(levels, desc="engine in process, alone", unit="level"):
                engine_res[c] = engine_level(c)
                print(f"  engine c={c}: {engine_res[c]}", flush=True)
        if not args.skip_http:
            cluster = served(Path(tmp), cfg, args.nodes)
            try:
                print("starting the service ...", flush=True)
                cluster.start()
                warm_up_service(cluster, cfg, args.prompt_tokens)
                procs = cluster.processes()
                for i, c in enumerate(progress(levels, desc="guidellm over HTTP", unit="level")):
                    for w in worker_counts if i % 2 == 0 else worker_counts[::-1]:
                        steps_before = replica_step_count(cluster)
                        res = run_guidellm(
                            cluster.base_url,
                            cfg.engine.served_model_name,
                            str(tok_dir),
                            c,
                            args.seconds,
                            args.prompt_tokens,
                            args.output_tokens,
                            Path(tmp) / f"guidellm_{c}_{w}.json",
                            args.warmup,
                            workers=w,
                            service=procs,
                        )
                        res["steps"] = replica_steps_since(cluster, steps_before)
                        http_by_workers[w][c] = res
                        print(f"  HTTP c={c}, {w} guidellm workers: {res}", flush=True)
                if eng is not None and not args.no_bounds:
                    # What a serving path costing nothing could read: the engine in process with everything
                    # that still runs around it, the service's idle processes (Ray's daemons, the Serve
                    # controller, the proxy, ingress, Router, the idle replicas), and the client's CPU.
                    # The idle service's own cost, paired: the same pass with its processes stopped and
                    # running, back to back in alternating order (the machine drifts between minutes).
                    for i, c in enumerate(
                        progress(levels, desc="engine beside the idle service (+ client CPU)", unit="level")
                    ):
                        for frozen in (True, False) if i % 2 == 0 else (False, True):
                            if frozen:
                                with stopped(procs):
                                    beside_frozen[c] = engine_level(c)
                            else:
                                beside_service[c] = engine_level(c)
                        print(
                            f"  engine beside the idle service, c={c}: {beside_service[c]}; with its processes "
                            f"stopped: {beside_frozen[c]}",
                            flush=True,
                        )
                        burners = burn_cores(http[c]["client_cpu_cores"])
                        try:
                            beside[c] = engine_level(c)
                        finally:
                            for b in burners:
                                b.kill()
                                b.wait()
                        beside[c]["client_cpu_cores"] = http[c]["client_cpu_cores"]
                        print(
                            f"  engine beside the idle service and {http[c]['client_cpu_cores']:.2f} client cores, "
                            f"c={c}: {beside[c]}",
                            flush=True,
                        )
            finally:
                cluster.stop()

    rows = []
    for c in levels:
        h, e = http.get(c), engine_res.get(c)
        rows.append(
            {"streams": c, "http": h, "engine": e, "tok_s_http/engine": h["tok_s"] / e["tok_s"] if h and e else None}
        )
    result = {
        "env": env_info(),
        "args": vars(args),
        "service": cfg.model_dump(mode="json"),
        "rows": rows,
        "goals": goals(http, engine_res),
        "goals_steady_state": goals(steady_view(http), engine_res),
        "engine_beside_idle_service": beside_service,
        "engine_beside_idle_service_and_client": beside,
        "engine_beside_stopped_service": beside_frozen,
        # what the idle service costs the engine, paired in time: tok/s running / tok/s stopped
        "idle_service_tok_s_ratio": {c: beside_service[c]["tok_s"] / beside_frozen[c]["tok_s"] for c in beside_frozen},
        "http_by_guidellm_workers": http_by_workers,
        "goals_by_guidellm_workers": {w: goals(h, engine_res) for w, h in http_by_workers.items()},
        # the goals for a serving path that costs nothing: the idle service (and guidellm's CPU) beside it
        "goals_beside_idle_service": goals(beside_service, engine_res) if beside_service else {},
        "goals_costless_server": goals(beside, engine_res) if beside else {},
    }
    print(
        f"\n{'streams':>7} | {'TTFT p50/p99 ms (HTTP)':>24} | {'ITL p50/p99 ms (HTTP)':>22} | {'tok/s HTTP':>10} | "
        f"{'TTFT p50/p99 (eng)':>19} | {'ITL p50/p99 (eng)':>18} | {'tok/s eng':>9} | HTTP/eng"
    )
    for r in rows:
        h, e = r["http"] or {}, r["engine"] or {}

        def f(d: dict, k: str) -> str:
            return f"{d[k]:.0f}" if k in d else "-"

        print(
            f"{r['streams']:>7} | {f(h, 'ttft_p50_ms') + ' / ' + f(h, 'ttft_p99_ms'):>24} | "
            f"{f(h, 'itl_p50_ms') + ' / ' + f(h, 'itl_p99_ms'):>22} | {h.get('tok_s', float('nan')):>10.1f} | "
            f"{f(e, 'ttft_p50_ms') + ' / ' + f(e, 'ttft_p99_ms'):>19} | "
            f"{f(e, 'itl_p50_ms') + ' / ' + f(e, 'itl_p99_ms'):>18} | {e.get('tok_s', float('nan')):>9.1f} | "
            f"{r['tok_s_http/engine'] or float('nan'):.2f}"
        )
    for w, hw in http_by_workers.items():
        for c in levels:
            if c in hw:
                cpu = hw[c]["service_cpu_cores"]
                print(
                    f"c={c}, {w} guidellm workers: {hw[c]['tok_s']:.1f} tok/s, TTFT p99 {hw[c]['ttft_p99_ms']:.0f} ms, "
                    f"ITL p50 {hw[c]['itl_p50_ms']:.1f} ms; the target replica used "
                    f"{cpu.get('target replica', 0.0):.2f} cores, the rest of the service "
                    f"{sum(v for k, v in cpu.items() if k != 'target replica'):.2f}, guidellm itself "
                    f"{hw[c]['client_cpu_cores']:.2f}"
                )
    for c in levels:
        if c in http and c in engine_res:
            print(f"c={c}: {compare(http[c].get('steps', {}), engine_res[c].get('steps', {}))}")
            if c in beside_service:
                print(
                    f"c={c}, against the engine beside the idle service: "
                    f"{compare(http[c].get('steps', {}), beside_service[c].get('steps', {}))}"
                )
    for c, b in beside_service.items():
        print(
            f"c={c} in process beside the idle service: TTFT p99 {b['ttft_p99_ms']:.0f} ms, ITL p50 "
            f"{b['itl_p50_ms']:.1f} ms, {b['tok_s']:.1f} tok/s"
        )
    for c, r in result["idle_service_tok_s_ratio"].items():
        print(
            f"c={c} in process: the idle service running / its processes stopped (paired) {r:.3f} tok/s "
            f"({beside_service[c]['tok_s']:.1f} / {beside_frozen[c]['tok_s']:.1f})"
        )
    for c, b in beside.items():
        print(
            f"c={c} in process beside the idle service and {b['client_cpu_cores']:.2f} burnt client cores: TTFT p99 "
            f"{b['ttft_p99_ms']:.0f} ms, ITL p50 {b['itl_p50_ms']:.1f} ms, {b['tok_s']:.1f} tok/s"
        )

    def verdict(g: dict[str, Any]) -> str:
        return f"{g['value']} {'met' if g['met'] else 'NOT met'}"

    for w, gw in list(result["goals_by_guidellm_workers"].items())[1:]:
        print(f"goals with {w} guidellm workers: " + ", ".join(f"{k} {verdict(g)}" for k, g in gw.items()))
    for c in levels:
        h = http.get(c) or {}
        if h.get("steady_num_requests"):
            print(
                f"c={c} over HTTP, the requests sent after guidellm's warm-up window ({h['steady_num_requests']} of "
                f"{h['num_requests']}): TTFT p50/p99 {h['steady_ttft_p50_ms']:.0f} / {h['steady_ttft_p99_ms']:.0f} ms "
                f"(guidellm's {h['ttft_p50_ms']:.0f} / {h['ttft_p99_ms']:.0f}), ITL p50 {h['steady_itl_p50_ms']:.1f} ms"
            )
    print(
        "goals on the steady state (HTTP requests sent after the warm-up window): "
        + ", ".join(f"{k} {verdict(g)}" for k, g in result["goals_steady_state"].items())
    )
    print(f"goals with {worker_counts[0]} guidellm workers (headline):")
    for k, g in result["goals"].items():
        idle, bound = result["goals_beside_idle_service"].get(k), result["goals_costless_server"].get(k)
        print(
            f"goal {k}: {verdict(g)}"
            + (f"  (beside the idle service: {verdict(idle)})" if idle else "")
            + (
                f"  (a serving path costing nothing, beside the idle service and the client's CPU: {verdict(bound)})"
                if bound
                else ""
            )
        )
    fig, axes = figure(ncols=3, width=5.5)
    for ax, key, label in zip(
        axes, ["ttft_p99_ms", "itl_p50_ms", "tok_s"], ["TTFT p99 (ms)", "ITL p50 (ms)", "output tok/s"]
    ):
        series = {
            name: [(d.get(c) or {}).get(key) for c in levels]
            for name, d in [
                *((f"HTTP (guidellm, {w} workers)", h) for w, h in http_by_workers.items()),
                ("engine in process", engine_res),
                ("in process beside the idle service", beside_service),
                ("... and the client's CPU", beside),
            ]
            if d
        }
        line_panel(ax, levels, series, title=label, xlabel="concurrent streams", ylabel=label)
    title = f"guidellm {args.prompt_tokens} in / {args.output_tokens} out"
    save_result(Path(args.out), result, fig, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
