"""The fairness controller actor: one per cluster, named, restarted by Ray when it dies.

A thin async shell around `FairnessCore` (fairness.py): clients submit requests in batches
(`submit_many`) and hear where each runs on one `assignments` stream per client process; the
controller submits each assigned request to its replica for the client (an actor call per
replica and batch). `report()` folds a replica's report in and carries out the actions that
freed slots allow (assign, preempt, migrate). State lost in a restart is rebuilt from the
replicas' next reports (they carry cumulative service and the requests each replica holds);
clients re-subscribe and submit again what is pending (`submit_many` is idempotent per request
id).

Given a `ReplicaSet`, the controller also owns the replicas' lifecycle (`replica_set.py`): it
creates them (`ensure_replicas`), replaces one it has confirmed dead, and stops them on purpose
(`retire_replica`, `shutdown_replicas`) without replacing them. With `ReplicaSet.autoscaling`
it also sizes the set (`autoscaling.py`): every `interval_s` it adds slots or drains replicas
(`drain_replica`: no request lost, none replaced).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.assignments import ClientSide
from fairbatch.deployments.cluster.autoscaling import (
    Autoscaler,
    Requeue,
    drain_actions,
    drain_choice,
    drained,
    measure,
)
from fairbatch.deployments.cluster.fairness import (
    Assign,
    ControllerConfig,
    Expire,
    FairnessCore,
    Migrate,
    Preempt,
    Refuse,
)
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.deployments.cluster.replica_set import (
    RayLauncher,
    ReplicaSet,
    ReplicaSpec,
    Supervisor,
)
from fairbatch.deployments.cluster.usage_ledger import UsageLedger
from fairbatch.deployments.cluster.wire import Assignment, ReplicaReport, RequestMeta
from fairbatch.deployments.usage import UsageSpec

log = logging.getLogger(__name__)


class Controller(ClientSide):
    # A replica silent this long (reports carry a heartbeat every 0.5 s) is pinged, and dropped
    # if the ping fails, so a replica that died idle stops receiving requests.
    silent_after_s = 5.0
    reconcile_every_s = 2.0  # the replica set is checked against its slots this often

    def __init__(self, config: ControllerConfig, replicas: ReplicaSet | None = None) -> None:
        self.config = config
        self.core = FairnessCore(config)
        self.usage: UsageLedger | None = None  # the cluster's usage log (usage_ledger.py)
        if config.usage is not None:
            self.usage = UsageLedger(config.usage, config.usage_model, config.usage_grace_s)
        self.handles: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()
        self._pushed: dict[str, float] = {}
        self.incarnation = uuid.uuid4().hex  # changes when Ray restarts the actor
        self._init_clients()
        self._last_report: dict[str, float] = {}  # replica id -> monotonic time of last report
        self._watchdog: asyncio.Task | None = None
        self._dead: set[str] = set()  # confirmed dead and fenced: their late reports are ignored
        self.supervisor: Supervisor | None = None  # None: replicas are someone else's business
        self.autoscaler: Autoscaler | None = None
        self._scaler: asyncio.Task | None = None
        self.draining: set[str] = set()  # replicas being drained (scale-down)
        self.num_drained = 0  # drains that ended with nothing left on the replica
        self.num_drains_cut = 0  # drains that stopped the replica with requests on it
        self.last_decision = None  # the autoscaler's last Decision
        if replicas is not None:
            launcher = RayLauncher(replicas)
            self.supervisor = Supervisor(replicas, launcher, self._is_up, self._replica_config)
            if replicas.autoscaling is not None:
                self.autoscaler = Autoscaler(replicas.autoscaling, len(replicas.replicas))

    def _background(self) -> None:
        """Start the watchdog (lazily: an async actor has no running loop in __init__)."""
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_replicas())
        if self.autoscaler is not None and self._scaler is None:
            self._scaler = asyncio.get_running_loop().create_task(self._autoscale_loop())

    async def _watch_replicas(self) -> None:
        last_reconcile = time.monotonic()
        while True:
            await asyncio.sleep(self.silent_after_s / 5)
            self._apply(self.core.expire())  # queue deadlines pass between events too
            self._check_subscribers_due()
            if self.usage is not None:  # requests whose ingress died: recorded here
                self.usage.sweep(self.core.tickets)
            now = time.monotonic()
            for rid, seen in list(self._last_report.items()):
                if now - seen > self.silent_after_s and rid in self.handles:
                    self._last_report[rid] = now  # one ping per silent period
                    self._spawn(self.replica_failed(rid))
            if self.supervisor is not None and now - last_reconcile >= self.reconcile_every_s:
                last_reconcile = now
                try:
                    await self.supervisor.reconcile()
                except Exception as e:  # Ray's GCS busy: next time
                    log.warning("reconciling the replica set failed: %r", e)

    async def replica_failed(self, replica_id: str) -> bool:
        """A client (or the watchdog) saw the replica die. Verified with a ping before it is
        dropped (and fenced: killed, in case it only stalled, so it never serves again next to
        its replacement); then the supervisor, if any, replaces it."""
        self._background()
        handle = self.handles.get(replica_id)
        if handle is None:
            return False
        try:
            await asyncio.wait_for(handle.ping.remote(), timeout=5.0)
            return False  # alive after all (a transient error)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass
        if self.handles.get(replica_id) is not handle:
            return False  # another caller dropped it while we pinged
        self._drop(replica_id, handle)
        if self.supervisor is not None:
            self.supervisor.lost(replica_id)
        return True

    def _drop(self, replica_id: str, handle: Any) -> None:
        """Out of placement for good: its requests are orphaned (their clients resubmit)."""
        self._dead.add(replica_id)
        try:
            ray.kill(handle, no_restart=True)
        except Exception as e:  # already gone
            log.debug("kill %s: %r", replica_id, e)
        self.handles.pop(replica_id, None)
        self._last_report.pop(replica_id, None)
        self._pushed.pop(replica_id, None)
        self._owner_sent = {k for k in self._owner_sent if k[0] != replica_id}
        self.core.remove_replica(replica_id)
        self._apply(self.core.dispatch())

    # ---- the replica set --------------------------------------------------------------------

    async def ensure_replicas(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Create every replica of the set that is not in service (adopting live ones) and
        wait until each has reported, up to `timeout_s`. Returns the replicas' handles."""
        if self.supervisor is None:
            raise RuntimeError("this controller was started without a ReplicaSet")
        self._background()
        if not await self.supervisor.ensure(timeout_s):
            slots = self.supervisor.stats()["slots"]
            missing = {k: v["last_error"] for k, v in slots.items() if not v["replica"]}
            raise TimeoutError(f"replicas not in service after {timeout_s:g}s: {missing}")
        return dict(self.handles)

    async def retire_replica(self, replica_id: str) -> bool:
        """Remove a replica on purpose (scale-down): stopped, and not replaced. Requests it
        held are resubmitted elsewhere by their clients, as after a death."""
        handle = self.handles.get(replica_id)
        if handle is None:
            return False
        if self.supervisor is not None:
            self.supervisor.retire(replica_id)
        self._drop(replica_id, handle)
        return True

    async def shutdown_replicas(self, timeout_s: float = 5.0) -> int:
        """The cluster is going away: stop every replica, replace none. Returns how many were
        in service. The ones in service are killed at once; then, bounded by `timeout_s`, any
        other live actor of the set (one being created, an orphan) found by name."""
        handles = list(self.handles.items())
        if self.supervisor is not None:
            self.supervisor.stopping = True  # nothing is brought up from here on
        for rid, handle in handles:
            self._drop(rid, handle)
        if self.supervisor is not None:
            try:
                await asyncio.wait_for(self.supervisor.stop(), timeout_s)
            except Exception as e:  # GCS slow: what was in service is stopped anyway
                log.warning("stopping the replica set: %r", e)
        return len(handles)

    # ---- autoscaling ------------------------------------------------------------------------

    async def _autoscale_loop(self) -> None:
        assert self.autoscaler is not None
        while True:
            await asyncio.sleep(self.autoscaler.config.interval_s)
            try:
                self._scale()
            except Exception as e:  # never let a bad decision stop the loop
                log.warning("autoscaling failed: %r", e)

    def _scale(self) -> None:
        """One decision: add slots up to the count the policy wants (their replicas get work
        once they report), or retire slots still starting, then drain the replicas with the
        fewest running tokens."""
        sup, scaler = self.supervisor, self.autoscaler
        if sup is None or scaler is None or sup.stopping:
            return
        decision = scaler.observe(measure(self.core, self.draining))
        self.last_decision = decision
        up = [rid for rid in self.handles if self._is_up(rid) and rid not in self.draining]
        starting = sup.starting()
        have = len(up) + len(starting)
        if decision.replicas > have:
            for _ in range(decision.replicas - have):
                log.info("autoscaling: adding %s (%s)", sup.add_slot(), decision)
        elif decision.replicas < have:
            extra = have - decision.replicas
            for sid in starting[-extra:]:
                sup.retire(sid)
            for rid in drain_choice(self.core, up, extra - min(extra, len(starting))):
                log.info("autoscaling: draining %s (%s)", rid, decision)
                self.draining.add(rid)
                self._spawn(self.drain_replica(rid))

    async def drain_replica(self, replica_id: str, timeout_s: float | None = None) -> bool:
        """Scale-down without loss: the replica takes no new work, its running requests
        migrate to other replicas, its waiting ones go back to the queue (`drain_actions`,
        repeated until it holds nothing and has sent every item); then it is stopped, not
        replaced. A drain cut short (the replica died, or `timeout_s` passed) leaves the rest
        to the clients' resubmission, as after a death. True when nothing was left."""
        handle = self.handles.get(replica_id)
        if handle is None:
            self.draining.discard(replica_id)
            return False
        self.draining.add(replica_id)
        if self.supervisor is not None:
            self.supervisor.retire(replica_id)  # not replaced, even if it dies now
        if timeout_s is None:
            scaling = self.autoscaler.config if self.autoscaler is not None else None
            timeout_s = scaling.drain_timeout_s if scaling is not None else 120.0
        deadline = time.monotonic() + timeout_s
        clean = False
        try:
            while self.handles.get(replica_id) is handle and time.monotonic() < deadline:
                actions = drain_actions(self.core, replica_id)
                for a in actions:
                    if isinstance(a, Requeue):
                        self._spawn(self._requeue(handle, a))
                self._apply([a for a in actions if not isinstance(a, Requeue)])
                if drained(self.core, replica_id) and await self._replica_drained(handle):
                    clean = True
                    break
                await asyncio.sleep(0.1)
        finally:
            self.draining.discard(replica_id)
            if self.handles.get(replica_id) is handle:
                self._drop(replica_id, handle)
        if clean:
            self.num_drained += 1
        else:
            self.num_drains_cut += 1
        return clean

    async def _requeue(self, handle: Any, action: Requeue) -> None:
        try:
            await asyncio.wait_for(handle.requeue.remote(action.request_id), timeout=30.0)
        except Exception as e:  # the replica died: its client resubmits anyway
            log.info("requeue %s: %r", action.request_id, e)

    @staticmethod
    async def _replica_drained(handle: Any) -> bool:
        try:
            return bool(await asyncio.wait_for(handle.drained.remote(), timeout=5.0))
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    def _is_up(self, replica_id: str) -> bool:
        r = self.core.replicas.get(replica_id)
        return r is not None and r.synced and replica_id in self.handles

    def _replica_config(self, spec: ReplicaSpec) -> ReplicaConfig:
        """The config a slot's replica starts with (subclasses add run-time changes)."""
        return spec.config

    def _on_registered(self, replica_id: str, handle: Any) -> None:
        """A replica this controller had not heard from reported (a hook for subclasses)."""

    # ---- replicas ---------------------------------------------------------------------------

    @ray.method(max_task_retries=0)  # periodic: a lost report is superseded by the next one
    async def report(self, rep: ReplicaReport) -> dict[str, float] | None:
        """Fold a report in; answers with the cluster-wide counters for the replica's queue."""
        rid = rep.replica_id
        if rid in self._dead:
            return None  # sent before it was fenced
        self._background()
        new = rid not in self.core.replicas
        if new and self.supervisor is not None and not self.supervisor.register(rid):
            if rep.handle is not None:  # retired, shutting down, or a duplicate of its slot
                self._drop(rid, rep.handle)
            return None
        if rep.handle is not None:
            self.handles[rid] = rep.handle
        self._last_report[rid] = time.monotonic()
        if self.usage is not None:
            for request_id, num_out in rep.finished:
                self.usage.left_replica(request_id, rid, num_out)
        self._apply(self.core.report(rep))
        if new and rep.handle is not None:
            self._on_registered(rid, rep.handle)
        counters = self.core.counters()
        if counters == self._pushed.get(rep.replica_id):
            return None
        self._pushed[rep.replica_id] = counters
        return counters

    # ---- actions ----------------------------------------------------------------------------

    def _answer(self, rid: str, assignment: Assignment) -> None:
        """Tell the subscriber that waits for `rid`'s assignment, on its stream."""
        subscriber = self._owner.pop(rid, None)
        if subscriber is not None:
            self._outbox(subscriber).put_nowait(assignment)

    def _apply(self, actions: list) -> None:
        forwards: dict[tuple[str, str], list[RequestMeta]] = {}
        for action in actions:
            if isinstance(action, Assign):
                rid, meta = action.ticket.request_id, action.ticket.meta
                handle = self.handles.get(action.replica_id)
                if handle is not None and meta is not None:
                    forwards.setdefault((action.replica_id, meta.consumer), []).append(meta)
                else:
                    self._answer(rid, Assignment(rid, action.replica_id, handle))
            elif isinstance(action, Expire):  # dropped from the queue: the caller ends it
                rid = action.ticket.request_id
                self._answer(rid, Assignment(rid, "", None, finish_reason=action.finish_reason))
            elif isinstance(action, Refuse):  # over a cluster-wide limit: the caller raises
                rid = action.request_id
                self._answer(rid, Assignment(rid, "", None, refused=action.rejected))
            elif isinstance(action, Preempt):
                handle = self.handles.get(action.replica_id)
                if handle is not None:  # (spawned before the forwards below: it starts first)
                    self._spawn(self._preempt(action, handle))
            elif isinstance(action, Migrate):
                self._spawn(self._migrate(action))
        for (replica_id, consumer), metas in forwards.items():
            # Sent now, awaited in a task that then tells the clients where their requests
            # run: a client never hears of a replica that does not hold its request (were this
            # controller to die between the two, the client still waits for its admission and
            # submits it again to the restarted one). The items do not wait for that answer:
            # the client keeps those of requests it expects until it opens them.
            # The consumer's owner goes along the first time, so the replica watches it even
            # if it dies before opening its channel there.
            owner = None
            if (replica_id, consumer) not in self._owner_sent:
                owner = self._consumer_owner.get(consumer)
                if owner is not None:
                    self._owner_sent.add((replica_id, consumer))
            if trace.ON:
                for meta in metas:
                    trace.mark(meta.request_id, "forwarded")
            handle = self.handles[replica_id]
            self._spawn(self._forward(replica_id, handle, consumer, metas, owner))

    async def _forward(
        self, replica_id: str, handle: Any, consumer: str, metas: list[RequestMeta], owner: Any
    ) -> None:
        """Submit `metas` to their replica for `consumer` (idempotent per request id: a
        restarted controller may place a request again), then answer their clients. A request
        the replica refused ended there with an error item to its client; here it leaves its
        slot."""
        try:
            errors = await handle.submit.remote(consumer, metas, owner)
        except Exception as e:  # the replica died: its clients resubmit (the link breaks)
            log.info("forwarding %d request(s) failed: %r", len(metas), e)
            errors = []
        finally:  # (cancelled with the actor: nothing is left to answer on)
            for meta in metas:
                rid = meta.request_id
                self._answer(rid, Assignment(rid, replica_id, handle))
        refused = [m.request_id for m, error in zip(metas, errors) if error]
        for rid in refused:
            self.core.cancel(rid)
        if refused:
            self._apply(self.core.dispatch())

    async def _preempt(self, action: Preempt, handle: Any) -> None:
        """Preempt on its replica. Spawned before the forwards of the same actions, so it
        starts there before the submission of the request it makes room for (Ray starts one
        caller's calls to an actor in order); preempting a request that is not running,
        preempted already or ended, does nothing."""
        rid = action.request_id
        try:
            await handle.preempt.remote(rid, action.mode, action.seat_for)
        except Exception as e:  # the replica died: its requests are resubmitted elsewhere
            log.info("preempt %s on %s failed: %r", rid, action.replica_id, e)

    async def _migrate(self, action: Migrate) -> bool:
        src, dst = self.handles.get(action.src), self.handles.get(action.dst)
        ok = False
        if src is not None and dst is not None:
            try:
                ok = await asyncio.wait_for(
                    src.migrate_out.remote(
                        action.request_id, action.dst, dst, waiting_only=action.waiting_only
                    ),
                    timeout=30.0,
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("migrating %s failed: %r", action.request_id, e)
        # refused: it stayed (or ended) at the source, whose accounting has it back
        self._apply(self.core.move_done(action, ok))
        return ok

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- introspection ----------------------------------------------------------------------

    async def stats(self) -> dict:
        s = self.core.stats()
        s["replicas"] = sorted(self.handles)
        s["incarnation"] = self.incarnation
        s["subscribers"] = len(self._outboxes)  # assignment streams kept for clients
        s["watched_subscribers"] = len(self._subscriber_owner)
        if self.supervisor is not None:
            s["replica_set"] = self.supervisor.stats()
        if self.autoscaler is not None:
            d = self.last_decision
            s["autoscaling"] = {
                "replicas": self.autoscaler.current,
                "draining": sorted(self.draining),
                "drained": self.num_drained,
                "drains_cut": self.num_drains_cut,
                "last_decision": None if d is None else vars(d),
            }
        return s

    async def replica_handles(self) -> dict[str, Any]:
        return dict(self.handles)

    # ---- usage ------------------------------------------------------------------------------

    async def set_usage(self, spec: UsageSpec | None, model: str) -> None:
        """Keep the cluster's usage log as the attaching ingress's config says (None: none)."""
        self._background()
        if self.usage is not None and self.usage.log.spec == spec:
            self.usage.model = model
            return
        if self.usage is not None:
            self.usage.close()
        self.usage = None
        if spec is not None:
            self.usage = UsageLedger(spec, model, self.config.usage_grace_s)

    async def usage_summary(self, tenant: str | None, since: float, until: float) -> dict:
        """Per-tenant sums over the usage log (`UsageLog.summary`)."""
        if self.usage is None:
            raise ValueError("this cluster keeps no usage log")
        return await asyncio.to_thread(self.usage.summary, tenant, since, until)

    async def ready(self, num_replicas: int) -> bool:
        return sum(1 for r in self.core.replicas.values() if r.synced) >= num_replicas


def controller_actor():
    """`Controller` as a Ray actor class: restarted forever; calls retried across restarts."""
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=10000)(
        Controller
    )
