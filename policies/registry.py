"""Policies by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .base import Policy
from .dlpm import DlpmPolicy, LpmPolicy
from .fcfs import FcfsPolicy
from .priority import PriorityPolicy
from .round_robin import RoundRobinPolicy
from .tenants import TenantSpec
from .weighted_fair import WeightedFairPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FcfsPolicy,
        RoundRobinPolicy,
        WeightedFairPolicy,
        PriorityPolicy,
        LpmPolicy,
        DlpmPolicy,
    )
}


def make_policy(name: str, tenants: Iterable[TenantSpec] = (), **kw: Any) -> Policy:
    """Build the policy registered as `name`; `kw` go to its constructor (unknown ones raise
    TypeError). An unknown name raises ValueError listing the valid ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    return cls(tenants, **kw)
