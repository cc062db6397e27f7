"""Engine first on the CPU: the engine's loop thread and its OpenMP pool run SCHED_OTHER while the
process around them runs as Ray's launchers start it (SCHED_BATCH), and the launcher's half."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster import cpu_priority

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")

# Run in a fresh process started at SCHED_BATCH (as `ray start` starts Ray's workers): build an
# AsyncEngine on a tiny model, decode a few tokens on 2 torch threads, then print the policy of the
# loop thread and of every thread that used CPU besides the main thread.
CHILD = r"""
import asyncio, json, os, sys, torch
from workers.async_engine import AsyncEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.hardware import thread_priority
from workers.model_loader import load_model
torch.set_num_threads(2)
claim = sys.argv[2] == "claim"
ae = AsyncEngine(lambda: LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=64, proposers=[]),
                                   load_model(sys.argv[1])), claim_cpu=claim)
async def run():
    return [o async for o in ae.generate("r", [1, 2, 3, 4, 5] * 4, params={"max_tokens": 8, "ignore_eos": True})]
asyncio.run(run())
busy = [int(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()
        and int(open(f"/proc/self/task/{t}/schedstat").read().split()[0]) > 0]
print(json.dumps([ae.cpu_priority, thread_priority(ae.thread_id), sorted(thread_priority(t) for t in busy)]))
"""


@linux_only
@pytest.mark.parametrize("claim", [True, False])
def test_the_engine_thread_and_its_openmp_pool_claim_the_cpu(tiny_model_dir, claim):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tiny_model_dir, "claim" if claim else "inherit"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=cpu_priority.start_batch,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reported, loop, busy = json.loads(out.stdout.strip().splitlines()[-1])
    main_nice = os.getpriority(os.PRIO_PROCESS, 0)
    if claim:
        assert reported == loop == "other/0" or (reported == loop == f"other/{main_nice}" and main_nice > 0)
        # the OpenMP worker the loop thread started inherited its policy: at least two threads run SCHED_OTHER
        assert busy.count(loop) >= 2, busy
    else:
        assert reported == loop == f"batch/{main_nice}"
        assert all(p.startswith("batch/") for p in busy), busy


@linux_only
def test_the_launcher_demotes_only_rays_background_daemons():
    """Processes named like the GCS and the Serve controller go to SCHED_BATCH at the daemons' nice
    value, one named like the dashboard to SCHED_IDLE; one named like a Serve replica (the proxy,
    the ingress, the engine) or the raylet is left as it was."""
    script = "import time, sys; time.sleep(60)"
    names = (
        "gcs_server",
        "ServeController",
        "dashboard/dashboard.py",
        "ServeReplica:specserve:Ingress",
        "raylet --raylet_socket_name=x --dashboard_agent_command=dashboard/agent.py",
    )  # the raylet names the agent
    procs = {name: subprocess.Popen([sys.executable, "-c", script, *name.split()]) for name in names}
    try:
        # a child shows its own command line only once it has exec'd: under load that can take a while
        deadline = time.monotonic() + 30
        while not all(name.split()[0] in " ".join(psutil.Process(p.pid).cmdline()) for name, p in procs.items()):
            assert time.monotonic() < deadline, "the children never showed their command lines"
            time.sleep(0.05)
        changed = cpu_priority.demote_background([psutil.Process(p.pid) for p in procs.values()])
        assert changed >= 3
        got = {
            name.split()[0]: (os.sched_getscheduler(p.pid), os.getpriority(os.PRIO_PROCESS, p.pid))
            for name, p in procs.items()
        }
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        daemon = (os.SCHED_BATCH, max(cpu_priority.DAEMON_NICE, mine))
        assert got == {
            "gcs_server": daemon,
            "ServeController": daemon,
            "dashboard/dashboard.py": (os.SCHED_IDLE, mine),
            "ServeReplica:specserve:Ingress": (os.SCHED_OTHER, mine),
            "raylet": (os.SCHED_OTHER, mine),
        }
    finally:
        for p in procs.values():
            p.kill()


def test_engine_first_follows_the_app_config():
    assert cpu_priority.enabled({"engine": {"model": "smollm2"}})
    assert not cpu_priority.enabled({"engine": {"cpu_priority": "inherit"}})
    assert cpu_priority.ray_start_env({"A": "1"}) == {"A": "1", "RAY_worker_niceness": "0"}
    assert cpu_priority.ray_start_kwargs({"A": "1"}, True) == {
        "env": {"A": "1", "RAY_worker_niceness": "0"},
        "preexec_fn": cpu_priority.start_batch,
    }
    assert cpu_priority.ray_start_kwargs({"A": "1"}, False) == {"env": {"A": "1"}}
