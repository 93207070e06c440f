"""The client's listings and bulk calls against a live agq serve: actions
listed and iterated page by page, cancelled and retried as a whole, a
plan's versions, and forgetting a departed worker."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import grpc
import pytest

import agq

from conftest import WAIT, Server, WorkerThread, wait_until


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The gRPC status of the AgqError ``call`` raises."""
    with pytest.raises(agq.AgqError) as e:
        call()
    return e.value.code


def test_list_and_iterate_actions_page_by_page(client: agq.Client) -> None:
    # Nobody runs these tasks: the jobs stay pending.
    client.submit_plan(agq.Plan("py-list-a", [agq.Task("nobody")]))
    client.submit_plan(agq.Plan("py-list-b", [agq.Task("nobody")]))
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    a_ids = [client.submit_action("py-list-a", [{"i": str(i)}] * (i + 1),
                                  action_id=f"py-a-{i}").action_id for i in range(5)]
    b_ids = [client.submit_action("py-list-b", [{}], action_id=f"py-b-{i}").action_id
             for i in range(2)]
    newest_first = list(reversed(a_ids + b_ids))

    # Every action, two per page, newest first.
    pages: list[agq.ActionPage] = []
    token = ""
    while True:
        page = client.list_actions(page_size=2, page_token=token)
        pages.append(page)
        token = page.next_page_token
        if not token:
            break
    assert [len(p.actions) for p in pages] == [2, 2, 2, 1]
    listed = [a for p in pages for a in p.actions]
    assert [a.action_id for a in listed] == newest_first
    a3 = next(a for a in listed if a.action_id == "py-a-3")
    assert (a3.plan_id, a3.total_jobs, a3.pending, a3.done) == ("py-list-a", 4, 4, False)
    assert a3.created_at is not None and a3.created_at >= before

    # One plan's actions; the iterator follows the pages.
    first = client.list_actions("py-list-a", page_size=3)
    assert [a.action_id for a in first.actions] == ["py-a-4", "py-a-3", "py-a-2"]
    rest = client.list_actions("py-list-a", page_size=3, page_token=first.next_page_token)
    assert [a.action_id for a in rest.actions] == ["py-a-1", "py-a-0"]
    assert rest.next_page_token == ""
    assert [a.action_id for a in client.iter_actions("py-list-b")] == ["py-b-1", "py-b-0"]
    assert [a.action_id for a in client.iter_actions()] == newest_first

    # By state: a cancelled action is finished, the others are open.
    client.cancel_action("py-a-1")
    assert [a.action_id for a in client.iter_actions(state=agq.ActionState.FINISHED)] == [
        "py-a-1"
    ]
    open_ids = [a.action_id for a in client.iter_actions("py-list-a", agq.ActionState.OPEN)]
    assert open_ids == ["py-a-4", "py-a-3", "py-a-2", "py-a-0"]
    assert list(client.iter_actions(state=agq.ActionState.HAS_DEAD)) == []

    # By creation time.
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert [a.action_id for a in client.iter_actions(created_after=before)] == newest_first
    assert list(client.iter_actions(created_after=later)) == []
    assert list(client.iter_actions(created_before=before)) == []

    # Errors.
    assert code_of(lambda: client.list_actions(page_size=1001)) is (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert code_of(lambda: client.list_actions(created_after=later, created_before=before)) is (
        grpc.StatusCode.INVALID_ARGUMENT)
    # A token is valid only with the filters of its first page.
    assert code_of(lambda: client.list_actions(
        "py-list-b", page_size=3, page_token=first.next_page_token
    )) is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        client.list_actions(created_after=datetime(2024, 1, 1))


def test_cancel_action_cancels_its_open_jobs(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    w = agq.Worker(server.address, "py-bulk-cancel", max_concurrent_jobs=1)

    @w.task("wait")
    def wait(ctx: agq.TaskContext) -> str:
        started.set()
        if ctx.cancelled.wait(WAIT):
            saw_cancel.set()
        ctx.check()
        return "not cancelled"

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-bulk-wait", [agq.Task("wait", timeout_secs=120)]))
    sub = client.submit_action("py-bulk-wait", [{"n": str(i)} for i in range(3)])
    assert started.wait(WAIT)
    wait_until(lambda: client.get_action(sub.action_id).running == 1, "one job to run")

    # One running and two pending jobs: all three are cancelled.
    res = client.cancel_action(sub.action_id)
    assert res.cancelled == 3 and not res.resent
    assert res.action.action_id == sub.action_id
    assert (res.action.cancelled, res.action.pending, res.action.running) == (3, 0, 0)
    assert res.action.done
    assert saw_cancel.wait(WAIT), "the running function saw ctx.cancelled"
    for job_id in sub.job_ids:
        assert client.get_job(job_id).status is agq.JobStatus.CANCELLED
    assert list(client.iter_jobs(sub.action_id, agq.JobStatus.CANCELLED)) == list(sub.job_ids)

    # Nothing open is left: nothing changes.
    again = client.cancel_action(sub.action_id)
    assert again.cancelled == 0 and again.action.cancelled == 3
    assert code_of(lambda: client.cancel_action("py-no-such-action")) is (
        grpc.StatusCode.NOT_FOUND)


def test_retry_action_puts_its_dead_jobs_back(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    fixed = threading.Event()
    runs: list[str] = []
    w = agq.Worker(server.address, "py-bulk-retry", max_concurrent_jobs=4)

    @w.task("fragile")
    def fragile(ctx: agq.TaskContext) -> str:
        runs.append(ctx.input["n"])
        if not fixed.is_set():
            raise agq.PermanentFailure("not yet")
        return "ok " + ctx.input["n"]

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-fragile", [agq.Task("fragile", timeout_secs=10)]))
    sub = client.submit_action("py-fragile", [{"n": str(i)} for i in range(3)], max_attempts=1)
    assert client.wait_action(sub.action_id, timeout=WAIT).dead == 3
    assert [a.action_id for a in client.iter_actions(state=agq.ActionState.HAS_DEAD)] == [
        sub.action_id
    ]

    # Only failed jobs (waiting for a next attempt): there are none.
    none = client.retry_action(sub.action_id, agq.JobStatus.FAILED)
    assert none.retried == 0 and none.action.dead == 3
    assert code_of(lambda: client.retry_action(sub.action_id, agq.JobStatus.COMPLETED)) is (
        grpc.StatusCode.INVALID_ARGUMENT)

    fixed.set()
    res = client.retry_action(sub.action_id, agq.JobStatus.DEAD)
    assert res.retried == 3
    assert res.action.dead == 0 and res.action.action_id == sub.action_id
    last = client.wait_action(sub.action_id, timeout=WAIT)
    assert (last.completed, last.dead) == (3, 0)
    for i, job_id in enumerate(sub.job_ids):
        assert client.get_job(job_id).result == f"ok {i}"
    assert sorted(runs) == ["0", "0", "1", "1", "2", "2"]
    assert client.list_actions(state=agq.ActionState.HAS_DEAD).actions == ()

    # Nothing failed or dead is left: nothing changes.
    again = client.retry_action(sub.action_id)
    assert again.retried == 0 and again.action.completed == 3
    assert code_of(lambda: client.retry_action("py-no-such-action")) is (
        grpc.StatusCode.NOT_FOUND)


def test_list_plan_versions_after_replacing_the_plan(client: agq.Client) -> None:
    tasks = [agq.Task("a"), agq.Task("b"), agq.Task("c")]
    for n in (1, 2, 3):
        plan = agq.Plan("py-versioned", tasks[:n], description=f"v{n}")
        assert client.submit_plan(plan, replace=n > 1) == "py-versioned"
    # Replacing with the latest version stores nothing.
    client.submit_plan(agq.Plan("py-versioned", tasks, description="v3"), replace=True)

    first = client.list_plan_versions("py-versioned", page_size=2)
    assert [v.version for v in first.versions] == [3, 2]
    assert first.next_page_token != ""
    rest = client.list_plan_versions("py-versioned", page_size=2,
                                     page_token=first.next_page_token)
    assert [v.version for v in rest.versions] == [1] and rest.next_page_token == ""

    versions = list(client.iter_plan_versions("py-versioned"))
    assert [(v.version, v.description, v.task_count) for v in versions] == [
        (3, "v3", 3), (2, "v2", 2), (1, "v1", 1)
    ]
    stamps = [v.created_at for v in versions if v.created_at is not None]
    assert len(stamps) == 3 and stamps == sorted(stamps, reverse=True)
    for v in versions:
        assert client.get_plan("py-versioned", version=v.version).description == v.description

    assert code_of(lambda: client.list_plan_versions("py-no-such-plan")) is (
        grpc.StatusCode.NOT_FOUND)
    assert code_of(lambda: client.list_plan_versions("bad id!")) is (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert code_of(lambda: client.list_plan_versions("py-versioned", page_size=1001)) is (
        grpc.StatusCode.INVALID_ARGUMENT)


def test_forget_worker_deletes_a_departed_worker_only(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    w = agq.Worker(server.address, "py-forget-me")
    w.register(lambda ctx: "x", name="x")
    t = start_worker(w)
    t.wait_connected()

    # A live worker is refused: unregister (or drain) it first.
    with pytest.raises(agq.AgqError) as e:
        client.forget_worker("py-forget-me")
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "ACTIVE" in e.value.details
    assert client.get_worker("py-forget-me").state is agq.WorkerState.ACTIVE

    t.stop()
    assert client.get_worker("py-forget-me").state is agq.WorkerState.UNREGISTERED
    client.forget_worker("py-forget-me")
    assert code_of(lambda: client.get_worker("py-forget-me")) is grpc.StatusCode.NOT_FOUND
    assert "py-forget-me" not in [x.worker_id for x in client.list_workers()]
    # Forgetting it again: it is unknown now.
    assert code_of(lambda: client.forget_worker("py-forget-me")) is grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.forget_worker("bad id!")) is grpc.StatusCode.INVALID_ARGUMENT
