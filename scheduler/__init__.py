"""Continuous-batching scheduler over the prefix cache. Imported as `radixkv.scheduler`."""

from radixkv.scheduler.config import SchedulerConfig
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput
from radixkv.scheduler.request import Request, RequestStatus
from radixkv.scheduler.scheduler import Scheduler

__all__ = [
    "BlockCopy",
    "GroupPlan",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
