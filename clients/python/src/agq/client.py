"""The typed AGQ client: every client-facing RPC of the plan, action, job,
worker, schedule and queue services as a method with a deadline, bearer
token and retries."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Generic, TypeVar

import grpc

from agq._rpc import AgqError, Metadata, RetryPolicy, bearer, call_unary, make_channel, status_of
from agq.types import (
    CATCH_UP,
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
    Verification,
    WorkerInfo,
    WorkerState,
    to_timestamp,
)
from agq.v1 import (
    action_service_pb2,
    action_service_pb2_grpc,
    common_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    plan_service_pb2,
    plan_service_pb2_grpc,
    queue_service_pb2,
    queue_service_pb2_grpc,
    schedule_service_pb2,
    schedule_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)

#: Default deadline of one unary call, in seconds.
DEFAULT_TIMEOUT = 30.0

#: The longest deadline of one call, in seconds (about three years): gRPC
#: fails a call at once when its deadline is past what it can represent.
MAX_TIMEOUT = 1e8


def _checked_timeout(timeout: float) -> float:
    """``timeout`` when it is a number of seconds in (0, MAX_TIMEOUT];
    ValueError otherwise (NaN and infinity included)."""
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(
            f"timeout must be a number of seconds > 0 and <= {MAX_TIMEOUT:g}, got {timeout!r}"
        )
    return timeout

#: Attempts per job the server gives when a schedule asks for 0.
_DEFAULT_MAX_ATTEMPTS = 3

#: One try only: for calls that must not be sent twice.
_ONCE = RetryPolicy(attempts=1)

_Resp = TypeVar("_Resp")


class _Counted(Generic[_Resp]):
    """A stub method for :func:`call_unary` that counts its tries: a call
    retried after UNAVAILABLE (``tries > 1``) may have been applied by an
    earlier try whose reply was lost, which the caller then resolves.
    ``options`` are passed to the stub (``wait_for_ready``)."""

    def __init__(self, fn: Callable[..., _Resp], **options: object) -> None:
        self._fn = fn
        self._options = options
        self.tries = 0

    def __call__(self, request: object, timeout: float, metadata: Metadata) -> _Resp:
        self.tries += 1
        return self._fn(request, timeout=timeout, metadata=metadata, **self._options)


class Client:
    """A connection to an AGQ server (``agq serve``).

    ``address`` is ``host:port`` (``http://`` is stripped; ``https://``
    turns TLS on). ``token`` is sent as ``authorization: Bearer <token>``
    on every call (needed when the server has an auth file: a client or
    admin token). ``tls``: None/False for plaintext, True for TLS with the
    system roots, or ``grpc.ChannelCredentials`` (see
    :func:`agq.tls_credentials`). ``timeout`` is the default deadline of
    each unary call in seconds; every method takes ``timeout=`` to override
    it (ValueError unless it is > 0 and at most :data:`MAX_TIMEOUT`, about
    three years). Calls failing with
    UNAVAILABLE are retried per ``retry``.

    A call that is not idempotent may have been applied by a try whose
    reply was lost (the connection dropped): each such method says how its
    retry resolves that. Most resolve it from the retry's answer (a retried
    :meth:`cancel_job` that finds the job cancelled returns it, a retried
    delete or :meth:`forget_worker` that finds nothing to delete succeeds,
    a retried :meth:`cancel_action` says it was resent, ...);
    :meth:`retry_job` and :meth:`retry_action`, whose repetition could run
    jobs again, are never sent twice.

    Every method raises :class:`agq.AgqError` when the call fails; its
    ``code`` is the gRPC status. Common ones: UNAVAILABLE (server down, after
    the retries), DEADLINE_EXCEEDED (the timeout passed), UNAUTHENTICATED
    (missing or unknown token), PERMISSION_DENIED (the token's role may not
    make the call), INVALID_ARGUMENT (the server's validation message names
    the rule), NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION.

    Use as a context manager, or call :meth:`close`. Thread-safe.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls: bool | grpc.ChannelCredentials | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = _checked_timeout(timeout)
        self.retry = retry or RetryPolicy()
        self._metadata: Metadata = bearer(token)
        #: The underlying gRPC channel (for the raw stubs of :mod:`agq.v1`).
        self.channel = make_channel(address, tls, tls_server_name)
        self._plans = plan_service_pb2_grpc.PlanServiceStub(self.channel)
        self._actions = action_service_pb2_grpc.ActionServiceStub(self.channel)
        self._jobs = job_service_pb2_grpc.JobServiceStub(self.channel)
        self._workers = worker_service_pb2_grpc.WorkerServiceStub(self.channel)
        self._queue = queue_service_pb2_grpc.QueueServiceStub(self.channel)
        self._schedules = schedule_service_pb2_grpc.ScheduleServiceStub(self.channel)

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else _checked_timeout(timeout)

    def _send_once(
        self, name: str, fn: Callable[..., _Resp], req: object, timeout: float | None,
        check: str,
    ) -> _Resp:
        """Calls ``fn`` (RPC ``name``) once, waiting for the connection up
        to the deadline, for a call that must not be sent twice. An
        UNAVAILABLE is raised with ``check`` added: how the caller tells
        whether the request reached the server."""
        try:
            return call_unary(
                name, _Counted(fn, wait_for_ready=True), req,
                timeout=self._t(timeout), metadata=self._metadata, retry=_ONCE,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                raise AgqError(
                    name, e.code,
                    f"{e.details} (not retried: the request may have reached the server; "
                    f"{check})",
                ) from e
            raise

    # -- plans -----------------------------------------------------------

    def submit_plan(
        self, plan: Plan, *, replace: bool = False, timeout: float | None = None
    ) -> str:
        """Stores ``plan`` and returns its id.

        Plans are versioned: with ``replace`` an existing id gets ``plan`` as
        its next version (jobs already created keep the version they were
        created with; a plan identical to the latest version stores
        nothing), and a new id is stored as version 1 either way.

        Errors: INVALID_ARGUMENT (the plan breaks a rule; the message names
        it), ALREADY_EXISTS (without ``replace``, the id is taken; a retry
        after UNAVAILABLE that finds the same plan stored counts as success).
        """
        req = plan_service_pb2.SubmitPlanRequest(plan=plan.to_pb(), replace=replace)
        tries = 0

        def submit(
            r: plan_service_pb2.SubmitPlanRequest, t: float, md: Metadata
        ) -> plan_service_pb2.SubmitPlanResponse:
            nonlocal tries
            tries += 1
            return self._plans.SubmitPlan(r, timeout=t, metadata=md)

        try:
            resp = call_unary(
                "SubmitPlan", submit, req,
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
            return resp.plan_id
        except AgqError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS and tries > 1:
                if self.get_plan(plan.plan_id, timeout=timeout) == Plan.from_pb(req.plan):
                    return plan.plan_id
            raise

    def get_plan(
        self, plan_id: str, *, version: int = 0, timeout: float | None = None
    ) -> Plan:
        """The stored plan: its latest version, or ``version`` (1 is the
        first). Errors: INVALID_ARGUMENT (malformed id), NOT_FOUND (unknown
        plan or version)."""
        resp = call_unary(
            "GetPlan", self._plans.GetPlan,
            plan_service_pb2.GetPlanRequest(plan_id=plan_id, version=version),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Plan.from_pb(resp.plan)

    def list_plans(
        self,
        pattern: str = "",
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Page:
        """One page of plan ids in ascending order matching the glob ``pattern``
        ("" matches all); ``page_size`` 0 means 100. Errors: INVALID_ARGUMENT."""
        resp = call_unary(
            "ListPlans", self._plans.ListPlans,
            plan_service_pb2.ListPlansRequest(
                pattern=pattern, page_size=page_size, page_token=page_token
            ),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Page(tuple(resp.plan_ids), resp.next_page_token)

    def iter_plans(self, pattern: str = "", *, timeout: float | None = None) -> Iterator[str]:
        """Every plan id matching ``pattern``, following the pages."""
        token = ""
        while True:
            page = self.list_plans(pattern, page_size=1000, page_token=token, timeout=timeout)
            yield from page.ids
            if not page.next_page_token:
                return
            token = page.next_page_token

    def delete_plan(self, plan_id: str, *, timeout: float | None = None) -> bool:
        """Deletes a plan and its finished jobs' history; True when deleted.
        Errors: NOT_FOUND; FAILED_PRECONDITION while pending or running jobs use it.
        A retry after UNAVAILABLE that finds the plan gone (NOT_FOUND)
        returns True: the lost try deleted it."""
        call = _Counted(self._plans.DeletePlan)
        try:
            resp = call_unary(
                "DeletePlan", call, plan_service_pb2.DeletePlanRequest(plan_id=plan_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.NOT_FOUND and call.tries > 1:
                return True
            raise
        return resp.deleted

    def list_plan_versions(
        self,
        plan_id: str,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> PlanVersionPage:
        """One page of the stored versions of plan ``plan_id``, newest first:
        each with its number, description, task count and store time
        (:meth:`get_plan` with ``version=`` fetches one whole).
        ``page_size`` is 1..=1000 versions, 0 means 100; ``page_token`` is
        the previous page's ``next_page_token`` ("" for the first page).
        Read-only: retried after UNAVAILABLE. Errors: INVALID_ARGUMENT
        (malformed id, page size or token), NOT_FOUND (unknown plan)."""
        resp = call_unary(
            "ListPlanVersions", self._plans.ListPlanVersions,
            plan_service_pb2.ListPlanVersionsRequest(
                plan_id=plan_id, page_size=page_size, page_token=page_token
            ),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return PlanVersionPage(
            tuple(PlanVersion.from_pb(v) for v in resp.versions), resp.next_page_token
        )

    def iter_plan_versions(
        self, plan_id: str, *, timeout: float | None = None
    ) -> Iterator[PlanVersion]:
        """Every stored version of plan ``plan_id``, newest first, following
        the pages (``timeout`` applies to each page's call). Errors as
        :meth:`list_plan_versions`."""
        token = ""
        while True:
            page = self.list_plan_versions(
                plan_id, page_size=1000, page_token=token, timeout=timeout
            )
            yield from page.versions
            if not page.next_page_token:
                return
            token = page.next_page_token

    # -- actions ---------------------------------------------------------

    def submit_action(
        self,
        plan_id: str,
        inputs: Sequence[Mapping[str, str]],
        *,
        action_id: str | None = None,
        run_at: datetime | None = None,
        max_attempts: int = 0,
        priority: int = 0,
        worker_selector: str = "",
        concurrency_key: str = "",
        max_running: int = 0,
        timeout: float | None = None,
    ) -> SubmittedAction:
        """Creates one job per input of plan ``plan_id``, all or nothing.

        ``action_id`` defaults to a fresh ``py-<uuid>`` made here, so that a
        retry after UNAVAILABLE cannot create the action twice (a retry that
        finds it created returns its jobs; one that finds an action of
        another plan, job count or fleet options under a caller's
        ``action_id`` raises ALREADY_EXISTS). ``run_at`` (aware datetime)
        schedules the jobs; ``max_attempts`` 0 means the server's 3.

        Fleet scheduling: ``priority`` (-1000..=1000, higher leases first;
        actions of equal priority take turns), ``worker_selector`` (a
        label selector over the workers' tags, e.g. ``"gpu=true,!spot"``;
        empty: the plan's default), ``concurrency_key`` with
        ``max_running`` (at most that many jobs of all actions with the key
        run at once across the fleet).

        Errors: INVALID_ARGUMENT (bad id, no or too many inputs, oversized
        input, bad max_attempts, priority, selector, key or max_running),
        NOT_FOUND (unknown plan), ALREADY_EXISTS (the action id is taken).
        """
        _check_inputs(inputs)
        aid = action_id or f"py-{uuid.uuid4().hex}"
        req = action_service_pb2.SubmitActionRequest(
            action_id=aid,
            plan_id=plan_id,
            inputs=[common_pb2.ActionInput(values=dict(i)) for i in inputs],
            max_attempts=max_attempts,
            priority=priority,
            worker_selector=worker_selector,
            concurrency_key=concurrency_key,
            max_running=max_running,
        )
        if run_at is not None:
            req.run_at.CopyFrom(to_timestamp(run_at))
        tries = 0

        def submit(
            r: action_service_pb2.SubmitActionRequest, t: float, md: Metadata
        ) -> action_service_pb2.SubmitActionResponse:
            nonlocal tries
            tries += 1
            return self._actions.SubmitAction(r, timeout=t, metadata=md)

        try:
            resp = call_unary(
                "SubmitAction", submit, req,
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS and tries > 1:
                # An earlier try went through before the connection failed,
                # or the id was taken already (a caller's action_id): only
                # an action as this call asked for is taken for its own.
                a = self.get_action(aid, timeout=timeout)
                if (a.plan_id, a.total_jobs, a.priority, a.concurrency_key, a.max_running) == (
                    plan_id, len(req.inputs), priority, concurrency_key, max_running,
                ):
                    return SubmittedAction(aid, tuple(self.iter_jobs(aid, timeout=timeout)))
            raise
        return SubmittedAction(resp.action_id, tuple(resp.job_ids))

    def get_action(self, action_id: str, *, timeout: float | None = None) -> ActionStatus:
        """Aggregate job counts of an action. Errors: INVALID_ARGUMENT,
        NOT_FOUND (unknown, or deleted by the server's job retention)."""
        resp = call_unary(
            "GetAction", self._actions.GetAction,
            action_service_pb2.GetActionRequest(action_id=action_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return ActionStatus.from_pb(resp.action)

    def watch_action(
        self, action_id: str, *, timeout: float | None = None
    ) -> Iterator[ActionStatus]:
        """Yields the action's status now and after every job status change,
        and stops after the first status in which every job is terminal.

        ``timeout`` bounds the whole watch in seconds (None: no limit); when
        it passes, AgqError DEADLINE_EXCEEDED is raised. A stream broken by
        UNAVAILABLE is reopened per the retry policy (the server sends the
        current status first, so nothing is missed), as is one that ends
        without an error before every job is terminal (UNAVAILABLE once the
        retries are spent). Errors: INVALID_ARGUMENT,
        NOT_FOUND. Closing the iterator early cancels the stream.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        req = action_service_pb2.WatchActionRequest(action_id=action_id)
        delays = self.retry.delays()
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise AgqError(
                    "WatchAction", grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"action {action_id} not done within {timeout} s",
                )
            call = self._actions.WatchAction(req, timeout=remaining, metadata=self._metadata)
            try:
                for msg in call:
                    status = ActionStatus.from_pb(msg.action)
                    delays = self.retry.delays()
                    yield status
                    if status.done:
                        return
                # Ended without an error before every job was terminal (a
                # proxy or the server cut it): reopened as after UNAVAILABLE.
                d = next(delays, None)
                if d is None:
                    raise AgqError(
                        "WatchAction", grpc.StatusCode.UNAVAILABLE,
                        f"the stream of action {action_id} ended before every job was terminal",
                    )
                time.sleep(d)
                continue
            except grpc.RpcError as e:
                code, _ = status_of(e)
                if code == grpc.StatusCode.UNAVAILABLE:
                    d = next(delays, None)
                    if d is not None:
                        time.sleep(d)
                        continue
                raise AgqError.from_rpc("WatchAction", e) from e
            finally:
                call.cancel()

    def wait_action(self, action_id: str, *, timeout: float | None = None) -> ActionStatus:
        """Watches the action until every job is terminal and returns that
        status. ``timeout`` in seconds as in :meth:`watch_action`."""
        last: ActionStatus | None = None
        for last in self.watch_action(action_id, timeout=timeout):
            pass
        if last is None:  # pragma: no cover - the server always sends one
            raise AgqError("WatchAction", grpc.StatusCode.UNKNOWN, "stream ended without a status")
        return last

    def list_actions(
        self,
        plan_id: str = "",
        state: ActionState | None = None,
        *,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> ActionPage:
        """One page of actions with their job counts, newest first (by
        creation time, then the later submitted first).

        Filters: ``plan_id`` ("" for every plan), ``state`` (OPEN: some job
        is pending, running or failed; FINISHED: every job is terminal;
        HAS_DEAD: some job is dead; None for all), ``created_after``
        (inclusive) and ``created_before`` (exclusive), aware datetimes.
        ``page_size`` is at most 1000 actions, 0 means 100; ``page_token``
        is the previous page's ``next_page_token`` ("" for the first page)
        and is valid only with the same filters. Actions deleted by the
        server's job retention are not listed. Read-only: retried after
        UNAVAILABLE.

        Errors: INVALID_ARGUMENT (bad plan id, page_size over 1000, a token
        of other filters or another server, ``created_after`` not before
        ``created_before``); ValueError for a naive datetime.
        """
        req = action_service_pb2.ListActionsRequest(
            plan_id=plan_id,
            state=action_service_pb2.ActionState.ValueType(
                int(state or ActionState.UNSPECIFIED)
            ),
            page_size=page_size,
            page_token=page_token,
        )
        if created_after is not None:
            req.created_after.CopyFrom(to_timestamp(created_after))
        if created_before is not None:
            req.created_before.CopyFrom(to_timestamp(created_before))
        resp = call_unary(
            "ListActions", self._actions.ListActions, req,
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return ActionPage(
            tuple(ActionStatus.from_pb(a) for a in resp.actions), resp.next_page_token
        )

    def iter_actions(
        self,
        plan_id: str = "",
        state: ActionState | None = None,
        *,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        timeout: float | None = None,
    ) -> Iterator[ActionStatus]:
        """Every action matching the filters of :meth:`list_actions`, newest
        first, following the pages (``timeout`` applies to each page's
        call). Each page is read when the iteration reaches it: an action
        submitted meanwhile is not listed (it sorts before the pages still
        to come), and with a ``state`` filter one whose state changes
        meanwhile may be listed or not."""
        token = ""
        while True:
            page = self.list_actions(
                plan_id, state,
                created_after=created_after, created_before=created_before,
                page_size=1000, page_token=token, timeout=timeout,
            )
            yield from page.actions
            if not page.next_page_token:
                return
            token = page.next_page_token

    def cancel_action(self, action_id: str, *, timeout: float | None = None) -> CancelledAction:
        """Cancels every open job (pending, running, or failed and waiting
        for its next attempt) of an action in one transaction; the workers
        running them are told to stop, as by :meth:`cancel_job`. Returns
        how many jobs the call cancelled and the action's status after it.
        An action with no open job is left as it is (``cancelled`` 0).

        Cancelling again cancels nothing more, so the call is retried after
        UNAVAILABLE. A try whose reply was lost may have cancelled the jobs
        already: the retry then answers with the jobs it cancelled itself,
        0 when the lost try cancelled them all. ``resent`` on the result
        says that this happened (``cancelled`` may undercount);
        ``action.cancelled`` counts every cancelled job of the action either way.

        Errors: INVALID_ARGUMENT (malformed id), NOT_FOUND (unknown action,
        or deleted by the server's job retention).
        """
        call = _Counted(self._actions.CancelAction)
        resp = call_unary(
            "CancelAction", call, action_service_pb2.CancelActionRequest(action_id=action_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return CancelledAction(
            resp.cancelled, ActionStatus.from_pb(resp.action), resent=call.tries > 1
        )

    def retry_action(
        self,
        action_id: str,
        status: JobStatus | None = None,
        *,
        timeout: float | None = None,
    ) -> RetriedAction:
        """Puts every failed and dead job of an action (only those in
        ``status`` when given: :attr:`JobStatus.FAILED` or
        :attr:`JobStatus.DEAD`) back to pending with a fresh attempt budget
        in one transaction, as :meth:`retry_job` does for one job. Returns
        how many jobs were retried and the action's status after it; no
        matching job changes nothing (``retried`` 0).

        Sent at most once, like :meth:`retry_job`: sent twice, it could
        retry jobs that failed again in between, running them once more.
        The request waits (until ``timeout``) for the connection to be
        ready instead of failing fast while the server is down, and is not
        retried after UNAVAILABLE once it may have reached the server: the
        error then says so, and :meth:`get_action` tells whether the jobs
        were retried.

        Errors: INVALID_ARGUMENT (malformed id; ``status`` other than
        FAILED or DEAD), NOT_FOUND (unknown action), FAILED_PRECONDITION (a
        job would be retried but its plan was deleted; nothing is retried),
        UNAVAILABLE (the connection dropped: perhaps applied, see above),
        DEADLINE_EXCEEDED.
        """
        req = action_service_pb2.RetryActionRequest(
            action_id=action_id,
            status=common_pb2.JobStatus.ValueType(int(status or JobStatus.UNSPECIFIED)),
        )
        resp = self._send_once(
            "RetryAction", self._actions.RetryAction, req, timeout,
            f"get_action({action_id!r}) tells whether its jobs were retried",
        )
        return RetriedAction(resp.retried, ActionStatus.from_pb(resp.action))

    # -- jobs ------------------------------------------------------------

    def get_job(self, job_id: str, *, timeout: float | None = None) -> Job:
        """One job with its task results, attempts, times and worker.
        Errors: INVALID_ARGUMENT, NOT_FOUND."""
        resp = call_unary(
            "GetJob", self._jobs.GetJob, job_service_pb2.GetJobRequest(job_id=job_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Job.from_pb(resp.job)

    def list_jobs(
        self,
        action_id: str,
        status: JobStatus | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Page:
        """One page of job ids of an action in creation order, optionally of
        one status; ``page_size`` 0 means 100. Errors: INVALID_ARGUMENT, NOT_FOUND."""
        resp = call_unary(
            "ListJobs", self._jobs.ListJobs,
            job_service_pb2.ListJobsRequest(
                action_id=action_id,
                status=common_pb2.JobStatus.ValueType(int(status or JobStatus.UNSPECIFIED)),
                page_size=page_size,
                page_token=page_token,
            ),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Page(tuple(resp.job_ids), resp.next_page_token)

    def iter_jobs(
        self, action_id: str, status: JobStatus | None = None, *, timeout: float | None = None
    ) -> Iterator[str]:
        """Every job id of an action (optionally of one status), following the pages."""
        token = ""
        while True:
            page = self.list_jobs(
                action_id, status, page_size=1000, page_token=token, timeout=timeout
            )
            yield from page.ids
            if not page.next_page_token:
                return
            token = page.next_page_token

    def search_jobs(
        self,
        status: JobStatus | None = None,
        plan_id: str = "",
        *,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Page:
        """One page of job ids across actions by status, plan and creation
        time (aware datetimes), in creation order. Errors: INVALID_ARGUMENT."""
        req = job_service_pb2.SearchJobsRequest(
            status=common_pb2.JobStatus.ValueType(int(status or JobStatus.UNSPECIFIED)),
            plan_id=plan_id,
            page_size=page_size,
            page_token=page_token,
        )
        if created_after is not None:
            req.created_after.CopyFrom(to_timestamp(created_after))
        if created_before is not None:
            req.created_before.CopyFrom(to_timestamp(created_before))
        resp = call_unary(
            "SearchJobs", self._jobs.SearchJobs, req,
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Page(tuple(resp.job_ids), resp.next_page_token)

    def retry_job(
        self, job_id: str, *, priority: int | None = None, timeout: float | None = None
    ) -> Job:
        """Puts a failed or dead job back to pending with a fresh attempt
        budget, at ``priority`` when given (else its own).

        Sent at most once: sent twice, a retry could run the job again (it
        may have failed again in between) and a refusal of the second try
        could not be told from one of the first. So the request waits
        (until ``timeout``) for the connection to be ready instead of
        failing fast while the server is down or restarting, and is not
        retried after UNAVAILABLE once it may have reached the server: the
        error then says so, and the job's status (:meth:`get_job`) tells
        whether it was retried.

        Errors: NOT_FOUND; FAILED_PRECONDITION from any other status;
        INVALID_ARGUMENT (priority out of -1000..=1000); UNAVAILABLE (the
        connection dropped: perhaps applied, see above); DEADLINE_EXCEEDED."""
        req = job_service_pb2.RetryJobRequest(job_id=job_id)
        if priority is not None:
            req.priority = priority
        resp = self._send_once(
            "RetryJob", self._jobs.RetryJob, req, timeout,
            f"get_job({job_id!r}) tells whether the job was retried",
        )
        return Job.from_pb(resp.job)

    def cancel_job(self, job_id: str, *, timeout: float | None = None) -> Job:
        """Cancels a pending or running job (its worker is told to stop it).
        Errors: NOT_FOUND; FAILED_PRECONDITION when it already ended. A retry
        after UNAVAILABLE that is refused because the job is cancelled (the
        lost try cancelled it) returns the cancelled job."""
        call = _Counted(self._jobs.CancelJob)
        try:
            resp = call_unary(
                "CancelJob", call, job_service_pb2.CancelJobRequest(job_id=job_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION and call.tries > 1:
                job = self.get_job(job_id, timeout=timeout)
                if job.status is JobStatus.CANCELLED:
                    return job
            raise
        return Job.from_pb(resp.job)

    # -- workers ---------------------------------------------------------

    def list_workers(
        self, state: WorkerState | None = None, *, timeout: float | None = None
    ) -> list[WorkerInfo]:
        """Workers by id, optionally only those in ``state``: every page
        of ListWorkers (``timeout`` applies to each call)."""
        workers: list[WorkerInfo] = []
        page_token = ""
        while True:  # each page has at least one worker: this ends
            resp = call_unary(
                "ListWorkers", self._workers.ListWorkers,
                worker_service_pb2.ListWorkersRequest(
                    state=common_pb2.WorkerState.ValueType(int(state or WorkerState.UNSPECIFIED)),
                    page_token=page_token,
                ),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
            workers.extend(WorkerInfo.from_pb(w) for w in resp.workers)
            if not resp.next_page_token:
                return workers
            page_token = resp.next_page_token

    def get_worker(self, worker_id: str, *, timeout: float | None = None) -> WorkerInfo:
        """One worker with freshness, stats and load. Errors: INVALID_ARGUMENT, NOT_FOUND."""
        resp = call_unary(
            "GetWorker", self._workers.GetWorker,
            worker_service_pb2.GetWorkerRequest(worker_id=worker_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return WorkerInfo.from_pb(resp.worker)

    def drain_worker(self, worker_id: str, *, timeout: float | None = None) -> WorkerInfo:
        """Puts a worker in DRAINING (no new leases; it finishes its jobs).
        Needs an admin token (or the worker's own) when auth is on.
        Errors: NOT_FOUND, FAILED_PRECONDITION (DEAD or UNREGISTERED), PERMISSION_DENIED.
        Draining a DRAINING worker changes nothing, so a retry after
        UNAVAILABLE is harmless; one refused because the worker has
        UNREGISTERED meanwhile (the lost try drained it and it left) returns
        the worker."""
        call = _Counted(self._workers.DrainWorker)
        try:
            resp = call_unary(
                "DrainWorker", call, worker_service_pb2.DrainWorkerRequest(worker_id=worker_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION and call.tries > 1:
                w = self.get_worker(worker_id, timeout=timeout)
                if w.state is WorkerState.UNREGISTERED:
                    return w
            raise
        return WorkerInfo.from_pb(resp.worker)

    def forget_worker(self, worker_id: str, *, timeout: float | None = None) -> None:
        """Deletes the record of a DEAD or UNREGISTERED worker now, rather
        than after the 24 hours departed workers stay listed; the id may
        register again later. Needs the worker's own token or an admin
        token when auth is on (a client token is refused).

        Errors: INVALID_ARGUMENT (malformed id), NOT_FOUND (unknown id),
        FAILED_PRECONDITION while the worker is ACTIVE, DRAINING or
        QUARANTINED (unregister or drain it first), PERMISSION_DENIED.
        A retry after UNAVAILABLE that finds no such worker (NOT_FOUND)
        succeeds: the lost try forgot it.
        """
        call = _Counted(self._workers.ForgetWorker)
        try:
            call_unary(
                "ForgetWorker", call, worker_service_pb2.ForgetWorkerRequest(worker_id=worker_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if not (e.code == grpc.StatusCode.NOT_FOUND and call.tries > 1):
                raise

    def release_worker(self, worker_id: str, *, timeout: float | None = None) -> WorkerInfo:
        """Ends a worker's quarantine (too many job timeouts): it is ACTIVE
        again. Needs an admin token when auth is on.
        Errors: NOT_FOUND, FAILED_PRECONDITION (not quarantined), PERMISSION_DENIED.
        A retry after UNAVAILABLE that is refused because the worker is not
        quarantined (the lost try released it) returns the worker."""
        call = _Counted(self._workers.ReleaseWorker)
        try:
            resp = call_unary(
                "ReleaseWorker", call,
                worker_service_pb2.ReleaseWorkerRequest(worker_id=worker_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION and call.tries > 1:
                w = self.get_worker(worker_id, timeout=timeout)
                if w.state is not WorkerState.QUARANTINED and not w.quarantine_reason:
                    return w
            raise
        return WorkerInfo.from_pb(resp.worker)

    def verify_worker(
        self,
        worker_id: str,
        tool: str,
        args: Sequence[str] = (),
        *,
        timeout: float | None = None,
    ) -> Verification:
        """Challenges an ``agw`` worker to run one of its tools or agentic
        units with ``args`` (default ``--describe`` for a unit, ``--version``
        for a tool) and returns the pending verification; ``get_worker``
        shows the answer (WORKER.VERIFY). Python workers do not answer
        challenges. Needs an admin token when auth is on. A retry after
        UNAVAILABLE may challenge the worker twice (harmless: each
        challenge is answered; the latest is returned).
        Errors: INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION (not
        advertised, not live, no heartbeat stream), PERMISSION_DENIED."""
        resp = call_unary(
            "VerifyWorker", self._workers.VerifyWorker,
            worker_service_pb2.VerifyWorkerRequest(worker_id=worker_id, tool=tool, args=list(args)),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Verification.from_pb(resp.verification)

    # -- schedules -------------------------------------------------------

    def create_schedule(
        self,
        schedule_id: str,
        plan_id: str,
        cron: str,
        inputs: Sequence[Mapping[str, str]],
        *,
        time_zone: str = "",
        max_attempts: int = 0,
        priority: int = 0,
        worker_selector: str = "",
        concurrency_key: str = "",
        max_running: int = 0,
        catch_up: str = "all",
        timeout: float | None = None,
    ) -> Schedule:
        """Creates a recurring schedule: an action of ``plan_id`` with
        ``inputs`` at every tick of ``cron`` ("sec min hour day-of-month
        month day-of-week [year]", days of the week 1 Sunday to 7 Saturday;
        or the classic five fields, days of the week as in crontab) read in
        ``time_zone`` (IANA; "" is UTC). Each tick's action is
        ``<schedule_id>-<unix seconds>``, submitted exactly once.
        ``catch_up`` ("all", "latest", "skip") says what happens to ticks
        missed while the server was down.
        Errors: INVALID_ARGUMENT, NOT_FOUND (plan), ALREADY_EXISTS (a retry
        after UNAVAILABLE that finds a schedule with this id and the same
        plan, cron, time zone, inputs and options returns it: the lost try
        created it)."""
        _check_inputs(inputs)
        if catch_up not in CATCH_UP:
            raise ValueError(f"catch_up must be one of {sorted(CATCH_UP)}, got {catch_up!r}")
        schedule = schedule_service_pb2.Schedule(
            schedule_id=schedule_id,
            plan_id=plan_id,
            cron=cron,
            time_zone=time_zone,
            inputs=[common_pb2.ActionInput(values=dict(i)) for i in inputs],
            max_attempts=max_attempts,
            priority=priority,
            worker_selector=worker_selector,
            concurrency_key=concurrency_key,
            max_running=max_running,
            catch_up=CATCH_UP[catch_up],
        )
        call = _Counted(self._schedules.CreateSchedule)
        try:
            resp = call_unary(
                "CreateSchedule", call,
                schedule_service_pb2.CreateScheduleRequest(schedule=schedule),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS and call.tries > 1:
                stored = call_unary(
                    "GetSchedule", self._schedules.GetSchedule,
                    schedule_service_pb2.GetScheduleRequest(schedule_id=schedule_id),
                    timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
                ).schedule
                if _same_schedule(schedule, stored):
                    return Schedule.from_pb(stored)
            raise
        return Schedule.from_pb(resp.schedule)

    def get_schedule(self, schedule_id: str, *, timeout: float | None = None) -> Schedule:
        """One schedule. Errors: INVALID_ARGUMENT, NOT_FOUND."""
        resp = call_unary(
            "GetSchedule", self._schedules.GetSchedule,
            schedule_service_pb2.GetScheduleRequest(schedule_id=schedule_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Schedule.from_pb(resp.schedule)

    def list_schedules(
        self, page_size: int = 0, page_token: str = "", *, timeout: float | None = None
    ) -> tuple[list[Schedule], str]:
        """One page of schedules by id and the next page's token ("" on the
        last page). Errors: INVALID_ARGUMENT."""
        resp = call_unary(
            "ListSchedules", self._schedules.ListSchedules,
            schedule_service_pb2.ListSchedulesRequest(page_size=page_size, page_token=page_token),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return [Schedule.from_pb(s) for s in resp.schedules], resp.next_page_token

    def pause_schedule(self, schedule_id: str, *, timeout: float | None = None) -> Schedule:
        """Pauses a schedule (its ticks are skipped, never caught up); pausing
        a paused schedule changes nothing, so retries are harmless.
        Errors: INVALID_ARGUMENT, NOT_FOUND."""
        resp = call_unary(
            "PauseSchedule", self._schedules.PauseSchedule,
            schedule_service_pb2.PauseScheduleRequest(schedule_id=schedule_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Schedule.from_pb(resp.schedule)

    def resume_schedule(self, schedule_id: str, *, timeout: float | None = None) -> Schedule:
        """Resumes a paused schedule from its next tick; resuming a running
        schedule changes nothing, so retries are harmless.
        Errors: INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION (its cron
        expression has no tick after now; it stays paused)."""
        resp = call_unary(
            "ResumeSchedule", self._schedules.ResumeSchedule,
            schedule_service_pb2.ResumeScheduleRequest(schedule_id=schedule_id),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return Schedule.from_pb(resp.schedule)

    def delete_schedule(self, schedule_id: str, *, timeout: float | None = None) -> None:
        """Deletes a schedule (its actions stay). Errors: INVALID_ARGUMENT,
        NOT_FOUND (a retry after UNAVAILABLE that finds the schedule gone
        succeeds: the lost try deleted it)."""
        call = _Counted(self._schedules.DeleteSchedule)
        try:
            call_unary(
                "DeleteSchedule", call,
                schedule_service_pb2.DeleteScheduleRequest(schedule_id=schedule_id),
                timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
            )
        except AgqError as e:
            if not (e.code == grpc.StatusCode.NOT_FOUND and call.tries > 1):
                raise

    # -- queue -----------------------------------------------------------

    def queue_stats(self, *, timeout: float | None = None) -> QueueStats:
        """Queue depths, ages and worker counts."""
        resp = call_unary(
            "GetQueueStats", self._queue.GetQueueStats,
            queue_service_pb2.GetQueueStatsRequest(),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return QueueStats.from_pb(resp)

    def peek_queue(
        self, queue: str = "ready", count: int = 10, *, timeout: float | None = None
    ) -> list[str]:
        """The next ``count`` (1..=1000) job ids of the "ready" or "scheduled"
        queue in lease order. Errors: INVALID_ARGUMENT."""
        resp = call_unary(
            "PeekQueue", self._queue.PeekQueue,
            queue_service_pb2.PeekQueueRequest(queue=queue, count=count),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return list(resp.job_ids)

    def metrics(self, format: str = "prometheus", *, timeout: float | None = None) -> str:
        """The server's metrics as text: "prometheus" or "json".
        Errors: INVALID_ARGUMENT for an unknown format."""
        resp = call_unary(
            "GetMetrics", self._queue.GetMetrics,
            queue_service_pb2.GetMetricsRequest(format=format),
            timeout=self._t(timeout), metadata=self._metadata, retry=self.retry,
        )
        return resp.body


def _check_inputs(inputs: Sequence[Mapping[str, str]]) -> None:
    """Raises TypeError for one mapping (or a string) given as ``inputs``."""
    if isinstance(inputs, (str, bytes, Mapping)):
        raise TypeError(
            "inputs is a sequence of mappings, one per job (e.g. [{\"file\": \"a\"}]), "
            f"got {type(inputs).__name__}"
        )


def _same_schedule(want: schedule_service_pb2.Schedule, got: schedule_service_pb2.Schedule) -> bool:
    """Whether the stored schedule ``got`` is the one ``want`` asked for
    (the fields a CreateSchedule sets; max_attempts 0 is the server's 3)."""

    def key(s: schedule_service_pb2.Schedule, attempts: int) -> tuple[object, ...]:
        return (
            s.schedule_id, s.plan_id, s.cron, s.time_zone,
            [dict(i.values) for i in s.inputs], attempts, s.priority,
            s.worker_selector, s.concurrency_key, s.max_running, s.catch_up,
        )

    return key(want, want.max_attempts or _DEFAULT_MAX_ATTEMPTS) == key(got, got.max_attempts)
