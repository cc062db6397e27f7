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

Serve's request path also pays per request and per streamed chunk for a thread hop and logs a
serving node does not need. The next four are settings of Ray's own throughput-optimized mode
(``RAY_SERVE_THROUGHPUT_OPTIMIZED``):

- ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``: each replica runs the deployment's code on its
  main event loop, so a chunk crosses no thread on its way out of the target or through the
  ingress. Our deployments never block their loop: the engine steps in its own thread
  (workers/async_engine.py).
- ``RAY_SERVE_USE_GRPC_BY_DEFAULT=1``: handle calls between replicas (ingress -> Router, ingress
  -> target, target -> Router, target -> draft) go over Serve's gRPC data plane instead of Ray
  actor calls.
- ``RAY_SERVE_LOG_TO_STDERR=0``: replica logs go to their files under the Ray session's
  ``logs/serve/`` only, not also to stderr, which Ray's log monitor tails and forwards.
- ``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1000``: per-request access log lines are written in
  batches of 1000, and at once when an ERROR is logged.

Two settings of that mode stay off. ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`` routes handle calls
on the caller's event loop and refuses a call from any other thread, and the target's engine thread
calls the draft worker synchronously (deployments/remote_draft.py): with it, every draft-model and
EAGLE step falls back to a plain one, and a driver that calls a replica with ``.result()`` from
outside an event loop (cluster/local_cluster.py:Probe) fails.
Direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS``) binds every ingress replica's own HTTP port on
all interfaces and holds a stopping replica open for 30 s.

The user's own environment wins: a variable already set is passed on as it is. The ``ray up``
configs (cluster/aws.yaml, cluster/local.yaml) export the same values; a config test keeps them in
step with :data:`SERVE_ENV`.
"""

from __future__ import annotations

SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}


def with_serve_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus :data:`SERVE_ENV` for every variable it does not set already."""
    return {**SERVE_ENV, **env}
