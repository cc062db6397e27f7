"""`make serve` / `make stop`: the default service on this machine (local Ray, real model, HTTP).

start: checks ray_config.yaml with the app's own models first (cluster/config.py:check_serve_config:
a misspelled key is an answer in a second, before Ray starts), starts a local Ray head if none is
running (the repo on PYTHONPATH so Serve replicas can import it; dashboard on 127.0.0.1 only; the
engine first on the CPU, cluster/cpu_priority.py; Serve's background polling cut, cluster/serve_env.py),
deploys ray_config.yaml, waits until /health answers 200 (the first start converts the model
once), and prints the URL. An application that Serve reports DEPLOY_FAILED ends the wait at once,
with the failure's own message (not Serve's whole traceback).
check: only the first step.
stop: shuts the Serve app and the local Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from cluster import cpu_priority
from cluster.config import check_serve_config
from cluster.serve_env import with_serve_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GCS_PORT = 6379  # `ray start --head`'s default
# the dashboard `serve deploy` talks to: the one `ray start` below binds (Ray's default port), or the
# address in the variable the `serve` CLI reads too
DASHBOARD = os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265")


def _ray(*args: str, check: bool = True, engine_first: bool = False) -> subprocess.CompletedProcess:
    """``engine_first``: start Ray so that the engine's threads keep the cores (cluster/cpu_priority.py)."""
    env = with_serve_env({**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    return subprocess.run(
        [str(BIN / "ray"), *args],
        cwd=ROOT,
        check=check,
        text=True,
        capture_output=True,
        **cpu_priority.ray_start_kwargs(env, engine_first),
    )


def ray_running() -> bool:
    return _ray("status", check=False).returncode == 0


def load_checked(config: str) -> dict[str, Any]:
    """The Serve config at ``config``, or exit with what is wrong in it (nothing started yet)."""
    path = Path(ROOT, config)
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        sys.exit(f"[specserve] cannot read {config}: {e}")
    problems = check_serve_config(cfg)
    if not problems:
        problems = kv_budget_problems(cfg["applications"][0].get("args") or {})
    if problems:
        n = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        sys.exit(
            f"[specserve] {config}: {n} (checked by cluster/config.py); nothing was started:\n  "
            + "\n  ".join(problems)
        )
    return cfg


def _model_dims(model: str) -> dict[str, Any] | None:
    """A model's config.json as a dict, where it is on disk (the shipped model once converted, or a local
    Hugging Face directory); None before the first start has converted it."""
    from workers.model_loader import SMOLLM2, cache_dir, resolve_local_dir, smollm2_cache_subdir

    path = cache_dir() / smollm2_cache_subdir() if model == SMOLLM2 else resolve_local_dir(model)
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _kv_per_token(dims: dict[str, Any], layers: int, elt: int) -> int:
    """workers/kv_blocks.py:kv_bytes_per_token of a config.json read as a dict (the replicas read the same
    numbers from the loaded model's config)."""
    from workers.kv_blocks import kv_bytes_per_token

    head_dim = dims.get("head_dim") or dims["hidden_size"] // dims["num_attention_heads"]
    return kv_bytes_per_token(layers, dims["num_key_value_heads"], head_dim, elt)


def kv_budget_problems(args: dict[str, Any]) -> list[str]:
    """The KV budgets against the models' sizes, before anything starts: a budget too small for one
    request of max_model_len is named here in seconds, not by a replica that fails to start (which checks
    the same rule, workers/kv_blocks.py:pool_blocks). Models whose files are not on disk yet are skipped."""
    from cluster.config import AppConfig
    from workers.hardware import resolve_dtype
    from workers.kv_blocks import pool_blocks

    cfg = AppConfig.model_validate(args)
    e, d = cfg.engine, cfg.draft
    problems: list[str] = []
    dims = _model_dims(e.model)
    if dims is not None:
        import torch

        dtype = resolve_dtype(e.dtype, torch.device("cpu"), e.cpu_gemm) if e.kv_cache_dtype == "auto" else None
        elt = dtype.itemsize if dtype is not None else (4 if e.kv_cache_dtype == "float32" else 2)
        max_len = min(e.max_model_len, dims.get("max_position_embeddings") or e.max_model_len)
        per_token = _kv_per_token(dims, dims["num_hidden_layers"], elt)
        try:
            pool_blocks(
                e.kv_cache_memory_gb, per_token, e.block_size, max_len, e.max_num_seqs, "engine.kv_cache_memory_gb"
            )
        except ValueError as err:
            problems.append(str(err))
    draft_dims = dims if d.model == "target" else _model_dims(d.model)
    if d.enabled and draft_dims is not None:
        from workers.eagle_head import CONFIG_FILE

        elt = 4 if d.dtype == "float32" else 2
        per_token = _kv_per_token(draft_dims, draft_dims["num_hidden_layers"], elt)
        if d.eagle:
            from workers.model_loader import resolve_local_dir

            try:
                head = json.loads((resolve_local_dir(d.eagle) / CONFIG_FILE).read_text())
                per_token += _kv_per_token(head, 1, elt)
            except (OSError, ValueError):
                pass
        try:
            pool_blocks(
                d.kv_cache_memory_gb,
                per_token,
                e.block_size,
                e.max_model_len,
                d.max_num_seqs,
                "draft.kv_cache_memory_gb",
            )
        except ValueError as err:
            problems.append(str(err))
    return problems


def app_status(name: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """Serve's view of application ``name`` (status, message, last_deployed_time_s), from the dashboard's
    REST API (what `serve status` prints); None when it does not answer or knows no such app."""
    try:
        with urllib.request.urlopen(f"{DASHBOARD}/api/serve/applications/", timeout=timeout_s) as r:
            return json.loads(r.read()).get("applications", {}).get(name)
    except (OSError, ValueError):
        return None


# the line that starts a traceback's exception: `ValueError: ...`, `ray.exceptions.RayTaskError(RuntimeError): ...`
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?:\([\w.]*\))?: ")
_PYDANTIC = re.compile(r"\d+ validation errors? for \w+$")


def failure_summary(message: str) -> str:
    """The part of a DEPLOY_FAILED message that says what went wrong: the innermost (last) exception of the
    tracebacks Serve nests, without the frames. A pydantic error comes out one ``where: what`` line each."""
    lines = message.rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
    if not starts:
        return "\n".join(lines[-20:])
    head, *rest = lines[starts[-1] :]
    if not _PYDANTIC.search(head):
        return "\n".join([head, *rest])
    out, loc = [head.split(": ", 1)[1]], None
    for ln in rest:
        if ln.strip().startswith("For further information visit"):
            continue
        if not ln.startswith(" "):
            loc = ln.strip()
        else:
            msg = re.sub(r" \[type=.*\]$", "", ln.strip())
            out.append(f"  {loc}: {msg}" if loc else f"  {msg}")
            loc = None
    return "\n".join(out)


def deploy_failure(name: str, deployed_after: float) -> str | None:
    """What went wrong, if Serve reports application ``name``, deployed at ``deployed_after`` or later,
    DEPLOY_FAILED; None otherwise (still deploying, running, or the dashboard not answering)."""
    app = app_status(name)
    if not app or app.get("status") != "DEPLOY_FAILED":
        return None
    if app.get("last_deployed_time_s", deployed_after) < deployed_after - 1:
        return None  # an earlier deploy's failure: ours has not been applied yet
    return failure_summary(app.get("message", ""))


def start(config: str, timeout_s: float) -> None:
    cfg = load_checked(config)
    http = cfg.get("http_options", {})
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
    engine_first = cpu_priority.enabled(cfg["applications"][0].get("args") or {})
    started = not ray_running()
    if started:
        print("[specserve] starting a local Ray head ...", flush=True)
        _ray(
            "start",
            "--head",
            f"--port={GCS_PORT}",
            "--num-cpus=4",
            "--dashboard-host=127.0.0.1",
            "--disable-usage-stats",
            engine_first=engine_first,
        )
    print(f"[specserve] deploying {config} ...", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    app_name = cfg["applications"][0].get("name", "default")
    deployed_at = time.time()
    subprocess.run([str(BIN / "serve"), "deploy", config], cwd=ROOT, env=env, check=True)
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        failure = deploy_failure(app_name, deployed_at)
        if failure is not None:
            sys.exit(
                f"\n[specserve] {app_name}: DEPLOY_FAILED after {time.time() - t0:.0f}s:\n{failure}\n"
                f"(the whole report: {BIN / 'serve'} status; `make stop` shuts the local Ray down)"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    if started and engine_first:
                        cpu_priority.demote_background(cpu_priority.session_processes(GCS_PORT))
                    print(
                        f"[specserve] ready in {time.time() - t0:.0f}s: {url}/v1 (OpenAI API), model "
                        f"{cfg['applications'][0]['args']['engine'].get('served_model_name')}",
                        flush=True,
                    )
                    return
        except Exception:
            pass
        print(f"\r[specserve] waiting for /health ... {time.time() - t0:.0f}s", end="", flush=True)
        time.sleep(2)
    status = subprocess.run([str(BIN / "serve"), "status"], cwd=ROOT, text=True, capture_output=True).stdout
    sys.exit(f"\n[specserve] not healthy after {timeout_s:.0f}s:\n{status}")


def stop() -> None:
    subprocess.run([str(BIN / "serve"), "shutdown", "-y"], cwd=ROOT, check=False)
    _ray("stop", "--force", check=False)
    print("[specserve] stopped")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["start", "check", "stop"])
    ap.add_argument("--config", default="ray_config.yaml")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    if a.action == "start":
        start(a.config, a.timeout)
    elif a.action == "check":
        load_checked(a.config)
        print(f"[specserve] {a.config}: ok")
    else:
        stop()


if __name__ == "__main__":
    main()
