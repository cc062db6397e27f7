"""Ray Serve's own background work, cut to what a serving node needs: the environment ``ray start``
gives every process it starts (the Serve controller, the HTTP proxy, every replica).

On a CPU node every cycle Serve spends beside the engine stretches the engine's steps (see
cluster/cpu_priority.py for why a little CPU costs a lot there). Serve's defaults poll fast:

- ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S`` (default 0.1 s): the controller reconciles every deployment
  ten times a second, and each pass calls the GCS. Two passes a second still notice a dead replica,
  a new config or an autoscaling decision well within the health-check period and the autoscaling
  delays, which are seconds.
- ``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`` (default 100 ms): every replica and proxy flushes its
  cached Ray metrics ten times a second; Prometheus scrapes every few seconds at best.

The user's own environment wins: a variable already set is passed on as it is. The ``ray up``
configs (cluster/aws.yaml, cluster/local.yaml) export the same values; a config test keeps them in
step with :data:`SERVE_ENV`.
"""

from __future__ import annotations

SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def with_serve_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus :data:`SERVE_ENV` for every variable it does not set already."""
    return {**SERVE_ENV, **env}
