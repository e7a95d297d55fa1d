"""Start a fairbatch cluster on a running Ray: one controller, one replica actor per GPU.

The controller owns the replicas (`replica_set.py`): it creates them, replaces one that dies,
and stops them on `shutdown()`. They are detached actors (they must outlive a controller
restart), so a cluster on a long-lived Ray should be shut down; a local `ray.init()` takes
them with it when it stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from fairbatch.deployments.controller import controller_actor
from fairbatch.deployments.fairness import ControllerConfig
from fairbatch.deployments.replica import ReplicaConfig
from fairbatch.deployments.replica_set import ReplicaSet, ReplicaSpec

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    name: str
    controller: Any
    replica_set: ReplicaSet

    @property
    def replicas(self) -> dict[str, Any]:
        """Replica id -> handle of the replicas in service now, replacements included (one call
        to the controller; a killed replica is listed until the controller has noticed)."""
        return ray.get(self.controller.replica_handles.remote(), timeout=30)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the replicas (none is replaced), then the controller."""
        try:
            ray.get(self.controller.shutdown_replicas.remote(), timeout=timeout_s)
        except Exception as e:  # the controller is gone: find its replicas by name
            log.warning("cluster %s: shutdown through the controller failed: %r", self.name, e)
            kill_named(self.replica_set)
        ray.kill(self.controller, no_restart=True)


def kill_named(rs: ReplicaSet) -> int:
    """Kill every live actor of the set's slots, found by name (the controller is gone)."""
    namespace = rs.namespace or ray.get_runtime_context().namespace
    killed = 0
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if a["namespace"] == namespace and rs.slot_of(name) in {s.replica_id for s in rs.replicas}:
            try:
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                killed += 1
            except Exception as e:  # died meanwhile
                log.debug("kill %s: %r", name, e)
    return killed


def start_cluster(
    name: str,
    replicas: list[ReplicaConfig],
    controller: ControllerConfig | None = None,
    *,
    ready_timeout_s: float = 120.0,
) -> Cluster:
    """Create the named controller with the replica set; it creates the replicas (they find it
    by name and report). Returns once every replica has reported once."""
    ctrl_name = f"{name}-controller"
    rs = ReplicaSet(
        ctrl_name,
        [ReplicaSpec(f"{name}-r{i}", cfg) for i, cfg in enumerate(replicas)],
        start_timeout_s=ready_timeout_s,
    )
    ctrl = controller_actor().options(name=ctrl_name).remote(controller or ControllerConfig(), rs)
    cluster = Cluster(name, ctrl, rs)
    try:
        ray.get(ctrl.ensure_replicas.remote(ready_timeout_s), timeout=ready_timeout_s + 30)
    except Exception:
        cluster.shutdown()  # the replicas that did start are detached: stop them
        raise
    return cluster
