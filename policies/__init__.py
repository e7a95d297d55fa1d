"""Who goes next and who gives way: fcfs, round robin, weighted fair (VTC), priority, prefix
locality (lpm, and dlpm: deficit longest prefix match); quotas.

Pure Python: nothing here imports torch, ray, or other fairbatch packages at run time.
"""

from .base import Policy
from .dlpm import DlpmPolicy, LpmPolicy
from .fcfs import FcfsPolicy
from .priority import PriorityPolicy
from .registry import POLICIES, make_policy
from .round_robin import RoundRobinPolicy
from .tenants import TenantSpec
from .weighted_fair import WeightedFairPolicy

__all__ = [
    "POLICIES",
    "DlpmPolicy",
    "FcfsPolicy",
    "LpmPolicy",
    "Policy",
    "PriorityPolicy",
    "RoundRobinPolicy",
    "TenantSpec",
    "WeightedFairPolicy",
    "make_policy",
]
