"""Retries on UNAVAILABLE that cannot duplicate work: a reply lost after
the server acted is retried, and the retry's ALREADY_EXISTS (or NOT_FOUND,
FAILED_PRECONDITION) is resolved; RetryJob and RetryAction are never sent
twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

import agq

from conftest import WAIT, WorkerThread, wait_until


class LostReply(grpc.RpcError):
    """What grpc raises when the connection drops before the reply."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset (test)"


def flaky(real: Any, calls: list[Any]) -> Any:
    """Wraps a stub method: the first call reaches the server but its reply is lost."""

    def call(req: Any, timeout: float | None = None, metadata: Any = None, **kw: Any) -> Any:
        calls.append(req)
        resp = real(req, timeout=timeout, metadata=metadata, **kw)
        if len(calls) == 1:
            raise LostReply()
        return resp

    return call


def dropped(real: Any, calls: list[Any]) -> Any:
    """Wraps a stub method: the first call is lost before it reaches the server."""

    def call(req: Any, timeout: float | None = None, metadata: Any = None, **kw: Any) -> Any:
        calls.append(req)
        if len(calls) == 1:
            raise LostReply()
        return real(req, timeout=timeout, metadata=metadata, **kw)

    return call


FAST = agq.RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05)


def test_submit_action_retried_after_a_lost_reply_creates_it_once(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-once", [agq.Task("nobody")]))
    calls: list[Any] = []
    monkeypatch.setattr(client._actions, "SubmitAction",
                        flaky(client._actions.SubmitAction, calls))
    sub = client.submit_action("py-once", [{"i": "1"}, {"i": "2"}])
    assert len(calls) == 2 and calls[0].action_id == calls[1].action_id == sub.action_id
    assert len(sub.job_ids) == 2
    assert client.get_action(sub.action_id).total_jobs == 2
    assert [client.get_job(j).input["i"] for j in sub.job_ids] == ["1", "2"]


def test_submit_plan_retried_after_a_lost_reply_succeeds(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    calls: list[Any] = []
    monkeypatch.setattr(client._plans, "SubmitPlan", flaky(client._plans.SubmitPlan, calls))
    assert client.submit_plan(agq.Plan("py-plan-once", [agq.Task("x")])) == "py-plan-once"
    assert len(calls) == 2


def test_unavailable_is_raised_after_the_last_attempt(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[Any] = []

    def down(req: Any, timeout: float | None = None, metadata: Any = None) -> Any:
        tries.append(req)
        raise LostReply()

    client.retry = FAST
    monkeypatch.setattr(client._jobs, "GetJob", down)
    with pytest.raises(agq.AgqError) as e:
        client.get_job("x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(tries) == 3


def test_cancel_job_retried_after_a_lost_reply_returns_the_cancelled_job(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-cancel-once", [agq.Task("nobody")]))
    job_id = client.submit_action("py-cancel-once", [{}]).job_ids[0]
    calls: list[Any] = []
    monkeypatch.setattr(client._jobs, "CancelJob", flaky(client._jobs.CancelJob, calls))
    job = client.cancel_job(job_id)
    assert len(calls) == 2
    assert job.job_id == job_id and job.status is agq.JobStatus.CANCELLED
    # Without a lost reply, cancelling an ended job is still refused.
    monkeypatch.undo()
    with pytest.raises(agq.AgqError) as e:
        client.cancel_job(job_id)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_retry_job_is_not_sent_twice_after_a_lost_reply(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    w = agq.Worker(client.address, "py-failing")

    @w.task("fail")
    def fail(ctx: agq.TaskContext) -> str:
        raise agq.PermanentFailure("no")

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-retry-once", [agq.Task("fail")]))
    job_id = client.submit_action("py-retry-once", [{}]).job_ids[0]
    wait_until(lambda: client.get_job(job_id).status is agq.JobStatus.DEAD, "the job to die")
    client.retry = FAST
    calls: list[Any] = []
    monkeypatch.setattr(client._jobs, "RetryJob", flaky(client._jobs.RetryJob, calls))
    with pytest.raises(agq.AgqError) as e:
        client.retry_job(job_id)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "may have reached the server" in e.value.details
    assert len(calls) == 1, "RetryJob was sent again"
    # The one try went through: the job runs (and dies) once more.
    wait_until(lambda: client.get_job(job_id).attempt == 1
               and client.get_job(job_id).status is agq.JobStatus.DEAD, "the retried job")
    assert client.get_action(client.get_job(job_id).action_id).dead == 1


def test_create_schedule_retried_after_a_lost_reply_returns_it(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-sched", [agq.Task("nobody")]))
    real = client._schedules.CreateSchedule
    calls: list[Any] = []
    monkeypatch.setattr(client._schedules, "CreateSchedule", flaky(real, calls))
    s = client.create_schedule("py-nightly", "py-sched", "0 0 2 * * *", [{"a": "1"}],
                               catch_up="latest")
    assert len(calls) == 2
    assert s.schedule_id == "py-nightly" and s.cron == "0 0 2 * * *"
    assert s.catch_up == "latest" and s.inputs == ({"a": "1"},)
    # A different schedule already under the id is still ALREADY_EXISTS,
    # even on a retry.
    calls.clear()
    monkeypatch.setattr(client._schedules, "CreateSchedule", dropped(real, calls))
    with pytest.raises(agq.AgqError) as e:
        client.create_schedule("py-nightly", "py-sched", "0 0 3 * * *", [{"a": "1"}],
                               catch_up="latest")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(calls) == 2


def test_delete_schedule_retried_after_a_lost_reply_succeeds(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-doomed-plan", [agq.Task("nobody")]))
    client.create_schedule("py-doomed-sched", "py-doomed-plan", "0 0 2 * * *", [{}])
    calls: list[Any] = []
    monkeypatch.setattr(client._schedules, "DeleteSchedule",
                        flaky(client._schedules.DeleteSchedule, calls))
    client.delete_schedule("py-doomed-sched")
    assert len(calls) == 2
    monkeypatch.undo()
    for call in (lambda: client.get_schedule("py-doomed-sched"),
                 lambda: client.delete_schedule("py-doomed-sched")):
        with pytest.raises(agq.AgqError) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_delete_plan_retried_after_a_lost_reply_succeeds(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-doomed-plan", [agq.Task("nobody")]))
    calls: list[Any] = []
    monkeypatch.setattr(client._plans, "DeletePlan", flaky(client._plans.DeletePlan, calls))
    assert client.delete_plan("py-doomed-plan") is True
    assert len(calls) == 2
    monkeypatch.undo()
    for call in (lambda: client.get_plan("py-doomed-plan"),
                 lambda: client.delete_plan("py-doomed-plan")):
        with pytest.raises(agq.AgqError) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_cancel_action_retried_after_a_lost_reply_says_it_was_resent(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-cancel-all", [agq.Task("nobody")]))
    lost = client.submit_action("py-cancel-all", [{}, {}, {}]).action_id
    real = client._actions.CancelAction
    calls: list[Any] = []
    monkeypatch.setattr(client._actions, "CancelAction", flaky(real, calls))
    res = client.cancel_action(lost)
    # The lost try cancelled the jobs; the retry found none open.
    assert len(calls) == 2
    assert res.resent and res.cancelled == 0
    assert res.action.cancelled == 3 and res.action.done
    # A try lost before it reached the server: the retry cancels them.
    dropped_first = client.submit_action("py-cancel-all", [{}, {}]).action_id
    calls.clear()
    monkeypatch.setattr(client._actions, "CancelAction", dropped(real, calls))
    res = client.cancel_action(dropped_first)
    assert len(calls) == 2
    assert res.resent and res.cancelled == 2 and res.action.cancelled == 2


def test_retry_action_is_not_sent_twice_after_a_lost_reply(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    w = agq.Worker(client.address, "py-failing-all")

    @w.task("fail")
    def fail(ctx: agq.TaskContext) -> str:
        raise agq.PermanentFailure("no")

    t = start_worker(w)
    t.wait_connected()
    client.submit_plan(agq.Plan("py-retry-all-once", [agq.Task("fail")]))
    action_id = client.submit_action("py-retry-all-once", [{}, {}]).action_id
    assert client.wait_action(action_id, timeout=WAIT).dead == 2
    t.stop()  # the retried jobs then stay pending
    client.retry = FAST
    calls: list[Any] = []
    monkeypatch.setattr(client._actions, "RetryAction",
                        flaky(client._actions.RetryAction, calls))
    with pytest.raises(agq.AgqError) as e:
        client.retry_action(action_id)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "may have reached the server" in e.value.details
    assert f"get_action({action_id!r})" in e.value.details
    assert len(calls) == 1, "RetryAction was sent again"
    # The one try went through: both jobs are pending again.
    status = client.get_action(action_id)
    assert (status.pending, status.dead) == (2, 0)


def test_forget_worker_retried_after_a_lost_reply_succeeds(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    w = agq.Worker(client.address, "py-forgotten")
    w.register(lambda ctx: "x", name="x")
    t = start_worker(w)
    t.wait_connected()
    t.stop()
    client.retry = FAST
    calls: list[Any] = []
    monkeypatch.setattr(client._workers, "ForgetWorker",
                        flaky(client._workers.ForgetWorker, calls))
    client.forget_worker("py-forgotten")
    assert len(calls) == 2
    monkeypatch.undo()
    for call in (lambda: client.get_worker("py-forgotten"),
                 lambda: client.forget_worker("py-forgotten")):
        with pytest.raises(agq.AgqError) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_submit_action_retried_does_not_take_another_action_with_its_id_for_its_own(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry after a first try that never reached the server is answered
    ALREADY_EXISTS because the caller's action_id was taken already, by an
    action of another plan: that is raised, not returned as if this call
    had created it."""
    client.retry = FAST
    client.submit_plan(agq.Plan("py-taken-first", [agq.Task("nobody")]))
    client.submit_plan(agq.Plan("py-taken-second", [agq.Task("nobody")]))
    client.submit_action("py-taken-first", [{"i": "1"}], action_id="py-taken")
    calls: list[Any] = []
    monkeypatch.setattr(client._actions, "SubmitAction",
                        dropped(client._actions.SubmitAction, calls))
    with pytest.raises(agq.AgqError) as e:
        client.submit_action("py-taken-second", [{"i": "1"}, {"i": "2"}], action_id="py-taken")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(calls) == 2
    assert client.get_action("py-taken").plan_id == "py-taken-first"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attempts", 0),
        ("initial_backoff", -1.0),
        ("initial_backoff", float("nan")),
        ("max_backoff", -0.5),
        ("max_backoff", float("inf")),
        ("multiplier", 0.5),
    ],
)
def test_a_retry_policy_out_of_range_is_refused_by_name(field: str, value: float) -> None:
    """A negative backoff failed only at the first retry, inside the call,
    with time.sleep's "sleep length must be non-negative"; attempts=0
    silently meant 1."""
    with pytest.raises(ValueError, match=field):
        agq.RetryPolicy(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_a_client_timeout_out_of_range_is_refused(timeout: float) -> None:
    """A timeout that is not > 0 made every call fail with DEADLINE_EXCEEDED."""
    with pytest.raises(ValueError, match="timeout"):
        agq.Client("127.0.0.1:9", timeout=timeout)
