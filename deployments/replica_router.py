"""A Serve request router that sends a request to the target replica the Router chose.

The Router actor (deployments/router.py) sees every replica's live load and names a
replica id; the ingress passes it as the ``replica_id`` keyword of the call, and this
class (running inside the ingress's handle) ranks that replica first. Without a hint,
or when the replica is gone, it falls back to every candidate (Serve then picks one
that has capacity), so a stale hint never fails a request.
"""

from __future__ import annotations

from typing import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class HintedReplicaRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        pass

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Sequence[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hint = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if hint:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == hint]
            if chosen:
                rest = [r for r in candidate_replicas if r.replica_id.unique_id != hint]
                return [chosen, rest] if rest else [chosen]
        return [candidate_replicas]
