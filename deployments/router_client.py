"""The ingress's side of the Router: bounded calls, so the Router is never on a request's failure path.

A Router that fails, restarts or is slow costs a request at most ``router.route_timeout_s``: the
request is then served without its choice of replica (Serve picks one, and the engine's per-step
policy decides the path, as it does for every request), and ``/health`` asks a target replica
itself.
"""

from __future__ import annotations

from typing import Any, Callable

from ray.serve.handle import DeploymentHandle

from deployments.calls import within

HEALTH_TIMEOUT_S = 1.0  # the Router's view of the replicas, for /health
TARGET_HEALTH_TIMEOUT_S = 2.0  # a target replica's own answer, when the Router gives none


class RouterClient:
    def __init__(
        self,
        router: DeploymentHandle,
        target: DeploymentHandle,
        timeout_s: float,
        k_max: int,
        on_fallback: Callable[[str], None],
    ) -> None:
        self.router = router
        self.target = target  # unary handle
        self.timeout_s = timeout_s
        self.k_max = k_max
        self.on_fallback = on_fallback

    async def route(
        self, speculation: str, proposer: str | None, exclude: str | None = None, prefix: list[int] | None = None
    ) -> dict[str, Any]:
        """The Router's choice of replica (other than ``exclude``; preferring the one sent the most of
        ``prefix``, the prompt's block hashes), or none within ``timeout_s``."""
        resp = self.router.route.remote(speculation, proposer, self.k_max, exclude, prefix)
        try:
            return await within(resp, self.timeout_s)
        except Exception as e:  # noqa: BLE001  (timeout, a dead or restarting Router)
            resp.cancel()
            self.on_fallback(type(e).__name__)
            return {"replica_id": None, "path": "unknown", "k": None, "load_age_s": None, "fallback": type(e).__name__}

    async def healthy(self) -> bool:
        """Some target replica can serve: the Router's view, or else a replica's own answer."""
        try:
            return bool(await within(self.router.healthy.remote(), HEALTH_TIMEOUT_S))
        except Exception:  # noqa: BLE001
            pass
        try:
            await within(self.target.load.remote(), TARGET_HEALTH_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001
            return False
