"""AGQ from Python: a typed client and a worker SDK for the AGQ job queue.

- :class:`Client`: every client-facing RPC of the plan, action, job,
  worker, schedule and queue services as a method (the worker's own RPCs:
  register, heartbeat, lease, report, are :class:`Worker`'s), with
  deadlines, bearer tokens, TLS, retries on UNAVAILABLE and an iterator
  over ``WatchAction``.
- :class:`Worker`: runs jobs as Python functions (register, heartbeat,
  lease, report, cancel, drain on SIGTERM).
- :mod:`agq.types`: the values they take and return (enums, dataclasses).
- :mod:`agq.v1`: the generated protobuf messages and gRPC stubs, typed.
"""

__version__ = "0.1.0"

from agq._rpc import AgqError, RetryPolicy, tls_credentials  # noqa: E402
from agq.client import Client  # noqa: E402
from agq.types import (  # noqa: E402
    ActionPage,
    ActionState,
    ActionStatus,
    CancelledAction,
    Job,
    JobStatus,
    Page,
    Plan,
    PlanVersion,
    PlanVersionPage,
    QueueStats,
    RetriedAction,
    Schedule,
    SubmittedAction,
    Task,
    TaskResult,
    Verification,
    WorkerInfo,
    WorkerState,
    WorkerStats,
)
from agq.worker import (  # noqa: E402
    JobCancelled,
    PermanentFailure,
    TaskContext,
    TaskFunction,
    Worker,
    WorkerError,
    WorkerExit,
)

__all__ = [
    "ActionPage",
    "ActionState",
    "ActionStatus",
    "AgqError",
    "CancelledAction",
    "Client",
    "Job",
    "JobCancelled",
    "PermanentFailure",
    "JobStatus",
    "Page",
    "Plan",
    "PlanVersion",
    "PlanVersionPage",
    "QueueStats",
    "RetriedAction",
    "RetryPolicy",
    "Schedule",
    "SubmittedAction",
    "Task",
    "TaskContext",
    "TaskFunction",
    "TaskResult",
    "Verification",
    "Worker",
    "WorkerError",
    "WorkerExit",
    "WorkerInfo",
    "WorkerState",
    "WorkerStats",
    "tls_credentials",
    "__version__",
]
