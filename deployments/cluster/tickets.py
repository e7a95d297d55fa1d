"""What the fairness controller's logic is made of: its config, the ticket it keeps per request,
and the actions it answers events with (`Assign`, `Preempt`, `Migrate`) for its caller to
carry out. Plain Python, no Ray (`fairness.py` re-exports all of it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from fairbatch.deployments.cluster.limits import LimitsSpec
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.deployments.usage import UsageSpec
from fairbatch.policies import TenantSpec
from fairbatch.policies.quota import Rejected

ROUTINGS = ("fair", "d2lpm", "round_robin", "power_of_two", "prefix_affinity")
QUEUED_ROUTINGS = ("fair", "d2lpm")  # one global queue; the others route at once
# ControllerConfig fields an app sets on a running cluster (`set_limits`, `set_usage`): not
# part of the cluster's identity, not `controller:` settings of the app config
APP_SETTINGS = ("limits", "usage", "usage_model")


@dataclass
class ControllerConfig:
    routing: str = "fair"
    policy: str = "priority"  # global order in "fair" mode (priority: weighted fair inside)
    policy_kwargs: dict = field(default_factory=dict)
    tenants: list[TenantSpec] = field(default_factory=list)
    local_queue: int = 2  # requests a replica may hold beyond its running seats ("fair")
    preemption: bool = True  # coordinated preemption for higher-priority waiting requests
    # ... and for a waiting request whose tenant's requests all fit in its share of the seats
    # while another tenant holds more (preemption.py): fairness decides who holds seats too
    fair_preemption: bool = True
    preempt_mode: str = "auto"  # "auto" | "swap" | "recompute"
    migrate_displaced: bool = True  # move a preempted request to a replica with room
    # A seat frees on one replica while another holds requests waiting in its local queue,
    # and the global queue is empty: move one of those there (placement.py, `steals`).
    rebalance_local_queues: bool = True
    input_weight: float = 1.0
    output_weight: float = 2.0
    stale_assignment_s: float = 30.0  # assigned but never seen by its replica: dropped after
    # "d2lpm" routing (placement.py): a tenant's in-flight locality work per replica is at most
    # d2lpm_quantum x its weight (weighted tokens); a match counts from d2lpm_min_match of the
    # prompt's blocks; a replica is a locality choice while its load <= least load + slack.
    d2lpm_quantum: float = 8192.0
    d2lpm_min_match: float = 0.5
    d2lpm_load_slack: int = 2
    # tenants' quotas and in-flight bounds over every ingress (limits.py); None: none here
    limits: LimitsSpec | None = None
    # The usage log this controller keeps (usage_ledger.py; None: none), the base model's id
    # for the records it writes itself, and how long it waits for an ingress's record first.
    # Like `limits`, set by each attaching ingress and not part of the cluster's identity.
    usage: UsageSpec | None = None
    usage_model: str = ""
    usage_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.local_queue < 0:
            raise ValueError(f"local_queue must be >= 0, got {self.local_queue}")
        if not self.d2lpm_quantum > 0 or not 0 < self.d2lpm_min_match <= 1:
            raise ValueError(
                "d2lpm_quantum must be > 0 and d2lpm_min_match in (0, 1], got "
                f"{self.d2lpm_quantum!r}, {self.d2lpm_min_match!r}"
            )
        if not self.usage_grace_s > 0:
            raise ValueError(f"usage_grace_s must be > 0, got {self.usage_grace_s!r}")
        if self.d2lpm_load_slack < 0:
            raise ValueError(f"d2lpm_load_slack must be >= 0, got {self.d2lpm_load_slack}")


class Ticket:
    """A request as the controller's queues see it (duck-types what policies read)."""

    __slots__ = (
        "request_id",
        "tenant",
        "priority",
        "seq",
        "arrival_time",
        "meta",
        "replica",
        "assigned_at",
        "seen",
        "running",
        "preempted",
        "max_tokens",
        "locality",
        "deadline",
        "queue_deadline",
        "counted",
        "charged_out",
    )

    def __init__(self, meta: RequestMeta | None, request_id: str, tenant: str, priority: int):
        self.request_id = request_id
        self.tenant = tenant
        self.priority = priority
        self.seq = 0
        self.arrival_time = time.monotonic()
        self.meta = meta
        self.replica: str | None = None
        self.assigned_at = 0.0
        self.seen = False  # its replica reported holding it
        self.running = False  # holding GPU blocks, as of the last report
        self.preempted = False  # displaced by coordinated preemption, not yet running again
        self.max_tokens = 0 if meta is None else meta.params.max_tokens  # decode tokens prepaid
        self.locality = 0.0  # d2lpm: weighted tokens charged to its replica's tenant deficit
        # in the controller's clock (inf: none): a queued ticket leaves at the earlier one
        self.deadline = math.inf
        self.queue_deadline = math.inf
        self.counted = False  # in its tenant's cluster-wide in-flight count (limits.py)
        self.charged_out = 0  # output tokens charged to its tenant's quota (limits.py)


@dataclass
class Expire:
    """A queued ticket's deadline passed: it leaves with `finish_reason`, never assigned."""

    ticket: Ticket
    finish_reason: str = "timeout"


@dataclass
class Refuse:
    """Over a tenant's cluster-wide limit (limits.py): answered at once, never queued."""

    request_id: str
    rejected: Rejected


@dataclass
class Assign:
    ticket: Ticket
    replica_id: str


@dataclass
class Preempt:
    replica_id: str
    request_id: str
    mode: str
    seat_for: str | None = None  # the request its seat is kept for (assigned there with it)


@dataclass
class Migrate:
    request_id: str
    src: str
    dst: str
    # only if it still waits at src (a local-queue rebalance): one that started stays there
    waiting_only: bool = False
