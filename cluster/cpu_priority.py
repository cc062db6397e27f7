"""Engine first on a CPU node: how the launchers start Ray so that the engine's threads keep the cores.

On a CPU node the target engine runs one torch thread per core, and each of a step's ~400 parallel
ops waits for its slowest thread. Any other process that wakes up (an idle Ray node wakes its
daemons some 3000 times a second) preempts an engine thread and stalls the whole op, so the cluster
costs the engine far more than the CPU it uses. Three parts put the engine first:

- ``ray start`` runs under ``SCHED_BATCH``, which every process it starts inherits, workers included:
  a woken batch task waits for the running thread's time slice instead of preempting it.
- ``RAY_worker_niceness=0``: Ray starts its workers at nice 15, below its own daemons. The engine
  thread could not climb back to 0 without privilege, and under load the HTTP proxy and the ingress
  at 15 starve behind a nice-0 engine (measured: TTFT p50 at 16 streams 0.25 s -> 1.3-1.6 s).
- Once deployed, Ray's background daemons (GCS, dashboard, agents, log monitor, Serve controller)
  go to ``SCHED_IDLE``: they run on cycles nobody else wants. The raylet stays at ``SCHED_BATCH``:
  the workers it starts inherit its policy and could not leave ``SCHED_IDLE`` without privilege.

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

# Command-line markers of Ray's background daemons: nothing on a request's path waits for them.
BACKGROUND = ("gcs_server", "dashboard", "log_monitor", "autoscaler/_private/monitor.py", "ray.util.client.server",
              "DashboardAgent", "RuntimeEnvAgent", "ServeController", "multiprocessing.forkserver")


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


def is_background(proc: psutil.Process) -> bool:
    """By the program a process runs (its first few words), never by its flags: the raylet's own
    flags name the dashboard agent's command, and the raylet must stay."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    if not cmd or Path(cmd[0]).name == "raylet":
        return False
    head = " ".join(cmd[:4])
    return any(m in head for m in BACKGROUND)


def demote_background(procs: Iterable[psutil.Process]) -> int:
    """Every thread of the background daemons among ``procs`` to ``SCHED_IDLE``; threads changed."""
    if not hasattr(os, "sched_setscheduler"):
        return 0
    changed = 0
    for proc in procs:
        if not is_background(proc):
            continue
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
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
                a.startswith(("--gcs-address=", "--gcs_address=")) and a.endswith(f":{gcs_port}") for a in cmd):
            session = next((a.split("=", 1)[1] for a in cmd if a.startswith(("--session-dir=", "--session_dir="))),
                           None)
            if session:
                break
    if not session:
        return []
    found: dict[int, psutil.Process] = {}
    gcs = f":{gcs_port}"
    for p in psutil.process_iter(["cmdline"]):
        # the session's own processes, and those that only name the GCS address (Ray's client server)
        if any(a.endswith(session) or session + "/" in a or (a.startswith("--address=") and a.endswith(gcs))
               for a in (p.info["cmdline"] or [])):
            found[p.pid] = p
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                pass
    return list(found.values())
