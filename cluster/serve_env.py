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

``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` installs one middleware in Serve's HTTP proxy: a
client that stops reading its stream is cut after ``ingress.stream_idle_timeout_s``
(deployments/proxy_middleware.py).

Two settings of that mode stay off. ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`` (handle calls routed
on the caller's event loop instead of Serve's router thread) read slower here, paired against the
four above (benchmarks/serving/env_ab.py, ``benchmarks/results/serve_router_loop_ab.json``). It also refuses
a handle call from any thread but the loop's: the target's engine thread therefore makes its draft
calls on the replica's loop (deployments/remote_draft.py), and drivers that wait on ``.result()``
outside a loop run with :data:`DRIVER_ENV`, so a user who turns it on (or Ray's whole mode) keeps
draft-model speculation.
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
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.proxy_middleware.middlewares",
}


# A driver (a script that calls replicas through handles and waits with ``.result()`` outside any
# event loop) needs Serve's router thread, whatever the replicas route with.
DRIVER_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}


def with_serve_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus :data:`SERVE_ENV` for every variable it does not set already."""
    return {**SERVE_ENV, **env}
