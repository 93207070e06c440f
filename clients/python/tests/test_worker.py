"""The Python worker SDK as separate processes: a SIGKILLed worker's job is
re-leased to another worker and completes; SIGTERM drains."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import agq
from agq.v1 import common_pb2, worker_service_pb2

from conftest import WAIT, Server, WorkerThread, spawn_worker, wait_until
from worker_proc import build

BLOCK = agq.Plan("py-block", [agq.Task("block", timeout_secs=120)])


def stop_proc(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(timeout=WAIT)


def test_killed_worker_job_is_released_to_another_worker(
    server: Server, client: agq.Client, tmp_path: Path,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    proc = spawn_worker(server.address, "py-doomed", tmp_path)
    try:
        wait_until(lambda: any(w.worker_id == "py-doomed" and w.connected
                               for w in client.list_workers()), "py-doomed to connect")
        client.submit_plan(BLOCK)
        sub = client.submit_action("py-block", [{}], max_attempts=3)
        job_id = sub.job_ids[0]
        marker = tmp_path / f"started-{job_id}"
        wait_until(marker.exists, "the job to start on py-doomed")
        running = client.get_job(job_id)
        assert running.status is agq.JobStatus.RUNNING
        assert running.worker_id == "py-doomed"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL
    finally:
        stop_proc(proc)

    (tmp_path / "release").write_text("go")
    rescuer = start_worker(build(server.address, "py-rescuer", tmp_path, None, 30.0))
    rescuer.wait_connected()
    last = client.wait_action(sub.action_id, timeout=WAIT)
    assert last.completed == 1
    job = client.get_job(job_id)
    assert job.status is agq.JobStatus.COMPLETED
    assert job.worker_id == "py-rescuer"
    assert job.attempt == 2
    assert job.result == "released by py-rescuer"
    doomed = client.get_worker("py-doomed")
    assert not doomed.connected
    wait_until(lambda: not client.get_worker("py-doomed").fresh, "py-doomed to go stale")


def test_sigterm_drains_running_jobs_then_unregisters(
    server: Server, client: agq.Client, tmp_path: Path
) -> None:
    proc = spawn_worker(server.address, "py-drain", tmp_path)
    try:
        wait_until(lambda: any(w.worker_id == "py-drain" and w.connected
                               for w in client.list_workers()), "py-drain to connect")
        client.submit_plan(BLOCK)
        sub = client.submit_action("py-block", [{}])
        job_id = sub.job_ids[0]
        wait_until((tmp_path / f"started-{job_id}").exists, "the job to start")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: client.get_worker("py-drain").state is agq.WorkerState.DRAINING,
                   "py-drain to be DRAINING")
        # Draining: the job is still running and the process still there.
        assert proc.poll() is None
        assert client.get_job(job_id).status is agq.JobStatus.RUNNING
        # A job submitted now is not given to the draining worker.
        later = client.submit_action("py-block", [{}])
        (tmp_path / "release").write_text("go")
        assert proc.wait(timeout=WAIT) == 0
        job = client.get_job(job_id)
        assert job.status is agq.JobStatus.COMPLETED
        assert job.result == "released by py-drain"
        assert client.get_worker("py-drain").state is agq.WorkerState.UNREGISTERED
        assert client.get_job(later.job_ids[0]).status is agq.JobStatus.PENDING
        assert not (tmp_path / f"started-{later.job_ids[0]}").exists()
    finally:
        stop_proc(proc)


def test_drain_timeout_stops_a_stuck_job(
    server: Server, client: agq.Client, tmp_path: Path
) -> None:
    proc = spawn_worker(server.address, "py-stuck", tmp_path, "--drain-timeout", "0.5")
    try:
        wait_until(lambda: any(w.worker_id == "py-stuck" and w.connected
                               for w in client.list_workers()), "py-stuck to connect")
        client.submit_plan(BLOCK)
        sub = client.submit_action("py-block", [{}], max_attempts=1)
        job_id = sub.job_ids[0]
        wait_until((tmp_path / f"started-{job_id}").exists, "the job to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        job = client.get_job(job_id)
        assert job.status is agq.JobStatus.DEAD
        assert "drain timeout" in job.error
        assert client.get_worker("py-stuck").state is agq.WorkerState.UNREGISTERED
    finally:
        stop_proc(proc)


def test_second_signal_exits_at_once(
    server: Server, client: agq.Client, tmp_path: Path
) -> None:
    proc = spawn_worker(server.address, "py-hurry", tmp_path)
    try:
        wait_until(lambda: any(w.worker_id == "py-hurry" and w.connected
                               for w in client.list_workers()), "py-hurry to connect")
        client.submit_plan(BLOCK)
        sub = client.submit_action("py-block", [{}])
        wait_until((tmp_path / f"started-{sub.job_ids[0]}").exists, "the job to start")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: client.get_worker("py-hurry").state is agq.WorkerState.DRAINING,
                   "py-hurry to be DRAINING")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 130
    finally:
        stop_proc(proc)


def test_worker_keeps_its_job_across_a_server_restart(
    tmp_path: Path, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    first = Server(tmp_path / "server", ["--shutdown-grace-secs", "1"])
    address = first.address
    second: Server | None = None
    try:
        with agq.Client(address, timeout=10) as client:
            w = start_worker(build(address, "py-steady", tmp_path, None, 30.0))
            w.wait_connected()
            client.submit_plan(BLOCK)
            sub = client.submit_action("py-block", [{}])
            job_id = sub.job_ids[0]
            wait_until((tmp_path / f"started-{job_id}").exists, "the job to start")
            first.stop()
            wait_until(lambda: not w.worker.connected.is_set(), "the worker to notice")
            # Same database, same port: the worker reconnects, lists its
            # lease in held_leases and keeps the job.
            second = Server(tmp_path / "server", ["--shutdown-grace-secs", "1"], listen=address)
            w.wait_connected()
            (tmp_path / "release").write_text("go")
            assert client.wait_action(sub.action_id, timeout=WAIT).completed == 1
            job = client.get_job(job_id)
            assert job.attempt == 1, "the job was not re-leased"
            assert job.result == "released by py-steady"
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_jobs_run_concurrently_up_to_max_concurrent_jobs(
    server: Server, client: agq.Client, tmp_path: Path,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    # build() makes a worker with max_concurrent_jobs=2.
    w = start_worker(build(server.address, "py-pair", tmp_path, None, 30.0))
    w.wait_connected()
    client.submit_plan(BLOCK)
    sub = client.submit_action("py-block", [{}, {}, {}])

    def started() -> list[str]:
        return [j for j in sub.job_ids if (tmp_path / f"started-{j}").exists()]

    wait_until(lambda: len(started()) == 2, "two jobs running at once")
    assert client.get_worker("py-pair").active_leases == 2
    assert client.get_action(sub.action_id).pending == 1
    (tmp_path / "release").write_text("go")
    assert client.wait_action(sub.action_id, timeout=WAIT).completed == 3


def test_a_cancel_stops_only_the_attempt_it_names() -> None:
    """A cancel of an attempt the worker no longer runs (the job was leased
    to it again and the new lease came first) leaves the new attempt
    running; one naming the running lease, or no lease (an older server),
    stops it."""
    from agq.worker import _Running

    def cancel(job_id: str, lease_id: str) -> worker_service_pb2.HeartbeatResponse:
        return worker_service_pb2.HeartbeatResponse(cancel_job_id=job_id,
                                                    cancel_lease_id=lease_id)

    w = agq.Worker("127.0.0.1:9", "py-cancel")
    newer = _Running("lease-2")
    w._jobs["j"] = newer
    w._on_heartbeat(cancel("j", "lease-1"))
    assert not newer.cancel.is_set()
    w._on_heartbeat(cancel("j", "lease-2"))
    assert newer.cancel.is_set() and newer.reason == "cancelled"
    unnamed = _Running("lease-3")
    w._jobs["k"] = unnamed
    w._on_heartbeat(cancel("k", ""))
    assert unnamed.cancel.is_set()


class _Unavailable(grpc.RpcError):
    """What the server answers while its store cannot commit."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the store cannot commit (test); retry with backoff"


class _RecordingStub:
    """The worker service as far as UpdateJob: records each final report
    (not the RUNNING progress reports) and answers UNAVAILABLE while
    ``failing`` is set."""

    def __init__(self, failing: threading.Event | None = None) -> None:
        self.finals: list[worker_service_pb2.UpdateJobRequest] = []
        self._failing = failing
        self._lock = threading.Lock()

    def UpdateJob(
        self, req: worker_service_pb2.UpdateJobRequest, timeout: float | None = None,
        metadata: Any = None,
    ) -> worker_service_pb2.UpdateJobResponse:
        if req.status != common_pb2.JOB_STATUS_RUNNING:
            with self._lock:
                self.finals.append(req)
            if self._failing is not None and self._failing.is_set():
                raise _Unavailable()
        return worker_service_pb2.UpdateJobResponse(status=req.status)


def test_a_final_report_is_retried_past_the_lease_expiry_until_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A result the server cannot take yet (UNAVAILABLE) is not dropped when
    the lease's expires_at passes: the worker keeps the job held (listed in
    held_leases) and sends the report again until it is acknowledged."""
    from agq.worker import _Running

    w = agq.Worker("127.0.0.1:9", "py-report", call_timeout=1.0)
    w.register(lambda ctx: "done", "ok")
    failing = threading.Event()
    failing.set()
    stub = _RecordingStub(failing)
    finals = stub.finals
    monkeypatch.setattr(w, "_stub", stub)
    lease = worker_service_pb2.JobLease(
        lease_id="lease-1",
        job=common_pb2.Job(job_id="j", action_id="a", plan_id="p"),
        plan=common_pb2.Plan(
            plan_id="p", tasks=[common_pb2.Task(task_number=1, command="ok", timeout_secs=10)]
        ),
        attempt=1,
    )
    expires = time.time() + 0.5
    lease.expires_at.FromNanoseconds(int(expires * 1e9))
    running = _Running("lease-1")
    w._jobs["j"] = running
    t = threading.Thread(target=w._run_job, args=(lease, running), daemon=True)
    t.start()
    wait_until(lambda: time.time() > expires + 1.0 and len(finals) >= 3,
               "the report to fail past the lease's expiry")
    assert t.is_alive(), "the result was dropped"
    assert w._jobs.get("j") is running
    assert list(w._heartbeat(first=True).held_leases.lease_ids) == ["lease-1"]
    failing.clear()
    t.join(timeout=WAIT)
    assert not t.is_alive()
    assert finals[-1].status == common_pb2.JOB_STATUS_COMPLETED
    assert finals[-1].lease_id == "lease-1"
    assert finals[-1].task_results[0].stdout == "done"
    assert "j" not in w._jobs
    assert list(w._heartbeat(first=True).held_leases.lease_ids) == []


class _Busy(grpc.RpcError):
    """What the server answers while its request buffer is full: refused
    for now only, with a retry pushback."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "the server is receiving too many large messages at once (test); retry later"

    def trailing_metadata(self) -> Any:
        return (("grpc-retry-pushback-ms", "100"),)


def test_a_report_refused_with_a_retry_pushback_is_sent_again_with_its_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A report the server refused for now only (RESOURCE_EXHAUSTED with a
    retry pushback: its request buffer was full) is sent again as it is,
    outputs included, no sooner than the pushback; a RESOURCE_EXHAUSTED
    without one (a report too large) would send it without its outputs."""
    from agq.worker import _Running

    w = agq.Worker("127.0.0.1:9", "py-busy", call_timeout=1.0)
    w.register(lambda ctx: "done", "ok")
    finals: list[tuple[float, worker_service_pb2.UpdateJobRequest]] = []

    class Stub:
        def UpdateJob(
            self, req: worker_service_pb2.UpdateJobRequest, timeout: float | None = None,
            metadata: Any = None,
        ) -> worker_service_pb2.UpdateJobResponse:
            if req.status != common_pb2.JOB_STATUS_RUNNING:
                sent = worker_service_pb2.UpdateJobRequest()
                sent.CopyFrom(req)
                finals.append((time.monotonic(), sent))
                if len(finals) == 1:
                    raise _Busy()
            return worker_service_pb2.UpdateJobResponse(status=req.status)

    monkeypatch.setattr(w, "_stub", Stub())
    lease = worker_service_pb2.JobLease(
        lease_id="lease-1",
        job=common_pb2.Job(job_id="j", action_id="a", plan_id="p"),
        plan=common_pb2.Plan(
            plan_id="p", tasks=[common_pb2.Task(task_number=1, command="ok", timeout_secs=10)]
        ),
        attempt=1,
    )
    running = _Running("lease-1")
    w._jobs["j"] = running
    t = threading.Thread(target=w._run_job, args=(lease, running), daemon=True)
    t.start()
    t.join(timeout=WAIT)
    assert not t.is_alive()
    assert len(finals) == 2
    (first_at, first), (again_at, again) = finals
    assert again.task_results[0].stdout == "done"
    assert not again.task_results[0].stdout_truncated
    assert again == first
    assert again_at - first_at >= 0.1


def test_task_threads_that_ignore_cancel_hold_their_slot(
    server: Server, client: agq.Client,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """A timed-out task whose function ignores ctx.cancelled is reported at
    once, but its thread keeps its slot: with max_concurrent_jobs=1 the
    next job starts only once that function has returned."""
    w = agq.Worker(server.address, "py-stubborn", max_concurrent_jobs=1)
    lock = threading.Lock()
    live = 0
    most = 0
    calls: list[str] = []

    @w.task("stubborn")
    def stubborn(ctx: agq.TaskContext) -> str:
        nonlocal live, most
        with lock:
            live += 1
            most = max(most, live)
            calls.append(ctx.job_id)
        try:
            time.sleep(3.0)  # past the 1 s timeout and the 1 s grace, ignoring ctx.cancelled
        finally:
            with lock:
                live -= 1
        return "too late"

    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-stubborn", [agq.Task("stubborn", timeout_secs=1)]))
    sub = client.submit_action("py-stubborn", [{}, {}], max_attempts=1)
    assert client.wait_action(sub.action_id, timeout=WAIT).dead == 2
    wait_until(lambda: len(calls) == 2 and live == 0, "both functions to return")
    assert most == 1, f"{most} task functions ran at once with max_concurrent_jobs=1"
    for j in sub.job_ids:
        assert "timed out" in client.get_job(j).error
    wait_until(lambda: not w._leftover, "the stopped threads to release their slots")


def test_a_lease_delivered_again_does_not_run_its_job_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server sends a lease again on a worker's new lease stream when
    the worker has not named it in held_leases since: a lease id already
    running here is not run a second time, and its attempt goes on."""

    w = agq.Worker("127.0.0.1:9", "py-twice", max_concurrent_jobs=2)
    calls = 0
    release = threading.Event()

    @w.task("once")
    def once(ctx: agq.TaskContext) -> str:
        nonlocal calls
        calls += 1
        release.wait(10)
        return "done"

    stub = _RecordingStub()
    monkeypatch.setattr(w, "_stub", stub)
    w._start_job(_lease("lease-1", "j", "once"))
    wait_until(lambda: calls == 1, "the function to start")
    w._start_job(_lease("lease-1", "j", "once"))
    time.sleep(0.5)
    assert calls == 1, "the job ran again for a lease it already runs"
    release.set()
    wait_until(lambda: len(stub.finals) == 1 and not w._job_threads, "the attempt to finish")
    time.sleep(0.2)
    assert calls == 1
    assert [(f.lease_id, f.status) for f in stub.finals] == [
        ("lease-1", common_pb2.JOB_STATUS_COMPLETED)]


def test_a_job_leased_again_waits_for_its_earlier_attempt_to_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second lease of a job whose first attempt's function ignores
    ctx.cancelled starts its function only after that one has returned,
    although a slot is free: one job's functions never run side by side."""

    w = agq.Worker("127.0.0.1:9", "py-again", max_concurrent_jobs=2)
    lock = threading.Lock()
    live = 0
    most = 0
    spans: list[tuple[str, float, float]] = []

    @w.task("stubborn")
    def stubborn(ctx: agq.TaskContext) -> str:
        nonlocal live, most
        t0 = time.monotonic()
        with lock:
            live += 1
            most = max(most, live)
        try:
            time.sleep(2.5)  # ignores ctx.cancelled, past the 1 s grace
        finally:
            with lock:
                live -= 1
                spans.append((ctx.input.get("attempt", ""), t0, time.monotonic()))
        return "done"

    stub = _RecordingStub()
    finals = stub.finals
    monkeypatch.setattr(w, "_stub", stub)

    w._start_job(_lease("lease-1", "j", "stubborn", {"attempt": "1"}))
    wait_until(lambda: live == 1, "the first attempt's function to start")
    w._start_job(_lease("lease-2", "j", "stubborn", {"attempt": "2"}))
    wait_until(lambda: len(spans) == 2 and len(finals) == 2, "both attempts to finish")
    assert most == 1, "the second attempt's function ran beside the first's"
    (a1, _, end1), (a2, start2, _) = spans
    assert (a1, a2) == ("1", "2")
    assert start2 >= end1
    by_lease = {f.lease_id: f for f in finals}
    assert by_lease["lease-1"].status == common_pb2.JOB_STATUS_FAILED
    assert "superseded" in by_lease["lease-1"].error
    assert by_lease["lease-2"].status == common_pb2.JOB_STATUS_COMPLETED
    assert by_lease["lease-2"].task_results[0].stdout == "done"
    wait_until(lambda: not w._job_threads and not w._leftover, "the threads to be counted out")


@pytest.fixture
def slow_beat_server(tmp_path: Path) -> Iterator[Server]:
    """A live server whose workers beat every 2 s (DEAD after 6 s)."""
    s = Server(tmp_path / "server", heartbeat_interval_ms=2000)
    try:
        yield s
    finally:
        s.stop()


def test_many_workers_in_one_process_all_connect(
    slow_beat_server: Server, start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """140 Workers in one process hold 280 streams, more than the 256 calls
    the server allows open on one HTTP/2 connection: each Worker has a
    connection of its own, so all of them connect and take jobs. (They
    beat every 2 s here: 140 Workers' threads share one interpreter lock,
    and on two busy cores some beats of the suite's usual 500 ms came
    more than 3 intervals apart, so that a few jobs spent their attempts
    on workers declared DEAD.)"""
    server = slow_beat_server
    with agq.Client(server.address, timeout=10) as client:
        ran: set[str] = set()
        lock = threading.Lock()

        def note(ctx: agq.TaskContext) -> str:
            with lock:
                ran.add(ctx.job_id)
            return "ok"

        threads = []
        for i in range(140):
            w = agq.Worker(server.address, f"py-many-{i}")
            w.register(note, "note")
            threads.append(start_worker(w))
        for t in threads:
            t.wait_connected()
        assert len(client.list_workers()) == 140
        client.submit_plan(agq.Plan("py-many", [agq.Task("note")]))
        sub = client.submit_action("py-many", [{} for _ in range(20)])
        assert client.wait_action(sub.action_id, timeout=WAIT).completed == 20
        assert ran == set(sub.job_ids)


def test_process_isolation_runs_functions_in_their_own_processes(
    server: Server, client: agq.Client,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """A function registered with isolation="process" runs in a child
    process: its output, logged lines, exceptions (with the traceback) and
    PermanentFailure are reported as on a thread; a crash of the process
    fails the task and the worker runs on."""
    import os

    import isolated_tasks

    w = agq.Worker(server.address, "py-iso", max_concurrent_jobs=2)
    for fn in (isolated_tasks.shout, isolated_tasks.broken, isolated_tasks.crash):
        w.register(fn, isolation="process")
    start_worker(w).wait_connected()
    for name in ("shout", "broken", "crash"):
        client.submit_plan(agq.Plan(f"py-iso-{name}", [agq.Task(name, args=["{{word}}"])]))
    ok = client.submit_action("py-iso-shout", [{"word": "hi"}])
    bad = client.submit_action("py-iso-broken", [{"word": "x"}], max_attempts=2)
    dead = client.submit_action("py-iso-broken", [{"word": "x", "permanent": "1"}],
                                max_attempts=3)
    crashed = client.submit_action("py-iso-crash", [{"word": "x"}], max_attempts=1)
    for sub in (ok, bad, dead, crashed):
        client.wait_action(sub.action_id, timeout=WAIT)

    job = client.get_job(ok.job_ids[0])
    assert job.status == agq.JobStatus.COMPLETED
    out = job.task_results[0].stdout
    assert out.startswith("HI pid=")
    assert int(out.split("pid=")[1]) != os.getpid()
    assert "shouting in" in job.task_results[0].stderr

    job = client.get_job(bad.job_ids[0])
    assert job.status == agq.JobStatus.DEAD and job.attempt == 2
    assert "ValueError: bad input" in job.error
    assert "about to fail" in job.task_results[0].stderr
    assert "Traceback" in job.task_results[0].stderr

    job = client.get_job(dead.job_ids[0])
    assert job.status == agq.JobStatus.DEAD and job.attempt == 1, "a permanent failure was retried"

    job = client.get_job(crashed.job_ids[0])
    assert job.status == agq.JobStatus.DEAD
    assert "exited with code 3" in job.error
    assert job.task_results[0].exit_code == 3

    again = client.submit_action("py-iso-shout", [{"word": "still here"}])
    assert client.wait_action(again.action_id, timeout=WAIT).completed == 1


@pytest.mark.parametrize("reaper", ["application", "worker"])
def test_a_crashed_process_task_keeps_its_exit_code_when_another_thread_reaps_it(
    server: Server, client: agq.Client,
    start_worker: Callable[[agq.Worker], WorkerThread],
    monkeypatch: pytest.MonkeyPatch, reaper: str,
) -> None:
    """multiprocessing reaps the finished children of every thread each
    time any thread starts a process or lists its children, and records the
    exit status a moment after it has reaped it. A task's process reaped
    that way by another thread still reports its own exit code, never an
    invented signal. Here another thread lists the children in a loop, and
    each of its reaps takes 0.3 s to record the status. It is either a
    thread of the application, whose record the worker waits for, or
    stands for one of the worker's own threads starting a task's process
    (it reaps under the worker's lock, and the worker is not allowed to
    wait for the record)."""
    import contextlib
    import multiprocessing
    import os

    import isolated_tasks

    import agq.worker

    if reaper == "worker":
        monkeypatch.setattr(agq.worker, "PROCESS_STATUS_WAIT", 0.0)
        held: Any = agq.worker._REAP_LOCK
    else:
        held = contextlib.nullcontext()

    reaper_done = threading.Event()
    record = os.waitstatus_to_exitcode

    def slow_record(status: int) -> int:
        if threading.current_thread().name == "app-reaper":
            time.sleep(0.3)
        return record(status)

    monkeypatch.setattr(os, "waitstatus_to_exitcode", slow_record)

    def reap() -> None:
        deadline = time.monotonic() + 2 * WAIT
        while not reaper_done.is_set() and time.monotonic() < deadline:
            with held:
                multiprocessing.active_children()
            time.sleep(0.001)

    reaping = threading.Thread(target=reap, name="app-reaper", daemon=True)
    reaping.start()
    try:
        w = agq.Worker(server.address, "py-iso-reaped", max_concurrent_jobs=3)
        w.register(isolated_tasks.crash_leaving_child, isolation="process")
        start_worker(w).wait_connected()
        client.submit_plan(agq.Plan("py-iso-reaped", [agq.Task("crash_leaving_child")]))
        sub = client.submit_action("py-iso-reaped", [{"n": str(i)} for i in range(6)],
                                   max_attempts=1)
        assert client.wait_action(sub.action_id, timeout=WAIT).dead == 6
    finally:
        reaper_done.set()
        reaping.join(WAIT)
    for job_id in sub.job_ids:
        job = client.get_job(job_id)
        assert "exited with code 3" in job.error, job.error
        assert job.task_results[0].exit_code == 3


def test_a_stopped_process_task_is_killed_and_frees_its_slot(
    server: Server, client: agq.Client,
    start_worker: Callable[[agq.Worker], WorkerThread], tmp_path: Path,
) -> None:
    """A timed-out task whose function ignores ctx.cancelled is killed when
    it runs in its own process: its process is gone, no thread is left
    behind, and the next job gets the only slot at once."""
    import os

    import isolated_tasks

    w = agq.Worker(server.address, "py-iso-kill", max_concurrent_jobs=1)
    w.register(isolated_tasks.stubborn, isolation="process")
    w.register(isolated_tasks.shout, isolation="process")
    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-iso-stubborn", [agq.Task("stubborn", timeout_secs=1)]))
    client.submit_plan(agq.Plan("py-iso-shout2", [agq.Task("shout", args=["next"])]))
    pidfile = tmp_path / "pid"
    sub = client.submit_action("py-iso-stubborn", [{"pidfile": str(pidfile)}], max_attempts=1)
    assert client.wait_action(sub.action_id, timeout=WAIT).dead == 1
    assert "timed out" in client.get_job(sub.job_ids[0]).error
    pid = int(pidfile.read_text())

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, "the stopped task's process to be gone", timeout=5)
    assert not w._leftover, "a killed process left its thread behind"
    t0 = time.monotonic()
    nxt = client.submit_action("py-iso-shout2", [{}])
    assert client.wait_action(nxt.action_id, timeout=WAIT).completed == 1
    assert time.monotonic() - t0 < 10


def test_a_process_task_that_holds_the_gil_does_not_stop_heartbeats(
    server: Server, client: agq.Client,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """A regular expression that holds the GIL for several heartbeat
    intervals (the server's is 0.5 s here: DEAD after 1.5 s of silence)
    runs in its own process: the worker stays fresh and ACTIVE and the job
    completes on its first attempt."""
    import re

    import isolated_tasks

    # Find n for which one match takes about 4 s (each step doubles it).
    n = 16
    while True:
        t0 = time.monotonic()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.monotonic() - t0
        if took > 0.05:
            break
        n += 1
    while took < 4.0:
        n += 1
        took *= 2
    w = agq.Worker(server.address, "py-iso-gil")
    w.register(isolated_tasks.hog, isolation="process")
    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-iso-hog", [agq.Task("hog", timeout_secs=120)]))
    # The calibration above may have run under more load than the task: a
    # match that came out shorter than the staleness bound proves nothing,
    # so it runs again, four times as long (three tries at most).
    took_s = 0.0
    for _ in range(3):
        sub = client.submit_action("py-iso-hog", [{"n": str(n)}], max_attempts=1)
        assert client.wait_action(sub.action_id, timeout=120).completed == 1
        job = client.get_job(sub.job_ids[0])
        assert job.attempt == 1
        took_s = float(job.task_results[0].stdout.split(" in ")[1].removesuffix(" s"))
        if took_s >= 1.5:
            break
        n += 2
    assert took_s >= 1.5, f"the match took only {took_s} s: not a GIL hold past the staleness bound"
    info = client.get_worker("py-iso-gil")
    assert info.state == agq.WorkerState.ACTIVE and info.fresh


def test_process_isolation_needs_an_importable_function() -> None:
    """A lambda or a nested function cannot be run in a spawned process:
    register refuses it at once, with isolation named."""
    w = agq.Worker("127.0.0.1:9", "py-iso-reg")
    with pytest.raises(ValueError, match="top level"):
        w.register(lambda ctx: "x", "anon", isolation="process")

    def nested(ctx: agq.TaskContext) -> str:
        return "x"

    with pytest.raises(ValueError, match="top level"):
        w.register(nested, isolation="process")
    with pytest.raises(ValueError, match="isolation"):
        w.register(nested, isolation="fiber")
    w.register(nested)  # a thread needs nothing of the kind


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, dead but
    not yet reaped by whoever inherited it, counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_worker_leaves_no_process_task_running(
    server: Server, client: agq.Client, tmp_path: Path,
) -> None:
    """SIGKILL of a worker process (no cleanup of its own can run) takes its
    process-isolated task with it: the task's child process dies too."""
    proc = spawn_worker(server.address, "py-iso-doomed", tmp_path)
    try:
        wait_until(lambda: any(w.worker_id == "py-iso-doomed" and w.connected
                               for w in client.list_workers()), "py-iso-doomed to connect")
        client.submit_plan(agq.Plan("py-iso-doomed", [agq.Task("stubborn", timeout_secs=120)]))
        pidfile = tmp_path / "task-pid"
        client.submit_action("py-iso-doomed", [{"pidfile": str(pidfile)}], max_attempts=1)
        wait_until(lambda: pidfile.exists() and pidfile.read_text() != "",
                   "the task's process to start")
        pid = int(pidfile.read_text())
        assert _running(pid)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL
        wait_until(lambda: not _running(pid), "the task's process to die with its worker",
                   timeout=5)
    finally:
        stop_proc(proc)


def test_a_new_attempt_waiting_for_its_earlier_one_gives_up_when_its_lease_expires() -> None:
    """The wait for an earlier attempt's function is bounded by the new
    lease's expiry: the attempt is then stopped, takes no slot and says why."""
    from agq.worker import _Running

    w = agq.Worker("127.0.0.1:9", "py-expire", max_concurrent_jobs=2)
    w._job_threads["j"] = 1  # the earlier attempt's function still runs
    running = _Running("lease-2")
    t0 = time.monotonic()
    assert not w._take_slot("j", running, time.time() + 0.5)
    assert 0.4 <= time.monotonic() - t0 < 5
    assert running.cancel.is_set() and "expired" in running.reason
    assert w._busy == 0, "a slot was taken"


def test_a_task_name_with_a_trailing_newline_is_refused() -> None:
    """``$`` of a regular expression also matches before a final newline: a
    name such as "ok\\n" is not a valid plan command and must be refused."""
    w = agq.Worker("127.0.0.1:9", "py-names")
    with pytest.raises(ValueError, match="task name"):
        w.register(lambda ctx: "x", "ok\n")
    assert w.tools == ()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("output_cap_bytes", -1),
        ("call_timeout", 0.0),
        ("call_timeout", float("nan")),
        ("drain_timeout", -1.0),
        ("drain_timeout", float("nan")),
        ("reconnect_backoff", (0.0, 0.0)),
        ("reconnect_backoff", (5.0, 1.0)),
        ("reconnect_backoff", (0.5, float("inf"))),
    ],
)
def test_worker_options_out_of_range_are_refused_by_name(option: str, value: object) -> None:
    """A negative output cap (which would cut the last byte of every
    output), a zero call timeout (every call fails at once, forever), a
    zero reconnect backoff (reconnects in a busy loop) and the like are
    refused at construction, naming the option."""
    with pytest.raises(ValueError, match=option):
        agq.Worker("127.0.0.1:9", "py-options", **{option: value})  # type: ignore[arg-type]


def _lease(lease_id: str, job_id: str, command: str,
           input: dict[str, str] | None = None, tasks: int = 1) -> worker_service_pb2.JobLease:
    """A lease of a job whose plan runs ``command`` ``tasks`` times."""
    out = worker_service_pb2.JobLease(
        lease_id=lease_id,
        job=common_pb2.Job(job_id=job_id, action_id="a", plan_id="p", input=input or {}),
        plan=common_pb2.Plan(plan_id="p", tasks=[
            common_pb2.Task(task_number=n, command=command, timeout_secs=60)
            for n in range(1, tasks + 1)]),
        attempt=1,
    )
    out.expires_at.FromNanoseconds(int((time.time() + 60) * 1e9))
    return out


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for this")


def test_outputs_and_errors_that_are_not_valid_text_are_still_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task function that returns a string with a lone surrogate (as
    os.fsdecode makes of undecodable file names), logs one, raises an
    exception whose message has one, or returns an object whose str()
    raises: the job is reported (never left held and unreported because
    its job thread died building the report)."""
    w = agq.Worker("127.0.0.1:9", "py-odd-text", max_concurrent_jobs=4)
    w.register(lambda ctx: "bad \udcff name", "surrogate")
    w.register(lambda ctx: _Unprintable(), "unprintable")  # type: ignore[arg-type,return-value]

    def raises(ctx: agq.TaskContext) -> str:
        ctx.log("log \udc80 line")
        raise RuntimeError("oops \udcff")

    w.register(raises, "raises")
    stub = _RecordingStub()
    monkeypatch.setattr(w, "_stub", stub)
    for n, command in enumerate(("surrogate", "unprintable", "raises")):
        w._start_job(_lease(f"lease-{n}", command, command))
    wait_until(lambda: len(stub.finals) == 3, "the three results", timeout=10)
    by_job = {f.job_id: f for f in stub.finals}
    ok = by_job["surrogate"]
    assert ok.status == common_pb2.JOB_STATUS_COMPLETED
    assert ok.task_results[0].stdout.startswith("bad ")
    assert ok.task_results[0].stdout.endswith(" name")
    bad = by_job["unprintable"]
    assert bad.status == common_pb2.JOB_STATUS_FAILED
    assert "RuntimeError" in bad.error
    failed = by_job["raises"]
    assert failed.status == common_pb2.JOB_STATUS_FAILED
    assert "RuntimeError: oops " in failed.error
    assert "log " in failed.task_results[0].stderr
    wait_until(lambda: not w._jobs, "the jobs to be let go")


def test_a_task_that_logs_without_end_keeps_only_the_output_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ctx.log keeps at most output_cap_bytes of lines (the rest is dropped
    and flagged truncated), not every line until the task returns: a
    chatty function cannot grow the worker's memory without bound."""
    w = agq.Worker("127.0.0.1:9", "py-chatty", output_cap_bytes=10_000)
    held: list[int] = []

    @w.task("chatty")
    def chatty(ctx: agq.TaskContext) -> str:
        line = "x" * 999
        for _ in range(20_000):  # 20 MB
            ctx.log(line)
        held.append(len(ctx.stderr()))
        return "said it all"

    stub = _RecordingStub()
    monkeypatch.setattr(w, "_stub", stub)
    w._start_job(_lease("lease-1", "j", "chatty"))
    wait_until(lambda: len(stub.finals) == 1, "the result", timeout=20)
    assert held and held[0] <= 10_000, f"{held} bytes of log held for a 10000-byte cap"
    result = stub.finals[0].task_results[0]
    assert stub.finals[0].status == common_pb2.JOB_STATUS_COMPLETED
    assert result.stderr_truncated
    assert 0 < len(result.stderr) <= 10_000


def test_a_process_task_output_over_the_cap_is_flagged_truncated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Output and logged lines of a function run in its own process that
    exceed output_cap_bytes are cut and flagged truncated, as on a thread
    (the child cut them and the flags were lost on the way)."""
    import isolated_tasks

    w = agq.Worker("127.0.0.1:9", "py-iso-flood", output_cap_bytes=1000)
    w.register(isolated_tasks.flood, isolation="process")
    stub = _RecordingStub()
    monkeypatch.setattr(w, "_stub", stub)
    w._start_job(_lease("lease-1", "j", "flood", {"lines": "50", "size": "5000"}))
    wait_until(lambda: len(stub.finals) == 1, "the result")
    assert stub.finals[0].status == common_pb2.JOB_STATUS_COMPLETED
    result = stub.finals[0].task_results[0]
    assert result.stdout == "y" * 1000 and result.stdout_truncated
    assert 0 < len(result.stderr) <= 1000 and result.stderr_truncated


class _DrainStub(_RecordingStub):
    """Also DrainWorker, answering UNAVAILABLE ``fail`` times first, and a
    RegisterWorker that is always UNAVAILABLE (the store is down)."""

    def __init__(self, failing: threading.Event | None = None, fail: int = 0) -> None:
        super().__init__(failing)
        self.drains = 0
        self._fail = fail

    def DrainWorker(
        self, req: worker_service_pb2.DrainWorkerRequest, timeout: float | None = None,
        metadata: Any = None,
    ) -> worker_service_pb2.DrainWorkerResponse:
        self.drains += 1
        if self.drains <= self._fail:
            raise _Unavailable()
        return worker_service_pb2.DrainWorkerResponse()

    def RegisterWorker(
        self, req: worker_service_pb2.RegisterWorkerRequest, timeout: float | None = None,
        metadata: Any = None,
    ) -> worker_service_pb2.RegisterWorkerResponse:
        raise _Unavailable()


def test_a_drain_the_server_could_not_record_is_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DrainWorker answered UNAVAILABLE (the store cannot commit) is sent
    again with backoff: otherwise, with the connection still up, the
    server never learns of the drain and keeps leasing jobs to a worker
    that kills them at the drain timeout."""
    w = agq.Worker("127.0.0.1:9", "py-drain-retry")
    stub = _DrainStub(fail=2)
    monkeypatch.setattr(w, "_stub", stub)
    t = threading.Thread(target=w._drain_self, daemon=True)
    t.start()
    t.join(timeout=WAIT)
    assert not t.is_alive()
    assert stub.drains == 3


def test_a_drain_waits_for_finished_jobs_results_past_the_drain_timeout(
    monkeypatch: pytest.MonkeyPatch, start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """As agw: a job that finished has a result that must not be thrown
    away. While the server cannot take it (UNAVAILABLE), the drain waits
    for it past the drain timeout and the killed jobs' report grace; the
    worker leaves once it is acknowledged."""
    import agq.worker as worker_module

    monkeypatch.setattr(worker_module, "KILLED_REPORT_GRACE", 0.3)
    w = agq.Worker("127.0.0.1:9", "py-drain-wait", drain_timeout=0.3)
    w.register(lambda ctx: "done", "ok")
    failing = threading.Event()
    failing.set()
    stub = _DrainStub(failing)
    monkeypatch.setattr(w, "_stub", stub)
    w._start_job(_lease("lease-1", "j", "ok"))
    wait_until(lambda: len(stub.finals) >= 1, "the first try of the report")
    t = start_worker(w)
    w.stop()
    time.sleep(2.0)  # past the drain timeout and the report grace
    assert t.thread.is_alive(), "the worker left with a result not acknowledged"
    assert w._jobs.get("j") is not None
    failing.clear()
    t.thread.join(timeout=WAIT)
    assert not t.thread.is_alive()
    assert t.exit is agq.WorkerExit.DRAINED
    assert stub.finals[-1].status == common_pb2.JOB_STATUS_COMPLETED
    assert stub.finals[-1].task_results[0].stdout == "done"
    assert not w._jobs


def test_an_error_in_the_session_reconnects_instead_of_ending_it(
    server: Server, client: agq.Client, monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """An unexpected exception on the session thread (here: no thread can
    be started for a lease, as when the process is at its thread limit)
    does not end the worker's sessions for good while run() goes on: the
    worker reconnects, the lease comes again and the job completes."""
    failed: list[str] = []

    class Thread(threading.Thread):
        def start(self) -> None:
            if self.name.startswith("agq-job-") and not failed:
                failed.append(self.name)
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", Thread)
    w = agq.Worker(server.address, "py-session-error", reconnect_backoff=(0.1, 0.5))
    w.register(lambda ctx: "done", "ok")
    start_worker(w).wait_connected()
    client.submit_plan(agq.Plan("py-session-error", [agq.Task("ok", timeout_secs=30)]))
    sub = client.submit_action("py-session-error", [{}])
    assert client.wait_action(sub.action_id, timeout=20).completed == 1
    assert failed
    assert client.get_job(sub.job_ids[0]).result == "done"


def test_kill_while_unregistering_exits_at_once(
    monkeypatch: pytest.MonkeyPatch, start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """kill() (or another signal) while the drained worker retries
    UnregisterWorker (the store is down: UNAVAILABLE) exits at once with
    FORCED, as agw does, not after the 10 s of unregister retries."""
    unregisters: list[float] = []

    class Stub(_DrainStub):
        def UnregisterWorker(
            self, req: worker_service_pb2.UnregisterWorkerRequest,
            timeout: float | None = None, metadata: Any = None,
        ) -> worker_service_pb2.UnregisterWorkerResponse:
            unregisters.append(time.monotonic())
            raise _Unavailable()

    w = agq.Worker("127.0.0.1:9", "py-unregister")
    w.register(lambda ctx: "x", "ok")
    monkeypatch.setattr(w, "_stub", Stub())
    w._ever_connected = True  # as after a session: a drain ends by unregistering
    t = start_worker(w)
    w.stop()
    wait_until(lambda: len(unregisters) >= 2, "UnregisterWorker to be retried")
    t0 = time.monotonic()
    w.kill()
    t.thread.join(timeout=WAIT)
    assert time.monotonic() - t0 < 3, "kill() waited for the unregister retries"
    assert t.exit is agq.WorkerExit.FORCED


@pytest.mark.parametrize(
    "tags",
    [{"gpu": True}, {1: "x"}, {f"k{i}": "v" for i in range(65)}],
)
def test_bad_tags_are_refused_at_construction(tags: Any) -> None:
    """Tags that are not text (or more than 64) are refused by the
    constructor, naming them; they failed building every RegisterWorker
    request, so the worker never connected."""
    with pytest.raises(ValueError, match="tags"):
        agq.Worker("127.0.0.1:9", "py-tags", tags=tags)


class _Refused(grpc.RpcError):
    """An error answer of the server: ``code`` with ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _SlowProgressStub(_DrainStub):
    """A server that answers RUNNING progress reports late: each waits until
    ``release`` is set, or fails with DEADLINE_EXCEEDED once the call's
    ``timeout`` has passed (as grpc does), then is accepted or, with
    ``answer``, answered by raising it. Final reports are recorded in
    ``finals`` and accepted at once. ``events`` lists, in order, each
    RUNNING report as it is sent ("sent", task) and answered ("done",
    task), and each final report ("final", its status), with the time."""

    def __init__(self, answer: BaseException | None = None) -> None:
        super().__init__()
        self.release = threading.Event()
        self.answer = answer
        self.events: list[tuple[str, int, float]] = []

    def _note(self, what: str, n: int) -> None:
        with self._lock:
            self.events.append((what, n, time.monotonic()))

    def UpdateJob(
        self, req: worker_service_pb2.UpdateJobRequest, timeout: float | None = None,
        metadata: Any = None,
    ) -> worker_service_pb2.UpdateJobResponse:
        if req.status != common_pb2.JOB_STATUS_RUNNING:
            self._note("final", req.status)
            return super().UpdateJob(req, timeout, metadata)
        self._note("sent", req.current_task)
        released = self.release.wait(WAIT if timeout is None else timeout)
        self._note("done", req.current_task)
        if not released:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self.answer is not None:
            raise self.answer
        return worker_service_pb2.UpdateJobResponse(status=req.status)

    def running(self) -> list[int]:
        """The tasks of the RUNNING reports sent so far."""
        with self._lock:
            return [n for what, n, _ in self.events if what == "sent"]

    def kinds(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(what, n) for what, n, _ in self.events]


def _progress_threads(job_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"agq-progress-{job_id}"]


def test_a_task_starts_at_once_while_its_progress_report_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress reports are advisory and sent off the job's thread: a
    RUNNING report the server does not answer (until the call's deadline
    here) holds back no task function. The report of a task not sent yet
    when the job ends is dropped, and the final report goes out only once
    the RUNNING report in flight has ended (a RUNNING after the result
    would be refused), no later than the call's deadline (1 s, under the
    2 s bound on that wait); no thread is left behind."""
    w = agq.Worker("127.0.0.1:9", "py-slow-progress", call_timeout=1.0)
    started: list[float] = []

    stub = _SlowProgressStub()

    @w.task("quick")
    def quick(ctx: agq.TaskContext) -> str:
        started.append(time.monotonic())
        if ctx.task_number == 1:
            # The first report is in flight before the second is made.
            wait_until(lambda: stub.running() == [1], "the first report to be sent")
        return "done"

    monkeypatch.setattr(w, "_stub", stub)
    t0 = time.monotonic()
    w._start_job(_lease("lease-1", "j-slow", "quick", tasks=2))
    wait_until(lambda: len(started) == 2, "both tasks to start")
    # Had each task waited for the report of its start, it would have
    # waited 1 s (the call's deadline).
    assert started[0] - t0 < 0.5, "the first task waited for its progress report"
    assert started[1] - t0 < 0.9, "the second task waited for a progress report"
    wait_until(lambda: len(stub.finals) == 1, "the result")
    assert stub.finals[0].status == common_pb2.JOB_STATUS_COMPLETED
    assert stub.kinds() == [("sent", 1), ("done", 1), ("final", common_pb2.JOB_STATUS_COMPLETED)]
    final_at = stub.events[-1][2]
    assert final_at - t0 < 1.0 + 1.5, "the result waited past the progress call's deadline"
    wait_until(lambda: not _progress_threads("j-slow"), "the progress sender to end", timeout=5)
    wait_until(lambda: not w._jobs and not w._job_threads and not w._leftover,
               "the job to be let go", timeout=5)


def test_a_hung_progress_report_holds_the_result_back_two_seconds_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a long call deadline (10 s), a RUNNING report the server does not
    answer holds the job's final report back for PROGRESS_SETTLE_WAIT (2 s),
    not for the deadline: the result goes out while the report still hangs
    (the server refuses a RUNNING that arrives after it)."""
    w = agq.Worker("127.0.0.1:9", "py-hung-progress", call_timeout=10.0)
    stub = _SlowProgressStub()

    @w.task("quick")
    def quick(ctx: agq.TaskContext) -> str:
        # The report is in flight before the job ends.
        wait_until(lambda: stub.running() == [1], "the report to be sent")
        return "done"

    monkeypatch.setattr(w, "_stub", stub)
    try:
        t0 = time.monotonic()
        w._start_job(_lease("lease-1", "j-hung", "quick", tasks=1))
        wait_until(lambda: len(stub.finals) == 1, "the result", timeout=8.0)
        final_at = stub.events[-1][2]
        assert stub.kinds() == [("sent", 1), ("final", common_pb2.JOB_STATUS_COMPLETED)], \
            "the result went out while the progress report hung"
        assert stub.finals[0].status == common_pb2.JOB_STATUS_COMPLETED
        waited = final_at - t0
        assert agq.worker.PROGRESS_SETTLE_WAIT - 0.1 <= waited < \
            agq.worker.PROGRESS_SETTLE_WAIT + 1.5, f"the result waited {waited:.2f} s"
    finally:
        stub.release.set()
    wait_until(lambda: not _progress_threads("j-hung"), "the progress sender to end", timeout=5)
    wait_until(lambda: not w._jobs and not w._job_threads and not w._leftover,
               "the job to be let go", timeout=5)


def test_progress_reports_waiting_to_be_sent_keep_only_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a RUNNING report is in flight, the tasks run on and only the
    latest of the reports that wait is sent once it is answered: one is
    held per job, whatever the number of tasks."""
    w = agq.Worker("127.0.0.1:9", "py-latest-progress", call_timeout=10.0)
    finish = threading.Event()
    started: list[int] = []

    stub = _SlowProgressStub()

    @w.task("step")
    def step(ctx: agq.TaskContext) -> str:
        started.append(ctx.task_number)
        if ctx.task_number == 1:
            # The first report is in flight before the next ones queue up.
            wait_until(lambda: stub.running() == [1], "the first report to be sent")
        if ctx.task_number == 4:
            finish.wait(WAIT)
        return "x"

    monkeypatch.setattr(w, "_stub", stub)
    try:
        w._start_job(_lease("lease-1", "j-latest", "step", tasks=4))
        wait_until(lambda: started == [1, 2, 3, 4], "the tasks to run on", timeout=3.0)
        assert stub.running() == [1]
        stub.release.set()
        wait_until(lambda: stub.running() == [1, 4], "the latest report to be sent", timeout=5)
        finish.set()
        wait_until(lambda: len(stub.finals) == 1, "the result")
    finally:
        stub.release.set()
        finish.set()
    assert stub.finals[0].status == common_pb2.JOB_STATUS_COMPLETED
    assert stub.kinds() == [("sent", 1), ("done", 1), ("sent", 4), ("done", 4),
                            ("final", common_pb2.JOB_STATUS_COMPLETED)]
    wait_until(lambda: not _progress_threads("j-latest"), "the progress sender to end", timeout=5)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (_Refused(grpc.StatusCode.FAILED_PRECONDITION, "lease superseded (test)"),
         "lease lost: lease superseded (test)"),
        (ValueError("Cannot invoke RPC on closed channel!"), "the worker has stopped"),
    ],
    ids=["lease-gone", "channel-closed"],
)
def test_a_refused_progress_report_stops_the_running_task(
    monkeypatch: pytest.MonkeyPatch, answer: BaseException, reason: str,
) -> None:
    """A RUNNING report answered "the lease is no longer yours" (or that
    fails because the channel is closed: the worker stopped) stops the job
    although its task function started meanwhile: the function is told
    through ctx.cancelled and the job is reported stopped, after the
    refused report."""
    w = agq.Worker("127.0.0.1:9", "py-refused-progress", call_timeout=10.0)
    started = threading.Event()
    told = threading.Event()

    @w.task("wait")
    def wait(ctx: agq.TaskContext) -> str:
        started.set()
        if ctx.cancelled.wait(WAIT):
            told.set()
        return "too late"

    stub = _SlowProgressStub(answer)
    monkeypatch.setattr(w, "_stub", stub)
    try:
        w._start_job(_lease("lease-1", "j-refused", "wait"))
        assert started.wait(2.0), "the task waited for its progress report"
        stub.release.set()
        wait_until(lambda: len(stub.finals) == 1, "the result")
    finally:
        stub.release.set()
    assert told.is_set()
    final = stub.finals[0]
    assert final.status == common_pb2.JOB_STATUS_FAILED
    assert reason in final.error
    assert stub.kinds() == [("sent", 1), ("done", 1), ("final", common_pb2.JOB_STATUS_FAILED)]
    wait_until(lambda: not _progress_threads("j-refused"), "the progress sender to end",
               timeout=5)


def test_kill_ends_the_progress_sender(
    monkeypatch: pytest.MonkeyPatch, start_worker: Callable[[agq.Worker], WorkerThread],
) -> None:
    """kill() ends a job's progress reports with the worker: the report in
    flight ends as the channel closes (grpc cancels its calls), the one
    waiting is dropped and no thread is left."""
    w = agq.Worker("127.0.0.1:9", "py-kill-progress", call_timeout=10.0)
    started = threading.Event()

    @w.task("wait")
    def wait(ctx: agq.TaskContext) -> str:
        started.set()
        ctx.cancelled.wait(WAIT)
        return "stopped"

    stub = _SlowProgressStub(_Refused(grpc.StatusCode.CANCELLED, "Channel closed!"))
    monkeypatch.setattr(w, "_stub", stub)
    close = w._channel.close

    def close_channel() -> None:
        stub.release.set()  # the call in flight ends, CANCELLED
        close()

    monkeypatch.setattr(w._channel, "close", close_channel)
    t = start_worker(w)
    try:
        w._start_job(_lease("lease-1", "j-kill", "wait", tasks=2))
        assert started.wait(2.0), "the task waited for its progress report"
        wait_until(lambda: stub.running() == [1], "the first report to be in flight")
        w.kill()
        t.thread.join(timeout=WAIT)
        assert t.exit is agq.WorkerExit.FORCED
        wait_until(lambda: not _progress_threads("j-kill"), "the progress sender to end",
                   timeout=5)
        wait_until(lambda: not w._jobs, "the job to end", timeout=5)
    finally:
        stub.release.set()
    assert stub.running() == [1]
    assert not stub.finals
