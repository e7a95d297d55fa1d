"""The iteration-level scheduler (pure Python: no torch, no ray)."""

from fairbatch.scheduler.config import SchedulerConfig
from fairbatch.scheduler.output import RequestUpdate, RunnerOutput, SchedulerOutput, StepUpdates
from fairbatch.scheduler.request import FINISH_REASONS, Request, RequestStatus
from fairbatch.scheduler.scheduler import Scheduler

__all__ = [
    "FINISH_REASONS",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "RunnerOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepUpdates",
]
