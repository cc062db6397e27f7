"""`make serve` / `make stop`: the default service on this machine (local Ray, real model, HTTP).

start: starts a local Ray head if none is running (the repo on PYTHONPATH so Serve replicas
can import it; dashboard on 127.0.0.1 only; the engine first on the CPU, cluster/cpu_priority.py; Serve's
background polling cut, cluster/serve_env.py),
deploys ray_config.yaml, waits until /health answers 200 (the first start converts the model
once), and prints the URL.
stop: shuts the Serve app and the local Ray down.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from cluster import cpu_priority
from cluster.serve_env import with_serve_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GCS_PORT = 6379  # `ray start --head`'s default


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


def start(config: str, timeout_s: float) -> None:
    cfg = yaml.safe_load(Path(ROOT, config).read_text())
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
    subprocess.run([str(BIN / "serve"), "deploy", config], cwd=ROOT, env=env, check=True)
    t0 = time.time()
    while time.time() - t0 < timeout_s:
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
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--config", default="ray_config.yaml")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    start(a.config, a.timeout) if a.action == "start" else stop()


if __name__ == "__main__":
    main()
