"""Starting a fairbatch cluster on a running Ray, or finding the one that runs: a named,
detached controller that owns one replica actor per GPU (`replica_set.py`: it creates them,
replaces one that dies, stops them on `shutdown_replicas()`).

There is one way to start it, `ensure_cluster(spec)`: the Serve ingress calls it (a second
ingress replica, or the next version of the app, finds the running cluster by name; its
`ensure_replicas` finds the replicas in service, replacements included), and so does
`start_cluster`, the synchronous form for drivers, tests and benchmarks. Every ingress
`attach`es to the controller and the last one to `detach` tears the cluster down. The
cluster's name carries a digest of its settings, so a redeploy that changes the engine or the
replica count builds a new cluster next to the old one (which goes when the old ingress
detaches); one that changes only tenants keeps it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from fairbatch.deployments.cluster.admin_store import AdminChanges, GcsKeyValue
from fairbatch.deployments.cluster.autoscaling import AutoscalingConfig
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.managed import ClusterController, ClusterReplica
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.deployments.cluster.replica_set import ReplicaSet, ReplicaSpec
from fairbatch.deployments.cluster.tickets import APP_SETTINGS

log = logging.getLogger(__name__)

NAMESPACE = "fairbatch"  # the cluster's actors live here, whatever job started them


HEAD_NODE = "node:__internal_head__"  # a resource only Ray's head node has


@dataclass
class ClusterSpec:
    """What the ingress asks for: the cluster's identity is a digest of all of it."""

    name: str
    replicas: list[ReplicaConfig]
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    num_gpus_per_replica: float = 1.0
    metrics_interval_s: float = 1.0
    autoscaling: AutoscalingConfig | None = None  # None: `replicas` is the cluster, fixed

    def cluster_id(self) -> str:
        controller = asdict(self.controller)
        for key in APP_SETTINGS:  # each ingress sets them when it attaches
            controller.pop(key)
        settings: tuple = (
            [asdict(r) for r in self.replicas],
            controller,
            self.num_gpus_per_replica,
        )
        if self.autoscaling is not None:
            settings += (asdict(self.autoscaling),)
        body = repr(settings)
        return f"{self.name}-{hashlib.sha256(body.encode()).hexdigest()[:8]}"

    def replica_set(self, timeout_s: float) -> ReplicaSet:
        """The replicas as the controller starts (and replaces) them: `ClusterReplica`s with
        these configs and GPUs, named `<cluster id>-r<i>` (replacements `<...>-r<i>~<hex>`)."""
        cid = self.cluster_id()
        return ReplicaSet(
            f"{cid}-controller",
            [ReplicaSpec(f"{cid}-r{i}", cfg) for i, cfg in enumerate(self.replicas)],
            actor_cls=ClusterReplica,
            kwargs={"metrics_interval_s": self.metrics_interval_s},
            namespace=NAMESPACE,
            num_gpus=self.num_gpus_per_replica,
            start_timeout_s=timeout_s,
            autoscaling=self.autoscaling,
        )


@dataclass
class ClusterHandles:
    cluster_id: str
    controller: Any
    replicas: dict[str, Any]  # replica id -> handle, when ensured (now: controller.replica_handles)
    namespace: str | None


async def ensure_cluster(spec: ClusterSpec, timeout_s: float) -> ClusterHandles:
    """Create the cluster's detached controller, or find it by name; it creates the replicas
    it does not find (`ensure_replicas`: a second ingress finds them all in service) and this
    waits until every one has reported (bounded by `timeout_s`)."""
    cid = spec.cluster_id()
    ctrl_cls = ray.remote(ClusterController)
    controller = ctrl_cls.options(
        name=f"{cid}-controller",
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=10000,
        resources={HEAD_NODE: 0.001},  # on the head node, with the usage log it writes
    ).remote(
        spec.controller,
        spec.metrics_interval_s,
        spec.replica_set(timeout_s),
        AdminChanges(GcsKeyValue(), f"admin/{spec.name}"),  # per app: outlives the cluster
    )
    replicas = await asyncio.wait_for(
        controller.ensure_replicas.remote(timeout_s), timeout=timeout_s + 30
    )
    return ClusterHandles(cid, controller, replicas, NAMESPACE)


def kill_cluster(handles: ClusterHandles) -> None:
    for h in handles.replicas.values():
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    try:
        ray.kill(handles.controller, no_restart=True)
    except Exception:
        pass


@dataclass
class Cluster:
    """A cluster started from a driver (`start_cluster`)."""

    name: str  # the cluster id (name + settings digest)
    controller: Any
    replica_set: ReplicaSet

    @property
    def handles(self) -> ClusterHandles:
        return ClusterHandles(self.name, self.controller, self.replicas, NAMESPACE)

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
    metrics_interval_s: float = 0.0,
    autoscaling: AutoscalingConfig | None = None,
) -> Cluster:
    """`ensure_cluster` from synchronous code: returns once every replica has reported once.
    No metrics by default (drivers and tests need no gauges)."""
    spec = ClusterSpec(
        name,
        list(replicas),
        controller or ControllerConfig(),
        metrics_interval_s=metrics_interval_s,
        autoscaling=autoscaling,
    )
    rs = spec.replica_set(ready_timeout_s)
    try:
        handles = _run(ensure_cluster(spec, ready_timeout_s))
    except Exception:
        try:
            ctrl = ray.get_actor(f"{spec.cluster_id()}-controller", namespace=NAMESPACE)
            Cluster(spec.cluster_id(), ctrl, rs).shutdown()  # the started ones are detached
        except ValueError:
            pass
        raise
    return Cluster(handles.cluster_id, handles.controller, rs)


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    raise RuntimeError("start_cluster is for synchronous code: await ensure_cluster instead")
