"""The Serve app's actors as fault tests reach them: the ingress replicas by name, and a kill
as a crash or the OOM killer would do it."""

from __future__ import annotations

import os
import signal

import ray


def ingress_actors() -> dict:
    """Actor name -> handle of the live ingress replicas (Serve names them in its namespace)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and "FairbatchIngress" in a["name"]:
            try:
                out[a["name"]] = ray.get_actor(a["name"], namespace="serve")
            except ValueError:
                continue  # died meanwhile
    return out


def sigkill(actor) -> int:
    """SIGKILL the actor's process, as a crash or the OOM killer would (not `ray.kill`, which
    Ray carries out itself). Returns the pid."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return pid
