"""Start a fairbatch cluster on a running Ray: one controller, one replica actor per GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from fairbatch.deployments.controller import controller_actor
from fairbatch.deployments.fairness import ControllerConfig
from fairbatch.deployments.replica import ReplicaConfig, replica_actor


@dataclass
class Cluster:
    name: str
    controller: Any
    replicas: dict[str, Any] = field(default_factory=dict)  # replica id -> handle

    def shutdown(self) -> None:
        for handle in self.replicas.values():
            ray.kill(handle, no_restart=True)
        ray.kill(self.controller, no_restart=True)


def start_cluster(
    name: str,
    replicas: list[ReplicaConfig],
    controller: ControllerConfig | None = None,
    *,
    ready_timeout_s: float = 120.0,
) -> Cluster:
    """Create the named controller, then the replicas (they find it by name and report), and
    wait until every replica has reported once."""
    ctrl = (
        controller_actor()
        .options(name=f"{name}-controller")
        .remote(controller or ControllerConfig())
    )
    cls = replica_actor()
    handles = {}
    for i, cfg in enumerate(replicas):
        rid = f"{name}-r{i}"
        handles[rid] = cls.options(name=rid).remote(rid, cfg, f"{name}-controller")
    ray.get([h.start.remote() for h in handles.values()], timeout=ready_timeout_s)
    deadline = time.monotonic() + ready_timeout_s
    while not ray.get(ctrl.ready.remote(len(handles)), timeout=ready_timeout_s):
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster {name}: replicas did not report in {ready_timeout_s}s")
        time.sleep(0.05)
    return Cluster(name, ctrl, handles)
