"""Plain Python values of the agq.v1 API: enums and frozen dataclasses.

The client converts the protobuf messages of :mod:`agq.v1` into these
types: enums are :class:`enum.IntEnum` members, timestamps are timezone-aware
:class:`datetime.datetime` values in UTC (``None`` where the message leaves
them unset), repeated fields are tuples and maps are dicts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from google.protobuf import message, timestamp_pb2

from agq.v1 import common_pb2, plan_service_pb2, queue_service_pb2, schedule_service_pb2


class JobStatus(enum.IntEnum):
    """Lifecycle state of a job (``agq.v1.JobStatus``)."""

    #: Not set; as a filter it means "any status".
    UNSPECIFIED = 0
    #: Waiting to be leased (ready now, scheduled for later, or backing off).
    PENDING = 1
    #: Leased to a worker that is running it.
    RUNNING = 2
    #: Finished successfully. Terminal.
    COMPLETED = 3
    #: The last attempt failed; it is re-queued while attempts remain.
    FAILED = 4
    #: Every attempt failed (dead letter). Terminal until a retry.
    DEAD = 5
    #: Cancelled by a client. Terminal.
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        """True for COMPLETED, DEAD and CANCELLED."""
        return self in (JobStatus.COMPLETED, JobStatus.DEAD, JobStatus.CANCELLED)

    @classmethod
    def of(cls, value: int) -> JobStatus:
        """The member for a wire value; UNSPECIFIED for values this client
        does not know (a newer server)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class WorkerState(enum.IntEnum):
    """Lifecycle state of a worker (``agq.v1.WorkerState``)."""

    #: Not set; as a filter it means "any state".
    UNSPECIFIED = 0
    #: Registered and eligible for new leases while fresh.
    ACTIVE = 1
    #: Finishing its leases; gets no new ones.
    DRAINING = 2
    #: Missed heartbeats for 3 x the heartbeat interval; its leases were re-queued.
    DEAD = 3
    #: Left cleanly through UnregisterWorker.
    UNREGISTERED = 4
    #: Flagged for investigation after too many job timeouts; no new leases
    #: until :meth:`agq.Client.release_worker`.
    QUARANTINED = 5

    @classmethod
    def of(cls, value: int) -> WorkerState:
        """The member for a wire value; UNSPECIFIED for unknown values."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class ActionState(enum.IntEnum):
    """Which actions :meth:`agq.Client.list_actions` returns, by the
    statuses of their jobs (``agq.v1.ActionState``)."""

    #: Every action.
    UNSPECIFIED = 0
    #: Some job is pending, running or failed (waiting for its next attempt).
    OPEN = 1
    #: Every job is completed, dead or cancelled.
    FINISHED = 2
    #: At least one job is dead.
    HAS_DEAD = 3

    @classmethod
    def of(cls, value: int) -> ActionState:
        """The member for a wire value; UNSPECIFIED for unknown values."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


def timestamp(ts: timestamp_pb2.Timestamp) -> datetime:
    """A protobuf Timestamp as an aware UTC datetime."""
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=timezone.utc)


def optional_timestamp(msg: message.Message, name: str) -> datetime | None:
    """The Timestamp field ``name`` of ``msg`` as a datetime; None when unset."""
    if not msg.HasField(name):
        return None
    value = getattr(msg, name)
    assert isinstance(value, timestamp_pb2.Timestamp)
    return timestamp(value)


def to_timestamp(when: datetime) -> timestamp_pb2.Timestamp:
    """An aware datetime as a protobuf Timestamp.

    Raises ValueError for a naive datetime (its time zone would be a guess).
    """
    if when.tzinfo is None:
        raise ValueError("datetime must be timezone-aware (e.g. datetime.now(timezone.utc))")
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(when.astimezone(timezone.utc))
    return ts


@dataclass(frozen=True)
class Task:
    """One step of a plan.

    For the Unix-tool worker ``agw``, ``command`` is a bare executable name;
    for a Python :class:`agq.Worker` it names a registered Python function.
    ``args`` may contain ``{{name}}`` placeholders filled from the job input.
    ``timeout_secs`` is the task's wall-clock limit in seconds (1..=86400).
    ``input_from_task``: the 1-based number of an earlier task whose output
    is this task's input (stdin); ``None`` for none. ``args`` is stored as
    a tuple.
    """

    command: str
    args: Sequence[str] = ()
    timeout_secs: int = 60
    input_from_task: int | None = None
    allow_option_values: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.args, (str, bytes)):
            raise TypeError(f"args is a sequence of strings, got the string {self.args!r}")
        object.__setattr__(self, "args", tuple(self.args))

    def to_pb(self, task_number: int) -> common_pb2.Task:
        """The protobuf message, numbered ``task_number`` (1-based)."""
        t = common_pb2.Task(
            task_number=task_number,
            command=self.command,
            args=list(self.args),
            timeout_secs=self.timeout_secs,
            allow_option_values=self.allow_option_values,
        )
        if self.input_from_task is not None:
            t.input_from_task = self.input_from_task
        return t

    @classmethod
    def from_pb(cls, t: common_pb2.Task) -> Task:
        """The task of a protobuf message."""
        return cls(
            command=t.command,
            args=tuple(t.args),
            timeout_secs=t.timeout_secs,
            input_from_task=t.input_from_task if t.HasField("input_from_task") else None,
            allow_option_values=t.allow_option_values,
        )


@dataclass(frozen=True)
class Plan:
    """A reusable pipeline: tasks run in order, numbered 1..=n by position
    (``tasks`` is stored as a tuple, so plans compare by value)."""

    plan_id: str
    tasks: Sequence[Task]
    description: str = ""
    require_sandbox: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))

    def to_pb(self) -> common_pb2.Plan:
        """The protobuf message."""
        return common_pb2.Plan(
            plan_id=self.plan_id,
            plan_description=self.description,
            tasks=[t.to_pb(i + 1) for i, t in enumerate(self.tasks)],
            require_sandbox=self.require_sandbox,
        )

    @classmethod
    def from_pb(cls, p: common_pb2.Plan) -> Plan:
        """The plan of a protobuf message."""
        return cls(
            plan_id=p.plan_id,
            tasks=tuple(Task.from_pb(t) for t in p.tasks),
            description=p.plan_description,
            require_sandbox=p.require_sandbox,
        )


@dataclass(frozen=True)
class PlanVersion:
    """One stored version of a plan, as :meth:`agq.Client.list_plan_versions`
    lists it; ``get_plan(plan_id, version=...)`` fetches it whole."""

    #: The version (1 is the first).
    version: int
    #: The version's description.
    description: str
    #: Number of tasks of the version.
    task_count: int
    #: When the version was stored.
    created_at: datetime | None

    @classmethod
    def from_pb(cls, v: plan_service_pb2.PlanVersion) -> PlanVersion:
        """The version of a protobuf message."""
        return cls(
            version=v.version,
            description=v.plan_description,
            task_count=v.task_count,
            created_at=optional_timestamp(v, "created_at"),
        )


@dataclass(frozen=True)
class PlanVersionPage:
    """One page of :meth:`agq.Client.list_plan_versions`: versions newest
    first and the token of the next page ("" on the last page)."""

    versions: tuple[PlanVersion, ...]
    next_page_token: str = ""


@dataclass(frozen=True)
class ActionStatus:
    """Aggregate progress of an action: job counts per status."""

    action_id: str
    plan_id: str
    total_jobs: int
    pending: int
    running: int
    completed: int
    failed: int
    dead: int
    cancelled: int
    created_at: datetime | None
    #: When the last job reached a terminal state; None while any job is not terminal.
    completed_jobs_at: datetime | None
    #: Priority of its jobs (higher leases first).
    priority: int = 0
    #: Worker selector in effect; empty: any worker.
    worker_selector: str = ""
    #: Concurrency key; empty: none.
    concurrency_key: str = ""
    #: Most jobs with the key running at once; 0 without a key.
    max_running: int = 0

    @property
    def finished(self) -> int:
        """Jobs in a terminal state (completed, dead or cancelled)."""
        return self.completed + self.dead + self.cancelled

    @property
    def done(self) -> bool:
        """True when every job is terminal."""
        return self.finished >= self.total_jobs

    @classmethod
    def from_pb(cls, a: common_pb2.ActionStatus) -> ActionStatus:
        """The status of a protobuf message."""
        return cls(
            action_id=a.action_id,
            plan_id=a.plan_id,
            total_jobs=a.total_jobs,
            pending=a.pending,
            running=a.running,
            completed=a.completed,
            failed=a.failed,
            dead=a.dead,
            cancelled=a.cancelled,
            created_at=optional_timestamp(a, "created_at"),
            completed_jobs_at=optional_timestamp(a, "completed_jobs_at"),
            priority=a.priority,
            worker_selector=a.worker_selector,
            concurrency_key=a.concurrency_key,
            max_running=a.max_running,
        )


@dataclass(frozen=True)
class ActionPage:
    """One page of :meth:`agq.Client.list_actions`: actions newest first and
    the token of the next page ("" on the last page)."""

    actions: tuple[ActionStatus, ...]
    next_page_token: str = ""


@dataclass(frozen=True)
class CancelledAction:
    """What :meth:`agq.Client.cancel_action` did: ``cancelled`` jobs were
    cancelled by the call, and ``action`` is the status after it.

    ``resent`` is True when the call was sent again after UNAVAILABLE: a
    try whose reply was lost may then have cancelled jobs that
    ``cancelled`` does not count (0 when the lost try cancelled them all);
    ``action.cancelled`` counts every cancelled job of the action.
    """

    cancelled: int
    action: ActionStatus
    resent: bool = False


@dataclass(frozen=True)
class RetriedAction:
    """What :meth:`agq.Client.retry_action` did: ``retried`` failed or dead
    jobs were put back to pending, and ``action`` is the status after it."""

    retried: int
    action: ActionStatus


@dataclass(frozen=True)
class SubmittedAction:
    """What SubmitAction created: the action id and one job id per input, in input order."""

    action_id: str
    job_ids: tuple[str, ...]


@dataclass(frozen=True)
class TaskResult:
    """Outcome of one task of one job attempt. ``duration_ms`` is in milliseconds;
    ``exit_code`` is -1 when the task was killed or never started."""

    task_number: int
    command: str
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration_ms: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    def to_pb(self) -> common_pb2.TaskResult:
        """The protobuf message."""
        return common_pb2.TaskResult(
            task_number=self.task_number,
            command=self.command,
            exit_code=self.exit_code,
            stdout=self.stdout,
            stderr=self.stderr,
            duration_ms=self.duration_ms,
            stdout_truncated=self.stdout_truncated,
            stderr_truncated=self.stderr_truncated,
        )

    @classmethod
    def from_pb(cls, r: common_pb2.TaskResult) -> TaskResult:
        """The result of a protobuf message."""
        return cls(
            task_number=r.task_number,
            command=r.command,
            exit_code=r.exit_code,
            stdout=r.stdout,
            stderr=r.stderr,
            duration_ms=r.duration_ms,
            stdout_truncated=r.stdout_truncated,
            stderr_truncated=r.stderr_truncated,
        )


@dataclass(frozen=True)
class Job:
    """One run of a plan on one input, as the server last saw it."""

    job_id: str
    action_id: str
    plan_id: str
    status: JobStatus
    input: Mapping[str, str]
    #: Attempts started so far (0 before the first lease).
    attempt: int
    max_attempts: int
    created_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    #: The worker holding, or that last held, the job's lease.
    worker_id: str
    #: Task results of the latest reported attempt.
    task_results: tuple[TaskResult, ...]
    #: Why the last attempt failed; empty when it did not.
    error: str
    #: Why a pending job is not running yet; empty otherwise.
    waiting_reason: str
    current_task: int
    progress_percent: int
    ready_at: datetime | None
    #: Scheduling priority (higher leases first).
    priority: int = 0

    @property
    def result(self) -> str | None:
        """The stdout of the last task result (a Python task's return value), or None."""
        if not self.task_results:
            return None
        return max(self.task_results, key=lambda r: r.task_number).stdout

    @classmethod
    def from_pb(cls, j: common_pb2.Job) -> Job:
        """The job of a protobuf message."""

        return cls(
            job_id=j.job_id,
            action_id=j.action_id,
            plan_id=j.plan_id,
            status=JobStatus.of(j.status),
            input=dict(j.input),
            attempt=j.attempt,
            max_attempts=j.max_attempts,
            created_at=optional_timestamp(j, "created_at"),
            started_at=optional_timestamp(j, "started_at"),
            completed_at=optional_timestamp(j, "completed_at"),
            worker_id=j.worker_id,
            task_results=tuple(TaskResult.from_pb(r) for r in j.task_results),
            error=j.error,
            waiting_reason=j.waiting_reason,
            current_task=j.current_task,
            progress_percent=j.progress_percent,
            ready_at=optional_timestamp(j, "ready_at"),
            priority=j.priority,
        )


@dataclass(frozen=True)
class WorkerStats:
    """Load figures of a worker's last heartbeat (durations in ms, sizes in MiB/GiB as named)."""

    active_jobs: int = 0
    completed_jobs_total: int = 0
    failed_jobs_total: int = 0
    uptime_secs: int = 0
    cpu_usage_percent: float = 0.0
    memory_mb: int = 0
    disk_available_gb: int = 0
    avg_job_duration_ms: int = 0

    def to_pb(self) -> common_pb2.WorkerStats:
        """The protobuf message."""
        return common_pb2.WorkerStats(
            active_jobs=self.active_jobs,
            completed_jobs_total=self.completed_jobs_total,
            failed_jobs_total=self.failed_jobs_total,
            uptime_secs=self.uptime_secs,
            cpu_usage_percent=self.cpu_usage_percent,
            memory_mb=self.memory_mb,
            disk_available_gb=self.disk_available_gb,
            avg_job_duration_ms=self.avg_job_duration_ms,
        )

    @classmethod
    def from_pb(cls, s: common_pb2.WorkerStats) -> WorkerStats:
        """The stats of a protobuf message."""
        return cls(
            active_jobs=s.active_jobs,
            completed_jobs_total=s.completed_jobs_total,
            failed_jobs_total=s.failed_jobs_total,
            uptime_secs=s.uptime_secs,
            cpu_usage_percent=s.cpu_usage_percent,
            memory_mb=s.memory_mb,
            disk_available_gb=s.disk_available_gb,
            avg_job_duration_ms=s.avg_job_duration_ms,
        )


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker as the server sees it."""

    worker_id: str
    hostname: str
    platform: str
    #: Version string the worker registered with (``agw_version`` on the wire).
    version: str
    #: Tools (agw) or function names (Python workers) it offers.
    tools: tuple[str, ...]
    max_concurrent_jobs: int
    tags: Mapping[str, str]
    state: WorkerState
    #: True while its last heartbeat is younger than 3 x the heartbeat interval.
    fresh: bool
    last_heartbeat_at: datetime | None
    stats: WorkerStats
    active_leases: int
    #: True while both its heartbeat and lease streams are open.
    connected: bool
    registered_at: datetime | None
    sandboxed: bool
    #: Why it is quarantined; empty when it is not.
    quarantine_reason: str = ""
    #: Names of the agentic units it offers.
    agentic_units: tuple[str, ...] = ()
    #: The latest verification of each command it was challenged on.
    verifications: tuple[Verification, ...] = ()

    @classmethod
    def from_pb(cls, w: common_pb2.Worker) -> WorkerInfo:
        """The worker of a protobuf message."""
        return cls(
            worker_id=w.worker_id,
            hostname=w.hostname,
            platform=w.platform,
            version=w.agw_version,
            tools=tuple(w.capabilities.tools),
            max_concurrent_jobs=w.max_concurrent_jobs,
            tags=dict(w.tags),
            state=WorkerState.of(w.state),
            fresh=w.fresh,
            last_heartbeat_at=optional_timestamp(w, "last_heartbeat_at"),
            stats=WorkerStats.from_pb(w.stats),
            active_leases=w.active_leases,
            connected=w.connected,
            registered_at=optional_timestamp(w, "registered_at"),
            sandboxed=w.sandboxed,
            quarantine_reason=w.quarantine_reason,
            agentic_units=tuple(w.capabilities.agentic_units),
            verifications=tuple(Verification.from_pb(v) for v in w.verifications),
        )


@dataclass(frozen=True)
class Verification:
    """A capability verification: the server asked the worker to run
    ``tool`` with ``args`` and recorded its answer (WORKER.VERIFY)."""

    tool: str
    args: tuple[str, ...]
    challenge_id: str
    requested_at: datetime | None
    #: None while the challenge is pending.
    answered_at: datetime | None
    passed: bool
    exit_code: int
    #: The start of its stdout.
    output: str
    #: Why it did not pass.
    error: str

    @classmethod
    def from_pb(cls, v: common_pb2.Verification) -> Verification:
        """The verification of a protobuf message."""
        return cls(
            tool=v.tool,
            args=tuple(v.args),
            challenge_id=v.challenge_id,
            requested_at=optional_timestamp(v, "requested_at"),
            answered_at=optional_timestamp(v, "answered_at"),
            passed=v.passed,
            exit_code=v.exit_code,
            output=v.output,
            error=v.error,
        )


#: Catch-up policies of a schedule by name (``agq.v1.CatchUp``).
CATCH_UP = {
    "all": schedule_service_pb2.CATCH_UP_ALL,
    "latest": schedule_service_pb2.CATCH_UP_LATEST,
    "skip": schedule_service_pb2.CATCH_UP_SKIP,
}


@dataclass(frozen=True)
class Schedule:
    """A recurring schedule: an action of ``plan_id`` with ``inputs`` at
    every tick of ``cron`` (with seconds) in ``time_zone``."""

    schedule_id: str
    plan_id: str
    cron: str
    time_zone: str
    inputs: tuple[Mapping[str, str], ...]
    #: "all", "latest" or "skip": what happens to ticks missed while the
    #: server was down.
    catch_up: str
    paused: bool
    next_run_at: datetime | None
    last_run_at: datetime | None
    last_action_id: str
    runs: int
    last_error: str
    priority: int = 0
    worker_selector: str = ""

    @classmethod
    def from_pb(cls, s: schedule_service_pb2.Schedule) -> Schedule:
        """The schedule of a protobuf message."""
        names = {v: k for k, v in CATCH_UP.items()}
        return cls(
            schedule_id=s.schedule_id,
            plan_id=s.plan_id,
            cron=s.cron,
            time_zone=s.time_zone,
            inputs=tuple(dict(i.values) for i in s.inputs),
            catch_up=names.get(s.catch_up, "all"),
            paused=s.paused,
            next_run_at=optional_timestamp(s, "next_run_at"),
            last_run_at=optional_timestamp(s, "last_run_at"),
            last_action_id=s.last_action_id,
            runs=s.runs,
            last_error=s.last_error,
            priority=s.priority,
            worker_selector=s.worker_selector,
        )


@dataclass(frozen=True)
class QueueStats:
    """Queue depths (jobs), ages (seconds) and worker counts.

    The worker counts split the live workers: ``workers_active`` (fresh,
    ACTIVE, running at least one job), ``workers_idle`` (fresh, ACTIVE,
    running none), ``workers_draining``, ``workers_quarantined`` and
    ``workers_stale`` add up to ``workers_total``.
    """

    ready_length: int
    scheduled_length: int
    running_length: int
    oldest_ready_age_secs: int
    next_scheduled_due_in_secs: int
    workers_total: int
    workers_active: int
    workers_idle: int
    workers_stale: int
    #: Seconds the newest ready job has waited.
    newest_job_age_secs: int = 0
    workers_draining: int = 0
    workers_quarantined: int = 0

    @classmethod
    def from_pb(cls, s: queue_service_pb2.GetQueueStatsResponse) -> QueueStats:
        """The stats of a protobuf message."""
        return cls(
            ready_length=s.ready_length,
            scheduled_length=s.scheduled_length,
            running_length=s.running_length,
            oldest_ready_age_secs=s.oldest_ready_age_secs,
            next_scheduled_due_in_secs=s.next_scheduled_due_in_secs,
            workers_total=s.workers_total,
            workers_active=s.workers_active,
            workers_idle=s.workers_idle,
            workers_stale=s.workers_stale,
            newest_job_age_secs=s.newest_job_age_secs,
            workers_draining=s.workers_draining,
            workers_quarantined=s.workers_quarantined,
        )


@dataclass(frozen=True)
class Page:
    """One page of ids and the token of the next page ("" on the last page)."""

    ids: tuple[str, ...]
    next_page_token: str = ""


__all__ = [
    "ActionPage",
    "ActionState",
    "ActionStatus",
    "CancelledAction",
    "Job",
    "JobStatus",
    "Page",
    "Plan",
    "PlanVersion",
    "PlanVersionPage",
    "QueueStats",
    "RetriedAction",
    "Schedule",
    "SubmittedAction",
    "Verification",
    "Task",
    "TaskResult",
    "WorkerInfo",
    "WorkerState",
    "WorkerStats",
]
