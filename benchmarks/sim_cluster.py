"""One simulated cluster for the cluster, locality and autoscale benchmarks.

Runs in one process, without Ray: replicas are EngineCores on the simulated runner (virtual
time, unpaced), and the controller is the very `FairnessCore` the Ray actor wraps. Ray itself
would only add per-message transport, which is not what these measure and which two cores could
not carry for 64 replicas. The discrete-event loop always advances the replica that is furthest
behind in virtual time (`next_replica`, then `due_report` and `step`); replicas report every
`report_interval_s` of virtual time, as the actor does in real time. `apply` carries out the
controller's actions as the replica actors do.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from fairbatch.deployments.cluster.autoscaling import Requeue
from fairbatch.deployments.cluster.fairness import Assign, FairnessCore, Migrate, Preempt
from fairbatch.deployments.cluster.wire import ReplicaReport, RequestMeta
from fairbatch.engine import gpu_profiles
from fairbatch.engine.core import EngineCore, MigratedRequest
from fairbatch.engine.sim_runner import SimRunner
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import make_policy
from fairbatch.scheduler import Scheduler, SchedulerConfig


@dataclass
class Workload:
    """A run's tenants and load, and its replicas' settings (the defaults: cluster_bench.py's)."""

    tenants: tuple[tuple[str, float, int, int], ...] = (  # name, weight, prompt, max_tokens
        ("t1", 1.0, 64, 64),
        ("t2", 2.0, 64, 64),
        ("t3", 3.0, 64, 64),
        ("t4", 4.0, 64, 64),
        ("long", 1.0, 64, 256),
    )
    # each tenant alone keeps this x the cluster's slots (seats + local queues) in flight, so
    # every tenant stays backlogged whatever its weight
    outstanding_per_slot: float = 1.25
    duration_s: float = 12.0  # virtual seconds simulated
    # service is measured after this: longer than the longest request (~2.6 s), so work
    # admitted in the start-up burst (before any queue formed) is not counted
    warmup_s: float = 3.0
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048  # a step's token budget (prefill chunks and decodes)
    num_gpu_blocks: int = 2048
    block_size: int = 16
    report_interval_s: float = 0.02
    seed: int = 0


class SimReplica:
    """One replica: Llama-3-8B on an H100 (roofline step times), its own scheduler and policy."""

    def __init__(self, replica_id: str, wl: Workload, policy: str, specs) -> None:
        shape = gpu_profiles.llama3_8b()
        self.replica_id = replica_id
        self.runner = SimRunner(shape, "H100", vocab_size=32000, block_size=wl.block_size)
        cfg = SchedulerConfig(
            max_num_seqs=wl.max_num_seqs,
            max_num_batched_tokens=wl.max_num_batched_tokens,
            kv_bytes_per_token=shape.kv_bytes_per_token,
        )
        kv = KVCacheManager(wl.num_gpu_blocks, wl.block_size, 512)
        self.core = EngineCore(Scheduler(cfg, kv, make_policy(policy, specs)), self.runner)
        self.finished: list[tuple[str, int]] = []  # (request id, output tokens) since the report
        self.seq = 0
        self.next_report = 0.0

    def assign(self, t, now: float) -> None:
        """Start the controller's assigned ticket `t` here at virtual time `now`, as a replica
        actor does with a submitted request."""
        meta = t.meta
        self.core.add_request(
            meta.prompt_ids,
            meta.params,
            request_id=t.request_id,
            tenant=t.tenant,
            priority=t.priority,
            cache_salt=meta.cache_salt,
        )
        self.runner.idle_until(now)

    def report(self) -> ReplicaReport:
        s = self.core.scheduler
        self.seq += 1
        running = {r.request_id for r in s.running}
        rep = ReplicaReport(
            replica_id=self.replica_id,
            seq=self.seq,
            max_num_seqs=s.config.max_num_seqs,
            free_blocks=s.kv.num_free_blocks,
            total_blocks=s.kv.gpu_pool.num_blocks,
            block_size=s.kv.block_size,
            num_waiting=s.num_waiting,
            num_running=len(s.running),
            num_swapped=len(s.swapped),
            num_steps=self.runner.num_steps,
            service=self.core.scheduler.policy.tokens(),
            finished=self.finished,
            active={
                rid: (r.tenant, r.priority, rid in running, r.max_tokens, r.num_output_tokens)
                for rid, r in s.requests.items()
            },
        )
        self.finished = []
        return rep


class SimCluster:
    """Simulated replicas under one controller, in virtual time (`now`)."""

    def __init__(self, core: FairnessCore, wl: Workload) -> None:
        self.core = core
        self.wl = wl
        self.report_interval_s = wl.report_interval_s
        self.replicas: dict[str, SimReplica] = {}
        self.now = 0.0
        self.migrations = 0  # requests moved between replicas
        self.preempted: dict[str, int] = {}  # tenant -> its requests the controller preempted
        self.requeues = 0  # requests a draining replica gave back to the controller's queue
        self._requeued: dict[str, MigratedRequest] = {}  # request id -> itself, until assigned
        self._heap: list[tuple[float, object, str]] = []  # (virtual time, tie-break, replica)
        self._keys: dict[str, object] = {}

    def add(self, replica_id: str, policy: str, specs, at: float = 0.0, key=None) -> SimReplica:
        """A replica that takes work (and first reports) at virtual time `at`. Replicas at the
        same virtual time go by `key` (default: the order they were added)."""
        r = self.replicas[replica_id] = SimReplica(replica_id, self.wl, policy, specs)
        r.runner.idle_until(at)
        r.next_report = at
        self._keys[replica_id] = len(self._keys) if key is None else key
        heapq.heappush(self._heap, (at, self._keys[replica_id], replica_id))
        return r

    def remove(self, replica_id: str) -> None:
        del self.replicas[replica_id]

    def next_time(self) -> float:
        """The virtual time of the replica furthest behind (inf with none)."""
        return self._heap[0][0] if self._heap else math.inf

    def next_replica(self) -> SimReplica | None:
        """The replica furthest behind in virtual time, `now` set to its time; None if none is
        left. It is out of the loop until `step` puts it back."""
        while self._heap:
            clock, _, rid = heapq.heappop(self._heap)
            r = self.replicas.get(rid)
            if r is not None:  # else removed
                self.now = clock
                return r
        return None

    def due_report(self, r: SimReplica) -> ReplicaReport | None:
        """`r`'s report if one is due now."""
        if self.now < r.next_report:
            return None
        r.next_report = self.now + self.report_interval_s
        return r.report()

    def step(self, r: SimReplica) -> list:
        """One engine step of `r` (its deltas), or a report interval idle; `r` goes back into
        the loop at its new virtual time."""
        if r.core.has_unfinished():
            deltas = r.core.step()
            at = max(r.runner.clock, self.now + 1e-6)
        else:
            deltas = []
            r.runner.idle_until(self.now + self.report_interval_s)
            at = r.runner.clock
        heapq.heappush(self._heap, (at, self._keys[r.replica_id], r.replica_id))
        return deltas

    def apply(self, actions: list) -> list:
        """Carry out the controller's actions at `now`; returns the tickets assigned (those of
        the actions that carrying them out led to included)."""
        assigned = []
        for a in actions:
            if isinstance(a, Assign):
                rep = self.replicas[a.replica_id]
                held = self._requeued.pop(a.ticket.request_id, None)
                if held is not None:
                    rep.core.import_request(held)
                    rep.runner.idle_until(self.now)
                else:
                    rep.assign(a.ticket, self.now)
                assigned.append(a.ticket)
            elif isinstance(a, Preempt):
                self.replicas[a.replica_id].core.preempt(a.request_id, a.mode, a.seat_for)
                tenant = self.core.tickets[a.request_id].tenant
                self.preempted[tenant] = self.preempted.get(tenant, 0) + 1
            elif isinstance(a, Migrate):  # as Replica.migrate_out: swap out if it can, export
                src, dst = self.replicas[a.src], self.replicas[a.dst]
                req = src.core.scheduler.requests.get(a.request_id)
                if req is None or (a.waiting_only and req.status.name != "WAITING"):
                    assigned += self.apply(self.core.move_done(a, ok=False))  # it stays
                    continue
                if req.status.name == "RUNNING":
                    swap = src.core.scheduler.kv.can_swap_out(req)
                    src.core.preempt(a.request_id, "swap" if swap else "recompute")
                dst.core.import_request(src.core.export_request(a.request_id))
                dst.runner.idle_until(self.now)
                self.migrations += 1
                assigned += self.apply(self.core.move_done(a, ok=True))
            elif isinstance(a, Requeue):  # the client resubmits it with its tokens
                src = self.replicas[a.replica_id]
                req = src.core.scheduler.requests.get(a.request_id)
                if req is None:
                    continue
                if req.status.name == "RUNNING":  # started since the report: stops here
                    src.core.preempt(a.request_id, "recompute")
                moved = src.core.export_request(a.request_id)
                src.finished.append((a.request_id, moved.request.num_output_tokens))
                self._requeued[a.request_id] = moved
                meta = RequestMeta(
                    a.request_id, moved.request.prompt_token_ids, req.sampling_params
                )
                meta.tenant, meta.attempt = moved.request.tenant, 1
                self.requeues += 1
                assigned += self.apply(self.core.submit(meta))
        return assigned


def service(replicas: Mapping[str, SimReplica]) -> dict[str, float]:
    """Weighted service per tenant, summed over the replicas."""
    total: dict[str, float] = {}
    for r in replicas.values():
        for t, v in r.core.scheduler.policy.service().items():
            total[t] = total.get(t, 0.0) + v
    return total


class ServiceWindow:
    """Service / weight per tenant after a warm-up: the largest difference between two tenants
    at any sample (`max_diff`), and what each got over the whole window (`result`)."""

    def __init__(self, weights: Mapping[str, float], warmup_s: float) -> None:
        self.weights = weights
        self.warmup_s = warmup_s
        self.start: dict[str, float] | None = None
        self.max_diff = 0.0

    def sample(self, now: float, replicas: Mapping[str, SimReplica]) -> bool:
        """Sample at virtual time `now`; True for the sample that opens the window."""
        if now < self.warmup_s:
            return False
        svc = service(replicas)
        opened = self.start is None
        if self.start is None:
            self.start = svc
        norm = [(svc.get(n, 0) - self.start.get(n, 0)) / w for n, w in self.weights.items()]
        self.max_diff = max(self.max_diff, max(norm) - min(norm))
        return opened

    def result(self, replicas: Mapping[str, SimReplica]) -> tuple[list[float], float]:
        """Service / weight of each tenant (in `weights` order) from the window's start on, and
        Jain's index over those (1 when all are equal, 1/n when one tenant got everything)."""
        svc, base = service(replicas), self.start or {}
        xs = [max(0.0, svc.get(n, 0) - base.get(n, 0)) / w for n, w in self.weights.items()]
        return xs, sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def vtc_bound(max_prompt: int, max_len: int, seats: int) -> float:
    """VTC's bound on |service_i/w_i - service_j/w_j| between backlogged tenants, the cluster as
    one server: 2 * max(input_weight * max prompt, output_weight * M), M = the tokens the
    running batches can hold (Sheng et al., OSDI'24, Thm 4.3)."""
    return 2 * max(1.0 * max_prompt, 2.0 * seats * max_len)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]
