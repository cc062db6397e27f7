"""A real two-node Ray cluster on this machine, with the app deployed by `serve deploy`.

The head node carries the custom resource ``target_node`` and a second Ray node carries
``draft_node``, so the target and the draft workers land on different nodes exactly as
they would on a `ray up` cluster. The app is deployed from a YAML derived from the
repo's ray_config.yaml (smaller context, free ports), through the same CLI users run.
The end-to-end tests and the HTTP benchmarks (http_sweep, telemetry_overhead, soak --local) use it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml

from cluster import cpu_priority
from cluster.serve_env import DRIVER_ENV, with_serve_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def shipped_config() -> dict[str, Any]:
    """ray_config.yaml as shipped, a fresh copy each call (callers patch it)."""
    return yaml.safe_load((ROOT / "ray_config.yaml").read_text())


def shipped_app_args() -> dict[str, Any]:
    """The ``args`` of the shipped app: what build_app gets, what AppConfig validates."""
    return shipped_config()["applications"][0]["args"]


# Ports a cluster's listeners are picked from: above Ray's worker ports (10002-19999 by default) and below
# the kernel's ephemeral range, which is what every bind to port 0 (a gRPC server, an outgoing connection)
# draws from. A number picked from the ephemeral range can be taken by such a bind before our process binds
# it (seen: the HTTP proxy failing to bind its port).
PORT_RANGE = range(20000, 32768)


def ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0 (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that nothing listens on now, from :data:`PORT_RANGE` below the
    ephemeral range (the kernel's own pick for port 0 where that leaves too little room)."""
    rng = rng or random.Random()
    hi = min(PORT_RANGE.stop, ephemeral_low())
    out: list[int] = []
    for _ in range(100 * n):
        if len(out) == n or hi - PORT_RANGE.start < 100 * n:
            break
        port = rng.randrange(PORT_RANGE.start, hi)
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    while len(out) < n:  # no room below the ephemeral range: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in out:
                out.append(port)
    return out


class LocalCluster:
    def __init__(
        self, workdir: Path, policy: dict[str, Any] | None = None, args_patch: dict | None = None, nodes: int = 2
    ) -> None:
        """``nodes``: 2 (the target on the head, the draft worker on a second node: placement by node
        resource, as on a real cluster) or 1 (one node with both resources, as ``make serve`` runs: one
        raylet and one set of node agents less, each waking up beside the engine)."""
        if nodes not in (1, 2):
            raise ValueError(f"nodes must be 1 or 2, got {nodes}")
        self.nodes = nodes
        self.workdir = workdir
        self.gcs_port, self.dash_port, self.http_port, self.client_port = free_ports(4)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.env = with_serve_env({**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"})
        self.env.pop("RAY_ADDRESS", None)
        self.driver_env = {**self.env, **DRIVER_ENV}  # for processes that call handles (call, Probe)
        self.policy = policy or {"name": "goodput"}
        self.args_patch = args_patch or {}

    # ------------------------------------------------------------------ lifecycle

    def _run(self, *cmd: str, check: bool = True, ray_start: bool = False) -> subprocess.CompletedProcess:
        """``ray_start``: engine first, as the app config asks (cluster/cpu_priority.py)."""
        return subprocess.run(
            cmd,
            cwd=ROOT,
            check=check,
            text=True,
            capture_output=True,
            **cpu_priority.ray_start_kwargs(self.env, ray_start and self.engine_first),
        )

    @property
    def engine_first(self) -> bool:
        return cpu_priority.enabled(self.config(self.policy)["applications"][0]["args"])

    def start(self) -> LocalCluster:
        one_node = self.nodes == 1  # the head then carries the draft node's resource and its 2 CPUs too
        head_resources = {"target_node": 1, "draft_node": 1} if one_node else {"target_node": 1}
        self._run(
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={self.gcs_port}",
            f"--num-cpus={4 if one_node else 2}",
            f"--dashboard-port={self.dash_port}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={self.client_port}",
            "--resources",
            json.dumps(head_resources),
            ray_start=True,
        )
        if one_node:
            self.deploy(self.policy)
        else:
            # The second node joins while the app deploys: Serve places the draft worker once its node's
            # resource appears, and the two starts no longer add up.
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(
                    self._run,
                    str(BIN / "ray"),
                    "start",
                    f"--address=127.0.0.1:{self.gcs_port}",
                    "--num-cpus=2",
                    "--resources",
                    json.dumps({"draft_node": 1}),
                    ray_start=True,
                )
                self.deploy(self.policy)
                joined.result()
        self.wait_healthy()
        if self.engine_first:
            cpu_priority.demote_background(self.processes())
        return self

    def stop(self) -> None:
        """Kill this cluster's processes only (``ray stop`` would kill every Ray on the machine)."""
        for proc in self.processes():
            try:
                proc.kill()
            except psutil.Error:
                pass

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster (cluster/cpu_priority.py:session_processes)."""
        return cpu_priority.session_processes(self.gcs_port)

    def config(self, policy: dict[str, Any]) -> dict[str, Any]:
        cfg = shipped_config()
        cfg["http_options"]["port"] = self.http_port
        app = cfg["applications"][0]
        args = app["args"]
        args["engine"].update({"max_model_len": 512, "max_num_seqs": 8, "num_threads": 1})
        args["target"].update({"num_cpus": 0.5, "resources": {"target_node": 0.01}})
        args["draft"].update(
            {"num_threads": 1, "max_num_seqs": 16, "resources": {"num_cpus": 0.5, "resources": {"draft_node": 0.01}}}
        )
        for key, val in self.args_patch.items():
            args.setdefault(key, {}).update(copy.deepcopy(val))
        app["deployments"] = [{"name": "Router", "user_config": {"policy": policy}}]
        return cfg

    def deploy(self, policy: dict[str, Any], timeout_s: float = 60) -> None:
        """``serve deploy`` through the dashboard, retried while it refuses: ``ray start`` returns before
        the dashboard listens, and on a loaded machine it can take seconds more."""
        path = self.workdir / f"serve_{int(time.time() * 1000)}.yaml"
        path.write_text(yaml.safe_dump(self.config(policy)))
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._run(
                str(BIN / "serve"), "deploy", "-a", f"http://127.0.0.1:{self.dash_port}", str(path), check=False
            )
            if out.returncode == 0:
                return
            if "Connection refused" not in out.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"serve deploy failed ({out.returncode}):\n{out.stderr[-3000:]}")
            time.sleep(1)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(1)
        status = self._run(str(BIN / "serve"), "status", "-a", f"http://127.0.0.1:{self.dash_port}", check=False)
        raise TimeoutError(f"app not healthy after {timeout_s}s:\n{status.stdout}\n{status.stderr}")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.base_url}/v1/speculation/stats", timeout=10) as r:
            return json.loads(r.read())

    def call(self, deployment: str, method: str, *args: Any) -> Any:
        """Call a deployment method through a Serve handle from a short-lived driver process."""
        code = (
            "import json, sys, ray\nfrom ray import serve\n"
            f"ray.init(address='127.0.0.1:{self.gcs_port}', logging_level='ERROR')\n"
            f"h = serve.get_deployment_handle({deployment!r}, app_name='specserve')\n"
            f"print(json.dumps(getattr(h, {method!r}).remote(*{list(args)!r}).result()))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=self.driver_env, text=True, capture_output=True, timeout=120
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


class Probe:
    """A long-lived driver process that calls deployment methods through Serve handles.

    ``LocalCluster.call`` starts a fresh driver per call (~3 s); tests that poll a replica's
    state many times (KV in use, draft state) use one of these instead (~10 ms per call).
    """

    _CODE = (
        "import json, sys, ray\nfrom ray import serve\n"
        "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
        "handles = {}\n"
        "for line in sys.stdin:\n"
        "    dep, method, args, kwargs, timeout_s = json.loads(line)\n"
        "    try:\n"
        "        h = handles.get(dep) or handles.setdefault(dep, serve.get_deployment_handle(dep, app_name='specserve'))\n"
        "        out = {'ok': getattr(h, method).remote(*args, **kwargs).result(timeout_s=timeout_s)}\n"
        "    except Exception as e:\n"
        "        out = {'error': repr(e)[-2000:]}\n"
        "    print('@@' + json.dumps(out), flush=True)\n"
    )

    def __init__(self, cluster: LocalCluster) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self._CODE, f"127.0.0.1:{cluster.gcs_port}"],
            cwd=ROOT,
            env=cluster.driver_env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def call(self, deployment: str, method: str, *args: Any, timeout_s: float = 60, **kwargs: Any) -> Any:
        """``kwargs`` go to the method too; ``replica_id=...`` sends a TargetWorker call to that replica
        (deployments/replica_router.py ranks the named replica first)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([deployment, method, list(args), kwargs, timeout_s]) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("probe process exited")
            if line.startswith("@@"):
                out = json.loads(line[2:])
                if "error" in out:
                    raise RuntimeError(out["error"])
                return out["ok"]

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
