"""How many replicas the cluster should have, and how one leaves without losing a request.

Plain Python, no Ray: the controller actor (`controller.py`) and the cluster benchmark drive it.

The policy (`Autoscaler.observe`, one call per decision interval) reads the cluster's measured
state (`ClusterLoad`, built by `measure` from the controller's `FairnessCore`):

  * work: the tokens of every request not yet ended (prompt + `max_tokens`, queued at the
    controller or held by a replica), the demand; and its per-replica target
    `target_queued_tokens_per_replica`;
  * KV usage: used / total blocks over the replicas in service, against `target_kv_usage`;
  * step throughput: the tokens the replicas served per second (reported, not a target: it
    shows whether added replicas add service).

Both signals are smoothed (an exponential average with time constant `smoothing_s`), and each
gives a replica count: ceil(work / target) and ceil(replicas x usage / target). The larger one,
clamped to [min_replicas, max_replicas], is what the cluster wants. Hysteresis, two ways:

  * in time: the count goes up only once the wish to grow held for `upscale_delay_s`, and down
    only once the wish to shrink held for `downscale_delay_s` (longer: a drain costs
    migrations, an upscale only a start-up);
  * in level: shrinking counts work against (1 - tolerance) x the target, so a load right at a
    boundary does not flip the count back and forth.

Draining (`drain_actions`, repeated by the caller until the replica holds nothing): the replica
takes no new work (out of placement); each request its last report showed running migrates to
the least loaded other replica (`Migrate`: swap through the object store or recompute, as
preemption's migration does); each one waiting goes back to the controller's queue (`Requeue`:
the replica ends its stream with a `Moved` without destination, and the client resubmits it
with the tokens already delivered, not charged again), where it waits its fair turn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fairbatch.deployments.cluster.fairness import FairnessCore, Migrate, Ticket


@dataclass
class AutoscalingConfig:
    min_replicas: int = 1
    max_replicas: int = 8
    target_queued_tokens_per_replica: float = 8192.0  # outstanding tokens per replica
    target_kv_usage: float = 0.8  # used / total KV blocks per replica
    upscale_delay_s: float = 5.0  # the wish to grow must hold this long
    downscale_delay_s: float = 60.0  # the wish to shrink must hold this long
    smoothing_s: float = 2.0  # time constant of the signals' exponential average
    tolerance: float = 0.2  # shrinking counts work against (1 - tolerance) x the target
    interval_s: float = 1.0  # one decision this often (controller)
    drain_timeout_s: float = 120.0  # a drain not done by then retires the replica anyway

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                "need 1 <= min_replicas <= max_replicas, got "
                f"{self.min_replicas}, {self.max_replicas}"
            )
        if not self.target_queued_tokens_per_replica > 0:
            raise ValueError("target_queued_tokens_per_replica must be > 0")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {self.target_kv_usage}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        for name in ("upscale_delay_s", "downscale_delay_s", "smoothing_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.interval_s > 0 or not self.drain_timeout_s > 0:
            raise ValueError("interval_s and drain_timeout_s must be > 0")


@dataclass
class ClusterLoad:
    """The cluster's state at one decision."""

    work_tokens: float  # prompt + max_tokens of every request queued or held
    used_blocks: int  # over the replicas in service
    total_blocks: int
    served_tokens: int  # cumulative tokens served (throughput is its rate)


@dataclass
class Decision:
    replicas: int  # what the cluster should have now
    wanted: int  # what the smoothed signals ask for (before the delays)
    work_tokens: float  # smoothed
    kv_usage: float  # smoothed
    tokens_per_s: float  # smoothed step throughput


class Autoscaler:
    def __init__(
        self, config: AutoscalingConfig, current: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.current = min(max(current, config.min_replicas), config.max_replicas)
        self._work: float | None = None
        self._usage = 0.0
        self._rate = 0.0
        self._last: tuple[float, int] | None = None  # (time, served tokens) of the last call
        self._wish_since: float | None = None  # when the current wish (up or down) began
        self._wish_up = False

    def observe(self, load: ClusterLoad) -> Decision:
        cfg = self.config
        now = self.clock()
        usage = load.used_blocks / load.total_blocks if load.total_blocks else 0.0
        if self._last is None:
            self._work, self._usage = load.work_tokens, usage
        else:
            dt = max(0.0, now - self._last[0])
            a = 1.0 - math.exp(-dt / cfg.smoothing_s) if cfg.smoothing_s > 0 else 1.0
            self._work += a * (load.work_tokens - self._work)
            self._usage += a * (usage - self._usage)
            if dt > 0:
                self._rate += a * ((load.served_tokens - self._last[1]) / dt - self._rate)
        self._last = (now, load.served_tokens)
        up = self._count(cfg.target_queued_tokens_per_replica)
        down = self._count(cfg.target_queued_tokens_per_replica * (1.0 - cfg.tolerance))
        if up > self.current:
            self._hold(True, now, cfg.upscale_delay_s, up)
            wanted = up
        elif down < self.current:
            self._hold(False, now, cfg.downscale_delay_s, down)
            wanted = down
        else:
            self._wish_since = None
            wanted = self.current
        return Decision(self.current, wanted, self._work, self._usage, self._rate)

    def _count(self, target: float) -> int:
        cfg = self.config
        by_work = math.ceil(self._work / target - 1e-9)
        by_kv = math.ceil(self.current * self._usage / cfg.target_kv_usage - 1e-9)
        return min(max(by_work, by_kv, cfg.min_replicas), cfg.max_replicas)

    def _hold(self, up: bool, now: float, delay: float, count: int) -> None:
        """Move to `count` once this direction's wish has held for `delay`."""
        if self._wish_since is None or self._wish_up != up:
            self._wish_since, self._wish_up = now, up
        if now - self._wish_since >= delay:
            self.current = count
            self._wish_since = None


# ---- measuring and draining a FairnessCore ---------------------------------------------------


def ticket_tokens(t: Ticket) -> int:
    prompt = 0 if t.meta is None else t.meta.num_prompt_tokens
    return prompt + t.max_tokens


def measure(core: FairnessCore, draining: set[str] = frozenset()) -> ClusterLoad:
    """The core's state: O(requests + replicas), once per decision interval."""
    work = sum(ticket_tokens(t) for t in core.tickets.values())
    used = total = served = 0
    for r in core.replicas.values():
        served += sum(p + d for p, d in r.service.values())
        if r.replica_id not in draining:
            used += r.total_blocks - r.free_blocks
            total += r.total_blocks
    return ClusterLoad(work, used, total, served)


def running_tokens(core: FairnessCore, replica_id: str) -> int:
    r = core.replicas.get(replica_id)
    return 0 if r is None else sum(ticket_tokens(t) for t in r.assigned.values() if t.running)


def drain_choice(core: FairnessCore, candidates: list[str], n: int) -> list[str]:
    """The `n` replicas to drain: the fewest running tokens (the least to move)."""
    key = {rid: (running_tokens(core, rid), len(core.replicas[rid].assigned)) for rid in candidates}
    return sorted(candidates, key=lambda rid: (key[rid], rid))[:n]


@dataclass
class Requeue:
    """A waiting request leaves a draining replica for the controller's queue."""

    request_id: str
    replica_id: str


def drain_actions(core: FairnessCore, replica_id: str) -> list:
    """One round of draining `replica_id`: out of placement (idempotent), then a `Migrate` for
    each request its last report showed running and a `Requeue` for each one waiting. Requests
    it has not reported yet are left for a later round. The core's accounting moves at once: a
    requeued ticket is forgotten without a refund (its resubmission is not charged again)."""
    r = core.replicas.get(replica_id)
    if r is None:
        return []
    if r.alive:
        r.alive = False  # no new work: has_room() is False and the load heap skips it
        core.placement.touch(r)
    actions: list = []
    for rid, t in list(r.assigned.items()):
        if not t.seen:
            continue
        if t.running:
            dst = core.placement.least_loaded_except(replica_id)
            move = core.migrate(rid, dst.replica_id) if dst is not None else None
            if isinstance(move, Migrate):
                actions.append(move)
        else:
            core._forget(t)  # out of the replica's accounting and the ticket table
            actions.append(Requeue(rid, replica_id))
    return actions


def drained(core: FairnessCore, replica_id: str) -> bool:
    r = core.replicas.get(replica_id)
    return r is None or not r.assigned
