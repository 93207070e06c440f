"""The client against a live agq serve: plans, actions, jobs, workers,
queue, errors, watch deadlines and retries on UNAVAILABLE."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import agq
from agq.v1 import action_service_pb2, common_pb2, plan_service_pb2

from conftest import WAIT, Server, WorkerThread, wait_until


def text_worker(address: str, worker_id: str) -> agq.Worker:
    """A worker with ``upper`` (input "text" upper-cased) and ``count``
    (length of its stdin, from the task named in input_from_task)."""
    w = agq.Worker(address, worker_id, max_concurrent_jobs=4)

    @w.task()
    def upper(ctx: agq.TaskContext) -> str:
        return ctx.input["text"].upper() + "".join(ctx.args)

    @w.task("count")
    def count(ctx: agq.TaskContext) -> str:
        return str(len(ctx.stdin))

    return w


PLAN = agq.Plan(
    "py-text",
    [
        agq.Task("upper", args=["!", "{{suffix}}"], timeout_secs=30),
        agq.Task("count", timeout_secs=30, input_from_task=1),
    ],
    description="upper-case then count",
)


def test_plans_roundtrip_and_listing(client: agq.Client) -> None:
    assert client.submit_plan(PLAN) == "py-text"
    assert client.get_plan("py-text") == agq.Plan(
        "py-text", tuple(PLAN.tasks), description="upper-case then count"
    )
    assert "py-text" in client.list_plans("py-*").ids
    assert list(client.iter_plans("py-t*")) == ["py-text"]
    with pytest.raises(agq.AgqError) as e:
        client.submit_plan(agq.Plan("py-text", [agq.Task("other")]))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert client.delete_plan("py-text") is True
    with pytest.raises(agq.AgqError) as e:
        client.get_plan("py-text")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_plan_versions(client: agq.Client) -> None:
    v1 = agq.Plan("py-versions", [agq.Task("upper")], description="one")
    v2 = agq.Plan("py-versions", [agq.Task("upper"), agq.Task("count")], description="two")
    assert client.submit_plan(v1) == "py-versions"
    with pytest.raises(agq.AgqError) as e:
        client.submit_plan(v2)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert client.submit_plan(v2, replace=True) == "py-versions"
    assert client.submit_plan(v2, replace=True) == "py-versions"  # unchanged: no new version
    assert client.get_plan("py-versions") == v2
    assert client.get_plan("py-versions", version=2) == v2
    assert client.get_plan("py-versions", version=1) == v1
    with pytest.raises(agq.AgqError) as e:
        client.get_plan("py-versions", version=3)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert client.delete_plan("py-versions") is True


def test_invalid_plan_is_refused_with_the_rule(client: agq.Client) -> None:
    with pytest.raises(agq.AgqError) as e:
        client.submit_plan(agq.Plan("bad", [agq.Task("not a command")]))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "command" in e.value.details


def test_submit_watch_and_results_from_a_python_worker(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    w = start_worker(text_worker(server.address, "py-text-1"))
    w.wait_connected()
    info = client.get_worker("py-text-1")
    assert info.tools == ("count", "upper")
    assert info.state is agq.WorkerState.ACTIVE
    assert info.version.startswith("agq-python/")

    client.submit_plan(PLAN)
    texts = ["alpha", "beta", "gamma delta"]
    sub = client.submit_action("py-text", [{"text": t, "suffix": "?"} for t in texts])
    assert sub.action_id.startswith("py-")
    assert len(sub.job_ids) == 3

    seen = list(client.watch_action(sub.action_id, timeout=WAIT))
    assert seen, "the watch yields at least the current status"
    last = seen[-1]
    assert last.done and last.completed == 3 and last.total_jobs == 3
    assert last.completed_jobs_at is not None
    assert all(not s.done for s in seen[:-1])

    for job_id, text in zip(sub.job_ids, texts):
        job = client.get_job(job_id)
        assert job.status is agq.JobStatus.COMPLETED
        assert job.status.terminal
        assert job.worker_id == "py-text-1"
        assert job.attempt == 1
        assert job.input == {"text": text, "suffix": "?"}
        assert [r.task_number for r in job.task_results] == [1, 2]
        assert job.task_results[0].stdout == text.upper() + "!?"
        assert job.task_results[0].exit_code == 0
        assert job.result == str(len(text) + 2)
        assert job.completed_at is not None

    assert list(client.iter_jobs(sub.action_id, agq.JobStatus.COMPLETED)) == list(sub.job_ids)
    assert client.list_jobs(sub.action_id, agq.JobStatus.PENDING).ids == ()
    assert client.get_action(sub.action_id).completed == 3
    stats = client.queue_stats()
    # The worker is idle now: counted as idle, not as active.
    assert stats.ready_length == 0 and stats.workers_idle >= 1
    assert "agq_" in client.metrics()
    w.stop()
    assert w.exit is agq.WorkerExit.DRAINED
    assert client.get_worker("py-text-1").state is agq.WorkerState.UNREGISTERED


def test_task_exception_fails_the_job_with_the_traceback(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    w = agq.Worker(server.address, "py-fail-1")

    @w.task("explode")
    def explode(ctx: agq.TaskContext) -> str:
        ctx.log(f"about to fail on {ctx.input['n']}")
        raise ValueError(f"bad input {ctx.input['n']}")

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-explode", [agq.Task("explode", timeout_secs=10)]))
    sub = client.submit_action("py-explode", [{"n": "7"}], max_attempts=1)
    last = client.wait_action(sub.action_id, timeout=WAIT)
    assert last.dead == 1
    job = client.get_job(sub.job_ids[0])
    assert job.status is agq.JobStatus.DEAD
    assert "ValueError: bad input 7" in job.error
    (r,) = job.task_results
    assert r.exit_code == 1
    assert "about to fail on 7" in r.stderr
    assert "Traceback" in r.stderr


def test_a_permanent_failure_is_not_retried(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    w = agq.Worker(server.address, "py-perm-1")
    calls: list[str] = []

    @w.task("validate")
    def validate(ctx: agq.TaskContext) -> str:
        calls.append(ctx.input["n"])
        raise agq.PermanentFailure(f"input {ctx.input['n']} can never be valid")

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-perm", [agq.Task("validate", timeout_secs=10)]))
    sub = client.submit_action("py-perm", [{"n": "3"}], max_attempts=5)
    last = client.wait_action(sub.action_id, timeout=WAIT)
    assert last.dead == 1
    job = client.get_job(sub.job_ids[0])
    assert job.status is agq.JobStatus.DEAD
    assert job.attempt == 1, "not retried although 4 attempts were left"
    assert "permanent failure, not retried" in job.error
    assert "PermanentFailure: input 3 can never be valid" in job.error
    assert calls == ["3"]


def test_a_selector_keeps_jobs_on_matching_workers_and_priorities_show(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    plain = agq.Worker(server.address, "py-plain")
    gpu = agq.Worker(server.address, "py-gpu", tags={"gpu": "true"})
    ran_on: list[str] = []

    @plain.task("where")
    def where_plain(ctx: agq.TaskContext) -> str:
        ran_on.append("plain")
        return "plain"

    @gpu.task("where")
    def where_gpu(ctx: agq.TaskContext) -> str:
        ran_on.append("gpu")
        return "gpu"

    start_worker(plain).wait_connected()
    start_worker(gpu).wait_connected()
    client.submit_plan(agq.Plan("py-where", [agq.Task("where", timeout_secs=10)]))
    sub = client.submit_action(
        "py-where",
        [{"n": str(i)} for i in range(4)],
        priority=7,
        worker_selector="gpu=true",
        concurrency_key="py-gpu-pool",
        max_running=1,
    )
    last = client.wait_action(sub.action_id, timeout=WAIT)
    assert last.completed == 4
    assert ran_on == ["gpu"] * 4
    status = client.get_action(sub.action_id)
    assert (status.priority, status.worker_selector) == (7, "gpu=true")
    assert (status.concurrency_key, status.max_running) == ("py-gpu-pool", 1)
    assert client.get_job(sub.job_ids[0]).priority == 7
    with pytest.raises(agq.AgqError) as e:
        client.submit_action("py-where", [{"n": "x"}], worker_selector="gpu in (a")
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    pending = client.verify_worker("py-gpu", "where")
    assert pending.tool == "where" and pending.args == ("--version",)
    assert pending.answered_at is None and not pending.passed
    assert [v.challenge_id for v in client.get_worker("py-gpu").verifications] == [
        pending.challenge_id
    ]


def test_schedules_submit_an_action_per_tick(client: agq.Client) -> None:
    client.submit_plan(agq.Plan("py-sched", [agq.Task("noop", timeout_secs=10)]))
    s = client.create_schedule(
        "py-every-second", "py-sched", "* * * * * *", [{"n": "1"}], catch_up="skip", priority=3
    )
    assert s.catch_up == "skip" and s.priority == 3 and not s.paused
    assert s.next_run_at is not None
    wait_until(lambda: client.get_schedule("py-every-second").runs >= 2, "two ticks")
    paused = client.pause_schedule("py-every-second")
    assert paused.paused and paused.next_run_at is None
    assert paused.last_action_id.startswith("py-every-second-")
    assert client.get_action(paused.last_action_id).priority == 3
    listed, token = client.list_schedules()
    assert [x.schedule_id for x in listed] == ["py-every-second"] and token == ""
    assert not client.resume_schedule("py-every-second").paused
    client.delete_schedule("py-every-second")
    with pytest.raises(agq.AgqError) as e:
        client.get_schedule("py-every-second")
    assert e.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(agq.AgqError) as e:
        client.create_schedule("bad", "py-sched", "not a cron", [{"n": "1"}])
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_missing_function_and_missing_variable_fail_the_job(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    w = agq.Worker(server.address, "py-miss-1")
    w.register(lambda ctx: ctx.args[0], name="first")
    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-miss", [agq.Task("first", args=["{{nope}}"])]))
    sub = client.submit_action("py-miss", [{"yes": "1"}], max_attempts=1)
    client.wait_action(sub.action_id, timeout=WAIT)
    job = client.get_job(sub.job_ids[0])
    assert job.status is agq.JobStatus.DEAD
    assert "{{nope}}" in job.error


def test_cancel_reaches_the_running_function(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    w = agq.Worker(server.address, "py-cancel-1")

    @w.task("wait")
    def wait(ctx: agq.TaskContext) -> str:
        started.set()
        if ctx.cancelled.wait(WAIT):
            saw_cancel.set()
        ctx.check()
        return "not cancelled"

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-wait", [agq.Task("wait", timeout_secs=120)]))
    sub = client.submit_action("py-wait", [{}])
    assert started.wait(WAIT)
    job = client.cancel_job(sub.job_ids[0])
    assert job.status is agq.JobStatus.CANCELLED
    assert saw_cancel.wait(WAIT), "the function saw ctx.cancelled"
    assert client.wait_action(sub.action_id, timeout=WAIT).cancelled == 1
    assert client.get_job(sub.job_ids[0]).status is agq.JobStatus.CANCELLED


def test_errors_carry_the_grpc_status(client: agq.Client) -> None:
    with pytest.raises(agq.AgqError) as e:
        client.get_job("no-such-job")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert e.value.method == "GetJob"
    with pytest.raises(agq.AgqError) as e:
        client.submit_action("no-such-plan", [{"a": "b"}])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(agq.AgqError) as e:
        client.peek_queue("bogus")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_watch_is_bounded_by_its_timeout(client: agq.Client) -> None:
    client.submit_plan(agq.Plan("py-nobody", [agq.Task("nobody-has-this")]))
    sub = client.submit_action("py-nobody", [{}])
    statuses: list[agq.ActionStatus] = []
    with pytest.raises(agq.AgqError) as e:
        for s in client.watch_action(sub.action_id, timeout=1.0):
            statuses.append(s)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert statuses and statuses[0].pending == 1
    job = client.get_job(sub.job_ids[0])
    assert job.status is agq.JobStatus.PENDING
    assert "nobody-has-this" in job.waiting_reason


def test_raw_stubs_share_the_channel(client: agq.Client) -> None:
    from agq.v1 import plan_service_pb2_grpc

    stub = plan_service_pb2_grpc.PlanServiceStub(client.channel)
    resp = stub.ListPlans(plan_service_pb2.ListPlansRequest(), timeout=10)
    assert list(resp.plan_ids) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_unavailable_is_retried_until_the_server_is_up(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    with agq.Client(address, timeout=2, retry=agq.RetryPolicy(attempts=1)) as c:
        with pytest.raises(agq.AgqError) as e:
            c.queue_stats()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

    result: list[object] = []
    patient = agq.Client(
        address, timeout=2,
        retry=agq.RetryPolicy(attempts=100, initial_backoff=0.05, max_backoff=0.2),
    )

    def call() -> None:
        try:
            result.append(patient.queue_stats())
        except BaseException as e:  # noqa: BLE001 - asserted below
            result.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive(), "the call keeps retrying while nothing listens"
    server = Server(tmp_path / "late", listen=address)
    try:
        t.join(WAIT)
        assert not t.is_alive()
        assert isinstance(result[0], agq.QueueStats), result
    finally:
        patient.close()
        server.stop()


def test_task_timeout_fails_the_attempt_even_if_the_function_ignores_it(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    release = threading.Event()
    w = agq.Worker(server.address, "py-slow-1")

    @w.task("stubborn")
    def stubborn(ctx: agq.TaskContext) -> str:
        release.wait(WAIT)  # ignores ctx.cancelled on purpose
        return "too late"

    start_worker(w).wait_connected()
    try:
        client.submit_plan(agq.Plan("py-stubborn", [agq.Task("stubborn", timeout_secs=1)]))
        sub = client.submit_action("py-stubborn", [{}], max_attempts=1)
        assert client.wait_action(sub.action_id, timeout=WAIT).dead == 1
        job = client.get_job(sub.job_ids[0])
        assert "timed out after 1 s" in job.error
        assert job.task_results[0].exit_code == -1
    finally:
        release.set()


def test_idle_worker_keeps_heartbeating(
    server: Server, client: agq.Client, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    start_worker(text_worker(server.address, "py-beat-1")).wait_connected()
    beats: set[object] = set()

    def new_beat() -> bool:
        info = client.get_worker("py-beat-1")
        assert info.fresh and info.connected and info.state is agq.WorkerState.ACTIVE
        beats.add(info.last_heartbeat_at)
        return len(beats) >= 4

    # The server's interval is 500 ms: several heartbeats arrive, and the
    # worker stays fresh (younger than 3 x the interval) throughout.
    wait_until(new_beat, "three heartbeats after the first")
    assert client.queue_stats().workers_idle == 1


class _EndedEarly:
    """A WatchAction call that sends ``statuses`` and ends without an
    error (as a proxy's or a server's stream cut may)."""

    def __init__(self, statuses: list[common_pb2.ActionStatus]) -> None:
        self._statuses = statuses

    def __iter__(self) -> Iterator[action_service_pb2.WatchActionResponse]:
        for a in self._statuses:
            yield action_service_pb2.WatchActionResponse(action=a)

    def cancel(self) -> bool:
        return True


def test_a_watch_stream_that_ends_before_the_action_is_done_is_reopened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """wait_action returns only a status in which every job is terminal: a
    stream that ends cleanly before that is reopened (per the retry
    policy), not taken for the end of the action."""
    running = common_pb2.ActionStatus(action_id="a", plan_id="p", total_jobs=1, running=1)
    done = common_pb2.ActionStatus(action_id="a", plan_id="p", total_jobs=1, completed=1)
    streams = [[running], [running, done]]
    opened: list[float | None] = []

    def watch(req: Any, timeout: float | None = None, metadata: Any = None) -> _EndedEarly:
        opened.append(timeout)
        return _EndedEarly(streams[len(opened) - 1])

    with agq.Client("127.0.0.1:9", retry=agq.RetryPolicy(initial_backoff=0.01)) as c:
        monkeypatch.setattr(c._actions, "WatchAction", watch)
        last = c.wait_action("a", timeout=WAIT)
        assert last.done and last.completed == 1
        assert len(opened) == 2
        streams[:] = [[]] * 10  # nothing sent: the retry budget is not renewed
        opened.clear()
        with pytest.raises(agq.AgqError) as e:
            c.wait_action("a", timeout=WAIT)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "ended" in e.value.details
        assert len(opened) == 5  # the policy's attempts


def test_a_string_for_a_sequence_is_refused() -> None:
    """A str where a sequence of them is expected is not split into its
    characters: Task(args="x y") and submit_action(inputs={...}) (one
    mapping, not a sequence of them) raise TypeError naming the field."""
    with pytest.raises(TypeError, match="args"):
        agq.Task("echo", args="hello world")
    with agq.Client("127.0.0.1:9") as c:
        with pytest.raises(TypeError, match="inputs"):
            c.submit_action("p", {"text": "hi"})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="inputs"):
            c.create_schedule("s", "p", "0 * * * *", {"text": "hi"})  # type: ignore[arg-type]


def test_timeouts_are_checked_before_any_call(server: Server) -> None:
    # A deadline gRPC cannot represent failed every call at once with
    # DEADLINE_EXCEEDED; a per-call timeout was not checked at all.
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e10):
        with pytest.raises(ValueError, match="timeout must be"):
            agq.Client(server.address, timeout=bad)
    with agq.Client(server.address, timeout=agq.client.MAX_TIMEOUT) as c:
        assert c.list_plans().ids == ()
        for bad in (0.0, -1.0, float("nan"), float("inf"), 1e10):
            with pytest.raises(ValueError, match="timeout must be"):
                c.get_plan("p", timeout=bad)
        with pytest.raises(agq.AgqError) as e:
            c.get_plan("p", timeout=agq.client.MAX_TIMEOUT)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_a_report_too_big_even_without_outputs_still_ends_the_job(
    tmp_path: Path, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    # The error alone (the exception's 3 KB message) is over the server's
    # --max-report-bytes: the report goes again with its outcome only and
    # the job ends; it was retried for good and the job timed out.
    server = Server(tmp_path / "small-reports", extra=["--max-report-bytes", "1024"])
    try:
        w = agq.Worker(server.address, "py-big-report")

        @w.task("shout")
        def shout(ctx: agq.TaskContext) -> str:
            raise ValueError("x" * 3000)

        start_worker(w).wait_connected()
        with agq.Client(server.address, timeout=10) as c:
            c.submit_plan(agq.Plan("py-shout", [agq.Task("shout", timeout_secs=10)]))
            sub = c.submit_action("py-shout", [{}], max_attempts=1)
            last = c.wait_action(sub.action_id, timeout=WAIT)
            assert last.dead == 1
            job = c.get_job(sub.job_ids[0])
            assert "timed out" not in job.error, job.error
            assert job.error, job
    finally:
        server.stop()
