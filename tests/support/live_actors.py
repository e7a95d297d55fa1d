"""The actors of a served app that are alive now, found by name (tests that kill them)."""

from __future__ import annotations


def live_replicas(prefix: str) -> dict:
    """Name -> handle of the cluster's replica actors (`<cluster id>-r<i>`, `...~<hex>` for a
    replacement) that answer a ping now: not what the controller believes."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from fairbatch.deployments.cluster.launch import NAMESPACE

    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] != NAMESPACE or not a["name"].startswith(prefix):
            continue
        try:
            h = ray.get_actor(a["name"], namespace=NAMESPACE)
            ray.get(h.ping.remote(), timeout=30)
        except (ValueError, RayActorError, GetTimeoutError):
            continue  # killed, or dying
        out[a["name"]] = h
    return out
