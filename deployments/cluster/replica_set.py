"""The replica set: which replicas a cluster should have, and the supervisor that keeps it so.

A cluster is a fixed list of replica *slots* (`ReplicaSpec`: an id and a `ReplicaConfig`) and
one way of starting each (`ReplicaSet`: the actor class - `Replica` or a subclass - its extra
constructor args, and its placement). The controller owns the set: its `Supervisor` creates
every slot's replica, and when the controller has confirmed a replica dead (and fenced it) it
starts a replacement - same class, config and placement - under a new id `<slot>~<hex>`, waits
until it is up and has reported (its first report puts it into placement), retrying with
exponential backoff a bounded number of times. A replica retired on purpose (scale-down,
shutdown) is not replaced.

Why not Ray's `max_restarts` on the replica actor: a restarted actor keeps its id, name and
handle but comes back empty (no KV, no requests, reports numbered from 1 again), so the
controller would have to spot a new incarnation behind an unchanged id and reconcile its stale
assignments; and Ray does not restart an actor killed with `no_restart=True` or whose
constructor fails. A new id turns a death into what the controller already handles (drop the
replica, its clients resubmit) and a replacement into an ordinary first report; attempts,
backoff and giving up are ours to bound and to show in `stats()`.

Replicas are detached actors: created by the controller, they would otherwise die with it, and
Ray restarts the controller. A restarted controller (fresh state, same constructor args) learns
its replicas from their reports; `reconcile()` (every few seconds) then brings up any slot with
no replica in service `grace_s` after the start - adopting a live named actor of that slot
(one whose creator died before starting it) before creating one - and stops a second live
actor of a slot that has one in service.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fairbatch.deployments.cluster.replica import Replica, ReplicaConfig

log = logging.getLogger(__name__)

SEP = "~"  # a replacement's id (and actor name): <slot id>~<hex>


@dataclass
class ReplicaSpec:
    replica_id: str  # the slot: the id (and actor name) of its first replica
    config: ReplicaConfig


@dataclass
class ReplicaSet:
    """Every replica of a cluster, and how each is started (the same way every time)."""

    controller_name: str
    replicas: list[ReplicaSpec]
    # constructed as actor_cls(replica_id, config, controller_name, namespace, **kwargs)
    actor_cls: type = Replica
    kwargs: dict = field(default_factory=dict)
    namespace: str | None = None  # where the actors are named; None = the controller's
    num_gpus: float = 1.0
    max_concurrency: int = 1000
    start_timeout_s: float = 120.0  # one attempt: created, constructed, first report
    max_attempts: int = 5  # per bring-up; then the slot rests for retry_after_s
    backoff_s: float = 0.5  # sleep after a failed attempt; doubles, up to backoff_max_s
    backoff_max_s: float = 30.0
    retry_after_s: float = 60.0  # a slot that exhausted its attempts is tried again after
    grace_s: float = 10.0  # after a controller (re)start, replicas have this long to report
    # an AutoscalingConfig: the controller adds slots (`Supervisor.add_slot`) and drains and
    # retires replicas within its bounds; None: the slots above are the cluster
    autoscaling: Any = None

    def slot_of(self, replica_id: str) -> str:
        ids = {s.replica_id for s in self.replicas}
        return replica_id if replica_id in ids else replica_id.rpartition(SEP)[0]


class RayLauncher:
    """The supervisor's only contact with Ray: create, start, find and kill replica actors."""

    def __init__(self, rs: ReplicaSet) -> None:
        import ray

        self.rs = rs
        self.namespace = rs.namespace or ray.get_runtime_context().namespace
        self._cls = ray.remote(rs.actor_cls)

    def create(self, name: str, config: ReplicaConfig) -> Any:
        rs = self.rs
        return self._cls.options(
            name=name,
            namespace=self.namespace,
            lifetime="detached",  # must outlive the controller that creates it (restarts)
            num_gpus=rs.num_gpus,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=rs.max_concurrency,
        ).remote(name, config, rs.controller_name, self.namespace, **rs.kwargs)

    async def start(self, handle: Any, timeout_s: float) -> None:
        """Returns once the actor is constructed and reporting (idempotent)."""
        await asyncio.wait_for(handle.start.remote(), timeout_s)

    async def names(self) -> list[str]:
        """Names of the live actors in our namespace (one call to Ray's GCS)."""
        import ray

        actors = await asyncio.to_thread(ray.util.list_named_actors, True)
        return [a["name"] for a in actors if a["namespace"] == self.namespace]

    async def get(self, name: str) -> Any | None:
        import ray

        try:
            return await asyncio.to_thread(ray.get_actor, name, self.namespace)
        except ValueError:  # gone meanwhile
            return None

    def kill(self, handle: Any) -> None:
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception as e:  # already gone
            log.debug("kill failed: %r", e)


class Slot:
    __slots__ = ("spec", "current", "task", "retired", "launches", "failed_at", "last_error")

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.current: str | None = None  # the replica in service for this slot
        self.task: asyncio.Task | None = None  # a bring-up in progress
        self.retired = False  # removed on purpose: never brought up again
        self.launches = 0  # actors this supervisor created for the slot
        self.failed_at: float | None = None  # the last bring-up gave up at
        self.last_error: str | None = None


class Supervisor:
    """Keeps one replica in service per slot. Driven by the controller: `register` (a replica's
    first report), `lost` (confirmed dead), `retire`, `ensure` (create all, wait), `reconcile`
    (periodic), `stop`. `is_up(id)` says whether the controller has that replica in placement;
    `config_for(spec)` gives the config to start a slot's replica with (run-time updates)."""

    poll_s = 0.05

    def __init__(
        self,
        rs: ReplicaSet,
        launcher: Any,
        is_up: Callable[[str], bool],
        config_for: Callable[[ReplicaSpec], ReplicaConfig] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.rs = rs
        self.launcher = launcher
        self.is_up = is_up
        self.config_for = config_for or (lambda spec: spec.config)
        self.clock = clock
        self.sleep = sleep
        self.slots = {s.replica_id: Slot(s) for s in rs.replicas}
        self.dead: set[str] = set()  # fenced ids: never adopted, never in service again
        self.stopping = False
        self.started_at = clock()
        self.num_replaced = 0
        self.num_failed_attempts = 0
        self.num_reconciles = 0

    def slot_of(self, replica_id: str) -> Slot | None:
        return self.slots.get(self.rs.slot_of(replica_id))

    def _in_service(self, slot: Slot) -> bool:
        return slot.current is not None and self.is_up(slot.current)

    # ---- events from the controller ---------------------------------------------------------

    def register(self, replica_id: str) -> bool:
        """A replica reports for the first time. False: it must not serve (its slot is retired,
        the set is stopping, or the slot already has another replica in service)."""
        slot = self.slot_of(replica_id)
        if slot is None:
            return not self.stopping  # not one of ours (started by hand): leave it be
        if slot.retired or self.stopping or replica_id in self.dead:
            self.dead.add(replica_id)  # the controller stops it: never adopt it
            return False
        if slot.current not in (None, replica_id) and self.is_up(slot.current):
            self.dead.add(replica_id)
            log.warning(
                "slot %s: %s serves; %s is a duplicate",
                slot.spec.replica_id,
                slot.current,
                replica_id,
            )
            return False
        slot.current = replica_id
        return True

    def lost(self, replica_id: str) -> None:
        """The controller confirmed the replica dead and fenced it: replace it."""
        self.dead.add(replica_id)
        slot = self.slot_of(replica_id)
        if slot is None or slot.current != replica_id:
            return  # not the one in service (a duplicate, an earlier incarnation)
        slot.current = None
        self._bring_up_soon(slot, replacing=True)

    def retire(self, replica_id: str) -> bool:
        """Removed on purpose: its slot is never brought up again (by this controller)."""
        self.dead.add(replica_id)
        slot = self.slot_of(replica_id)
        if slot is None:
            return False
        slot.retired = True
        slot.current = None
        if slot.task is not None:
            slot.task.cancel()
        return True

    def add_slot(self) -> str:
        """Scale-up: a new slot like the first one (`<base>-r<i>`, the next free index), its
        replica brought up now. When no node has a free GPU the actor waits for Ray's
        autoscaler to add one (bounded by `start_timeout_s` per attempt). Returns its id."""
        first = self.rs.replicas[0]
        base = first.replica_id.rpartition("-r")[0] or first.replica_id
        i = len(self.rs.replicas)
        while f"{base}-r{i}" in self.slots:
            i += 1
        spec = ReplicaSpec(f"{base}-r{i}", first.config)
        self.rs.replicas.append(spec)
        slot = self.slots[spec.replica_id] = Slot(spec)
        self._bring_up_soon(slot)
        return spec.replica_id

    def starting(self) -> list[str]:
        """Slots being brought up that have no replica in service yet."""
        return [
            sid
            for sid, s in self.slots.items()
            if s.task is not None and not s.retired and not self._in_service(s)
        ]

    async def ensure(self, timeout_s: float) -> bool:
        """Bring up every slot without a replica in service (also those that gave up) and wait
        for all of them, up to `timeout_s`. True when every live slot is served."""
        if self.stopping:
            raise RuntimeError("the replica set was shut down")
        for slot in self.slots.values():
            if not slot.retired and not self._in_service(slot):
                self._bring_up_soon(slot)
        tasks = [s.task for s in self.slots.values() if s.task is not None]
        if tasks:
            await asyncio.wait([asyncio.shield(t) for t in tasks], timeout=timeout_s)
        return all(self._in_service(s) for s in self.slots.values() if not s.retired)

    async def reconcile(self) -> None:
        """Periodic: bring up slots with no replica in service (after a controller restart, a
        death while it was down, a bring-up that gave up long enough ago), and stop a second
        live actor of a slot that has one in service."""
        now = self.clock()
        if self.stopping or now - self.started_at < self.rs.grace_s:
            return  # replicas that outlived a controller restart have not all reported yet
        self.num_reconciles += 1  # full passes
        for slot in self.slots.values():
            if slot.retired or slot.task is not None or self._in_service(slot):
                continue
            if slot.failed_at is not None and now - slot.failed_at < self.rs.retry_after_s:
                continue
            self._bring_up_soon(slot, replacing=True)
        names = await self.launcher.names()
        for name in names:
            slot = self.slot_of(name)
            if slot is None or slot.task is not None or not self._in_service(slot):
                continue
            if name != slot.current and name not in self.dead:
                log.warning(
                    "slot %s: stopping %s, a second replica (%s serves)",
                    slot.spec.replica_id,
                    name,
                    slot.current,
                )
                self.dead.add(name)
                handle = await self.launcher.get(name)
                if handle is not None:
                    self.launcher.kill(handle)

    async def stop(self) -> int:
        """The cluster is going away: bring nothing up again, stop every actor of every slot
        (the controller kills the ones in service too). Returns how many were found."""
        self.stopping = True
        for slot in self.slots.values():
            if slot.task is not None:
                slot.task.cancel()
        killed = 0
        for name in await self.launcher.names():
            if self.slot_of(name) is not None:
                handle = await self.launcher.get(name)
                if handle is not None:
                    self.launcher.kill(handle)
                    killed += 1
        return killed

    def stats(self) -> dict:
        return {
            "slots": {
                sid: {
                    "replica": s.current,
                    "retired": s.retired,
                    "bringing_up": s.task is not None,
                    "gave_up": s.failed_at is not None,
                    "last_error": s.last_error,
                }
                for sid, s in self.slots.items()
            },
            "replaced": self.num_replaced,
            "failed_attempts": self.num_failed_attempts,
            "reconciles": self.num_reconciles,
            "stopping": self.stopping,
        }

    # ---- bringing a slot up -------------------------------------------------------------------

    def _bring_up_soon(self, slot: Slot, replacing: bool = False) -> None:
        if slot.task is not None or slot.retired or self.stopping:
            return
        slot.task = asyncio.get_running_loop().create_task(self._bring_up(slot, replacing))

        def done(task: asyncio.Task, slot: Slot = slot) -> None:
            if slot.task is task:
                slot.task = None

        slot.task.add_done_callback(done)

    async def _bring_up(self, slot: Slot, replacing: bool) -> bool:
        rs = self.rs
        delay = rs.backoff_s
        for attempt in range(1, rs.max_attempts + 1):
            if slot.retired or self.stopping:
                return False
            name, handle = None, None
            try:
                name, handle = await self._launch(slot)
                await self.launcher.start(handle, rs.start_timeout_s)
                await self._until_up(name, rs.start_timeout_s)
                if slot.current != name:
                    raise RuntimeError(f"{name} was turned away")
                slot.failed_at, slot.last_error = None, None
                self.num_replaced += replacing
                log.info("slot %s: %s in service (attempt %d)", slot.spec.replica_id, name, attempt)
                return True
            except asyncio.CancelledError:
                if handle is not None and not (name == slot.current and self.is_up(name)):
                    self.launcher.kill(handle)
                raise
            except Exception as e:
                if name is not None and name == slot.current and self.is_up(name):
                    slot.failed_at, slot.last_error = None, None
                    self.num_replaced += replacing
                    return True  # it made it after all
                self.num_failed_attempts += 1
                slot.last_error = repr(e)
                log.warning(
                    "slot %s: attempt %d/%d (%s) failed: %r",
                    slot.spec.replica_id,
                    attempt,
                    rs.max_attempts,
                    name,
                    e,
                )
                if name is not None:
                    self.dead.add(name)
                if handle is not None:
                    self.launcher.kill(handle)
            if attempt < rs.max_attempts:
                await self.sleep(delay)
                delay = min(rs.backoff_max_s, 2 * delay)
        slot.failed_at = self.clock()
        log.error("slot %s: no replica after %d attempts", slot.spec.replica_id, rs.max_attempts)
        return False

    async def _launch(self, slot: Slot) -> tuple[str, Any]:
        """A live named actor of the slot nobody started (its creator, an earlier controller,
        died first) is adopted; otherwise a new one is created: the slot's own id the first
        time, `<slot>~<hex>` after that (the dead one's name may not be free yet)."""
        sid = slot.spec.replica_id
        for name in await self.launcher.names():
            if name not in self.dead and self.slot_of(name) is slot:
                handle = await self.launcher.get(name)
                if handle is not None:
                    return name, handle
        name = sid if slot.launches == 0 else f"{sid}{SEP}{uuid.uuid4().hex[:6]}"
        slot.launches += 1
        return name, self.launcher.create(name, self.config_for(slot.spec))

    async def _until_up(self, replica_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_up(replica_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica_id} did not report within {timeout_s:g}s")
            await asyncio.sleep(self.poll_s)
