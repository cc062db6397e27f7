"""Engine first on a CPU node: how the launchers start Ray so that the engine's threads keep the cores.

On a CPU node the target engine runs one torch thread per core, and each of a step's ~400 parallel
ops waits for its slowest thread. Any other process that wakes up (an idle Ray node wakes its
daemons some 3000 times a second) preempts an engine thread and stalls the whole op, so the cluster
costs the engine far more than the CPU it uses. Three parts put the engine first:

- ``ray start`` runs under ``SCHED_BATCH``, which every process it starts inherits, workers included:
  a woken batch task waits for the running thread's time slice instead of preempting it.
- ``RAY_worker_niceness=0``: Ray starts its workers at nice 15, below its own daemons. The engine
  thread could not climb back to 0 without privilege, and under load the HTTP proxy and the ingress
  at 15 starve behind a nice-0 engine, and TTFT grows several-fold (docs/benchmarks.md).
- Once deployed, Ray's background daemons step back. The ones nothing waits for (dashboard, its
  agent, log monitor, autoscaler monitor, client server) go to ``SCHED_IDLE``: they run on cycles
  nobody else wants. The GCS, the Serve controller and the runtime-env agent go to nice
  :data:`DAEMON_NICE` instead: under full load they still get about a tenth of a core, which their
  health checks need (a starved GCS declares a node dead, a starved controller a replica), where
  ``SCHED_IDLE`` would leave them ~0.3%. The raylet keeps nice 0: the workers it starts inherit its
  nice value and policy, and could not climb back without privilege.

The engine's loop thread then claims ``SCHED_OTHER`` (``engine.cpu_priority: engine_first``,
workers/hardware.py:claim_cpu). ``engine.cpu_priority: inherit`` turns all of it off. Every change
here only lowers a priority, which needs no privilege. Linux only; elsewhere nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import psutil

RAY_ENV = {"RAY_worker_niceness": "0"}
DAEMON_NICE = 10  # CFS weight 110 against the engine's 1024

# Program markers of Ray's background daemons: nothing on a request's path waits for them. The first
# group has health checks that fail when it starves; the second can wait for idle cycles.
NICE_DAEMONS = ("gcs_server", "ServeController", "RuntimeEnvAgent")
IDLE_DAEMONS = (
    "dashboard",
    "log_monitor",
    "autoscaler/_private/monitor.py",
    "ray.util.client.server",
    "DashboardAgent",
    "multiprocessing.forkserver",
)


def enabled(app_args: dict[str, Any]) -> bool:
    """Whether an app config (the ``args`` of ray_config.yaml's application) asks for engine first."""
    return (app_args.get("engine") or {}).get("cpu_priority", "engine_first") == "engine_first"


def ray_start_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for ``ray start``, with Ray's workers at the daemons' nice value."""
    return {**env, **RAY_ENV}


def start_batch() -> None:
    """``preexec_fn`` for ``ray start``: the child and everything it starts run ``SCHED_BATCH``."""
    if hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def ray_start_kwargs(env: dict[str, str], engine_first: bool) -> dict[str, Any]:
    """``subprocess.run`` keywords for ``ray start``: engine first (:func:`ray_start_env`,
    :func:`start_batch`) when the app config asks for it, else ``env`` as it is."""
    return {"env": ray_start_env(env), "preexec_fn": start_batch} if engine_first else {"env": env}


def daemon_kind(proc: psutil.Process) -> str | None:
    """``"nice"`` or ``"idle"`` for a background daemon, ``None`` for anything else. By the program a
    process runs (its first few words), never by its flags: the raylet's flags name the dashboard
    agent's command, and the raylet must stay."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    if not cmd or Path(cmd[0]).name == "raylet":
        return None
    head = " ".join(cmd[:4])
    if any(m in head for m in NICE_DAEMONS):
        return "nice"
    return "idle" if any(m in head for m in IDLE_DAEMONS) else None


def demote(tid: int, kind: str) -> None:
    """One thread of a background daemon to its place (only ever lowered)."""
    if kind == "idle":
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, max(DAEMON_NICE, os.getpriority(os.PRIO_PROCESS, tid)))


def demote_background(procs: Iterable[psutil.Process]) -> int:
    """Every thread of the background daemons among ``procs`` to its place; the threads changed."""
    if not hasattr(os, "sched_setscheduler"):
        return 0
    changed = 0
    for proc in procs:
        kind = daemon_kind(proc)
        if kind is None:
            continue
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                demote(tid, kind)
                changed += 1
            except OSError:  # the thread ended, or it is not ours
                pass
    return changed


def session_processes(gcs_port: int) -> list[psutil.Process]:
    """Every process of the Ray cluster whose GCS listens on ``gcs_port``: those naming its session
    directory, and their children (workers rename themselves ``ray::...``)."""
    session = None
    for p in psutil.process_iter(["cmdline"]):  # the GCS, or any raylet / monitor that names its address
        cmd = p.info["cmdline"] or []
        if f"--gcs_server_port={gcs_port}" in cmd or any(
            a.startswith(("--gcs-address=", "--gcs_address=")) and a.endswith(f":{gcs_port}") for a in cmd
        ):
            session = next(
                (a.split("=", 1)[1] for a in cmd if a.startswith(("--session-dir=", "--session_dir="))), None
            )
            if session:
                break
    if not session:
        return []
    found: dict[int, psutil.Process] = {}
    gcs = f":{gcs_port}"
    for p in psutil.process_iter(["cmdline"]):
        # the session's own processes, and those that only name the GCS address (Ray's client server)
        if any(
            a.endswith(session) or session + "/" in a or (a.startswith("--address=") and a.endswith(gcs))
            for a in (p.info["cmdline"] or [])
        ):
            found[p.pid] = p
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                pass
    return list(found.values())
