"""The Python worker SDK: run AGQ jobs as Python functions.

A :class:`Worker` registers with the server advertising the names of its
registered functions as its "tools"; a plan whose tasks name those
functions in ``command`` runs on it. Per leased job it runs the plan's tasks
in order, each by calling the named function with a :class:`TaskContext`
(the job input, the task's rendered ``args``, the previous output as
``stdin``); the return value is the task's output (``stdout`` of its
TaskResult) and an exception fails the task and the job attempt;
:class:`PermanentFailure` fails it for good (no retry: the job is dead).

Protocol (as ``agw``): RegisterWorker; a Heartbeat stream whose first
message lists the leases still running (``held_leases``) and that is fed at
the interval the server returns; a LeaseJobs stream; UpdateJob reports fenced
by the lease id (RUNNING as each task starts, then COMPLETED or FAILED with
the task results; the final report is retried with backoff, past the
lease's expiry too, until the server acknowledges or fences it); the
RUNNING reports are advisory and sent by a thread of the job's own, so a
slow server never holds back a task: while one is in flight only the
latest of the next ones is kept, and the final report waits for the one
in flight (at most 2 s, ``PROGRESS_SETTLE_WAIT``) and drops the one not
sent; cancel and
drain commands from the heartbeat stream;
reconnects with backoff after any loss, keeping the jobs running; on SIGTERM
(or :meth:`Worker.stop`) a drain: DRAINING, no new leases, running jobs get
``drain_timeout`` seconds, then UnregisterWorker once every finished job's
result is acknowledged (as agw).

Python cannot kill a thread: a cancelled, timed-out or drain-killed task is
told through :attr:`TaskContext.cancelled` and reported at once; a function
that ignores it keeps running in the background until it returns, and its
result is dropped. Its thread holds a slot of ``max_concurrent_jobs`` until
then: a lease that arrives while such threads fill the slots waits for one
of them to return (logged as a warning). A job leased again while its
earlier attempt's function still runs (superseded, revoked or timed out)
waits the same way, until that function returns or the new lease expires:
one job's functions never run beside each other on a worker.

Heartbeats come from a Python thread of this process: a task function that
holds the GIL for long (a long C call that does not release it, such as a
catastrophic regular expression) stops them, and after 3 heartbeat
intervals the server takes the worker as DEAD and re-queues its jobs.

A function registered with ``isolation="process"`` runs instead in a
child process of its own for each task (the ``spawn`` start method: the
function must be importable, i.e. defined at a module's top level, and its
return value picklable). It cannot stop the worker's heartbeats, a stop
(cancel, timeout, drain, a newer lease) kills it (SIGTERM, then SIGKILL
0.5 s later), and a crash of it (a segfault in a C extension, ``os._exit``)
fails the task, not the worker. Starting a process costs tens of
milliseconds; ``ctx.cancelled`` is never set inside it. The process is
daemonic: it may run programs, but not start multiprocessing children.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import pickle
import platform
import queue
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any, TypeVar

import grpc

from agq import __version__
from agq._rpc import AgqError, Metadata, bearer, make_channel, status_of
from agq.types import TaskResult, timestamp
from agq.v1 import common_pb2, worker_service_pb2, worker_service_pb2_grpc

log = logging.getLogger("agq.worker")

#: What a task function returns: its output (``None`` for none).
TaskOutput = str | bytes | None
#: A task function: called with the task's context, returns its output.
TaskFunction = Callable[["TaskContext"], TaskOutput]
_F = TypeVar("_F", bound=TaskFunction)

_NAME = re.compile(r"[A-Za-z0-9._+-]{1,128}")

#: How a task function runs: on a thread of the worker's process, or in a
#: child process of its own (see the module's documentation).
ISOLATIONS = ("thread", "process")

#: Seconds a stopped task's process gets after SIGTERM before SIGKILL.
PROCESS_KILL_GRACE = 0.5
#: Seconds an ended task's process may take to have an exit status: to
#: become reapable once its sentinel is ready, or to get its status
#: recorded when another thread of the program reaped it (see
#: :data:`_REAP_LOCK`).
PROCESS_STATUS_WAIT = 2.0

#: Held by every call of this module that can reap a task's process.
#: multiprocessing reaps the finished children of every thread whenever
#: any thread starts a process (or lists its children), and records the
#: exit status only after its ``waitpid`` returns: a poll from another
#: thread in between finds nothing to reap, so the process looks alive
#: and then has no exit status at all. Starting and polling under one
#: lock closes that gap between the worker's own threads; a reap by the
#: application's threads is waited out (:data:`PROCESS_STATUS_WAIT`).
_REAP_LOCK = threading.Lock()

#: Heartbeat interval assumed until the server gives one, in seconds.
DEFAULT_HEARTBEAT_INTERVAL = 5.0
#: How long killed jobs get to report at the drain timeout, in seconds.
KILLED_REPORT_GRACE = 10.0
#: How long the worker tries to unregister before leaving anyway, in seconds.
UNREGISTER_TIMEOUT = 10.0
#: Longest wait, in seconds, of a job's final report for the progress report
#: in flight (as agw): the server refuses a RUNNING report after the final
#: one, so a later one is harmless, and a hung server does not hold the
#: result back for the call's whole deadline.
PROGRESS_SETTLE_WAIT = 2.0
#: Largest total of task output sent in one final report, in bytes.
REPORT_BUDGET_BYTES = 3 * 1024 * 1024
#: First and largest delay in seconds between tries of a final report
#: (doubling, jittered); it is retried until the server answers.
REPORT_BACKOFF = (0.1, 5.0)

_LEASE_GONE = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
)
# Worth sending again: the server (or the path to it) is down or its store
# cannot commit now. INTERNAL and ABORTED too: the server rolls back a batch
# that failed (every report in it answered INTERNAL) and expects the reports
# again, and fencing makes a repeat harmless.
_TRANSIENT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
)


def _cut(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` bytes of UTF-8, on a character
    boundary."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode(errors="ignore")


class JobCancelled(Exception):
    """Raised by :meth:`TaskContext.check` once the task should stop."""


class PermanentFailure(Exception):
    """Raise it from a task function when retrying cannot help (bad input,
    say): the failure is reported as permanent and the job goes to dead at
    once, whatever attempts are left (``RetryJob`` still brings it back)."""


class WorkerError(Exception):
    """The worker cannot run: the server refused its first registration for
    good (INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED; the
    :class:`agq.AgqError` is the ``__cause__``)."""


class WorkerExit(enum.Enum):
    """How :meth:`Worker.run` ended."""

    #: Drained: running jobs finished (or were stopped at the drain timeout)
    #: and the worker unregistered (or tried to).
    DRAINED = "drained"
    #: Stopped at once (a second signal or :meth:`Worker.kill`) without
    #: unregistering; the server re-queues its leases.
    FORCED = "forced"


class TaskContext:
    """What a task function gets: the job, the task and a cancel flag."""

    def __init__(
        self,
        *,
        job_id: str,
        action_id: str,
        plan_id: str,
        attempt: int,
        task_number: int,
        command: str,
        input: Mapping[str, str],
        args: tuple[str, ...],
        stdin: str,
        timeout_secs: int,
        cancelled: threading.Event,
        log_cap: int | None = None,
    ) -> None:
        #: The job's id.
        self.job_id = job_id
        #: The action that created the job.
        self.action_id = action_id
        #: The plan being run.
        self.plan_id = plan_id
        #: Attempt number of this lease, 1-based.
        self.attempt = attempt
        #: 1-based number of the task in its plan.
        self.task_number = task_number
        #: The task's ``command``: the name this function is registered under.
        self.command = command
        #: The job input (the values of ``{{name}}`` placeholders).
        self.input = input
        #: The task's args with every ``{{name}}`` replaced from the input.
        self.args = args
        #: Output of the task named by ``input_from_task``; "" when none.
        self.stdin = stdin
        #: The task's wall-clock limit in seconds.
        self.timeout_secs = timeout_secs
        #: Set when the task must stop: the job was cancelled, its lease
        #: was lost, the task timed out, or the worker's drain timed out.
        self.cancelled = cancelled
        self._log: list[str] = []
        # At most this many bytes of lines are kept (None: no limit); the
        # rest is dropped and _log_cut set.
        self._log_cap = log_cap
        self._log_bytes = 0
        self._log_cut = False
        self._lock = threading.Lock()

    def log(self, message: str) -> None:
        """Appends a line to the task's captured stderr (shown in
        TaskResult.stderr). Past the worker's ``output_cap_bytes`` the
        lines are dropped (and the stderr flagged truncated)."""
        line = message if message.endswith("\n") else message + "\n"
        with self._lock:
            if self._log_cap is not None:
                room = self._log_cap - self._log_bytes
                if room <= 0:
                    self._log_cut = True
                    return
                line, cut = _clip(line, room)
                self._log_cut |= cut
                self._log_bytes += len(line.encode("utf-8"))
            self._log.append(line)

    def check(self) -> None:
        """Raises :class:`JobCancelled` once the task should stop."""
        if self.cancelled.is_set():
            raise JobCancelled(f"job {self.job_id} stopped")

    def stderr(self) -> str:
        """The lines logged so far."""
        with self._lock:
            return "".join(self._log)


def render(arg: str, values: Mapping[str, str]) -> str:
    """Replaces each ``{{name}}`` in ``arg`` by ``values[name]`` once, left
    to right (as agw): whitespace inside the braces is ignored, ``{{}}`` and
    an unclosed ``{{`` stay literal. Raises KeyError naming a missing variable."""
    out: list[str] = []
    rest = arg
    while True:
        start = rest.find("{{")
        if start < 0:
            break
        close = rest.find("}}", start + 2)
        if close < 0:
            break
        name = rest[start + 2 : close].strip()
        if not name:
            out.append(rest[: close + 2])
        else:
            if name not in values:
                raise KeyError(name)
            out.append(rest[:start])
            out.append(values[name])
        rest = rest[close + 2 :]
    out.append(rest)
    return "".join(out)


@dataclass
class _Running:
    lease_id: str
    cancel: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    #: Its final report is being sent (under Worker._lock): its result
    #: stands, and a drain waits for it (see Worker._supervise).
    reporting: bool = False
    _stop_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def stop(self, reason: str) -> None:
        """Stops the attempt; the first reason given is the one kept."""
        with self._stop_lock:
            if not self.cancel.is_set():
                self.reason = reason
                self.cancel.set()


class _Stats:
    """Job counters and host figures for heartbeats. cpu_usage_percent is
    the 1-minute load average per CPU (capped at 100); memory_mb is the
    host's used memory (/proc/meminfo); disk_available_gb is the free space
    where the worker runs."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.completed = 0
        self.failed = 0
        self.total_ms = 0
        self.lock = threading.Lock()

    def record(self, success: bool, ms: int) -> None:
        with self.lock:
            if success:
                self.completed += 1
            else:
                self.failed += 1
            self.total_ms += ms

    def message(self, active: int) -> common_pb2.WorkerStats:
        with self.lock:
            n = self.completed + self.failed
            avg = self.total_ms // n if n else 0
            completed, failed = self.completed, self.failed
        cpu = 0.0
        try:
            cpu = min(100.0, os.getloadavg()[0] / (os.cpu_count() or 1) * 100.0)
        except OSError:
            pass
        mem_mb = 0
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                info = {
                    line.split(":")[0]: int(line.split()[1]) for line in f if line.count(":") == 1
                }
            mem_mb = max(0, info.get("MemTotal", 0) - info.get("MemAvailable", 0)) // 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            disk_gb = shutil.disk_usage(os.getcwd()).free // (1024**3)
        except OSError:
            disk_gb = 0
        return common_pb2.WorkerStats(
            active_jobs=active,
            completed_jobs_total=completed,
            failed_jobs_total=failed,
            uptime_secs=int(time.monotonic() - self.started),
            cpu_usage_percent=cpu,
            memory_mb=mem_mb,
            disk_available_gb=disk_gb,
            avg_job_duration_ms=avg,
        )


def _backoff(first: float, cap: float) -> Iterator[float]:
    d = first
    while True:
        yield min(d, cap) * random.uniform(0.8, 1.2)
        d *= 2


def _clip(text: str, cap: int) -> tuple[str, bool]:
    """``text`` cut to at most ``cap`` bytes of UTF-8, and whether it was
    cut. A character UTF-8 cannot encode (a lone surrogate, as
    ``os.fsdecode`` makes of undecodable bytes) becomes "?": protobuf
    refuses such a string."""
    data = text.encode("utf-8", "replace")
    if len(data) <= cap:
        return data.decode("utf-8"), False
    return data[:cap].decode("utf-8", "ignore"), True


def _pushback(err: grpc.RpcError) -> float | None:
    """Seconds the server asked to wait before the same request is sent
    again (its ``grpc-retry-pushback-ms`` trailer): it refused the request
    for now only (its request buffer was full), not for what it holds, so
    a report is sent again as it is, outputs included. None without one."""
    trailing = getattr(err, "trailing_metadata", None)
    if not callable(trailing):
        return None
    try:
        for key, value in trailing() or ():
            if key == "grpc-retry-pushback-ms":
                ms = int(value)
                return ms / 1000.0 if ms >= 0 else None
    except (TypeError, ValueError):
        return None
    return None


def _text(text: str) -> str:
    """``text`` with each character UTF-8 cannot encode as "?"."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _exc_text(e: BaseException) -> str:
    """``Type: message`` of an exception, also when its str() raises."""
    try:
        message = str(e)
    except Exception:  # noqa: BLE001 - any failure means the same
        message = "<str() of the exception failed>"
    return _text(f"{type(e).__name__}: {message}")


def _output_text(value: object) -> str:
    """A task function's return value as the task's output."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class _ChildFailure(Exception):
    """A task function run in its own process failed: ``what`` describes
    it (the exception's type and message, or how the process ended)."""

    def __init__(self, what: str, permanent: bool, exit_code: int) -> None:
        super().__init__(what)
        self.what = what
        self.permanent = permanent
        self.exit_code = exit_code


def _child_main(
    conn: Connection, fn: TaskFunction, fields: dict[str, Any], cap: int
) -> None:
    """The body of a task's child process: runs ``fn`` and sends
    ("value", output, logged, output_cut, logged_cut) or ("error", "",
    logged, what, traceback, permanent, logged_cut) to the worker (the
    ``_cut`` flags: cut to ``cap`` bytes). The child dies with the thread that started
    it (Linux: ``PR_SET_PDEATHSIG``), so a killed worker leaves no task
    running."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:  # the worker died before the line above
            os._exit(1)
    ctx = TaskContext(**fields, cancelled=threading.Event(), log_cap=cap)
    try:
        try:
            text, text_cut = _clip(_output_text(fn(ctx)), cap)
            logged, logged_cut = _clip(ctx.stderr(), cap)
            conn.send(("value", text, logged, text_cut, logged_cut or ctx._log_cut))
        except BaseException as e:  # noqa: BLE001 - sent as the task's failure
            permanent = isinstance(e, PermanentFailure)
            logged, logged_cut = _clip(ctx.stderr(), cap)
            conn.send(("error", "", logged, _exc_text(e), _clip(traceback.format_exc(), cap)[0],
                       permanent, logged_cut or ctx._log_cut))
    finally:
        conn.close()


def _ended(proc: multiprocessing.process.BaseProcess) -> bool:
    """Whether a task's process has exited (or is exiting), reaping it if
    it can. Its sentinel is checked first: once that is ready the process
    has closed its files on its way out, even when its status cannot be
    collected yet (:func:`_exit_status` waits for that)."""
    with _REAP_LOCK:
        exited = bool(multiprocessing.connection.wait([proc.sentinel], 0))
        return proc.exitcode is not None or exited


def _await_end(proc: multiprocessing.process.BaseProcess, timeout: float | None) -> bool:
    """Waits up to ``timeout`` seconds (None: until it happens) for a
    task's process to exit; whether it has. The process is polled every
    50 ms too, since a process it forked can hold its sentinel open."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not _ended(proc):
        step = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
        if step <= 0:
            return False
        multiprocessing.connection.wait([proc.sentinel], step)
    return True


def _signal(proc: multiprocessing.process.BaseProcess, sig: int) -> None:
    """Sends ``sig`` to a task's process unless it has been reaped (so
    that its pid, free for reuse then, is never signalled)."""
    with _REAP_LOCK:
        if proc.exitcode is None:
            if sig == signal.SIGKILL:
                proc.kill()
            else:
                proc.terminate()


def _exit_status(proc: multiprocessing.process.BaseProcess) -> int | None:
    """Reaps a task's process that has ended (see :func:`_ended`) and
    returns its exit status: its exit code, or minus the signal that
    killed it. Polls every 10 ms: the process becomes reapable a moment
    after its sentinel is ready, and a status another thread reaped is
    recorded a moment after that thread's ``waitpid``. None when there is
    still none after :data:`PROCESS_STATUS_WAIT` seconds."""
    deadline = time.monotonic() + PROCESS_STATUS_WAIT
    while True:
        with _REAP_LOCK:
            code = proc.exitcode
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.01)


class _Progress:
    """A job's RUNNING progress reports, sent by a thread of their own
    (started with the first report) so that a slow or unreachable server
    never holds back the job's tasks: progress is advisory.

    One report is sent at a time, once (its call bounded by the worker's
    ``call_timeout``); while it is in flight only the latest of the
    reports that follow is kept, replacing an older one not sent yet. A
    reply saying the lease is no longer the worker's (or a closed channel:
    the worker has stopped) stops the job and ends the reports.
    :meth:`close` drops the report not sent yet and waits for the one in
    flight, up to a bound: the job's final report is sent after it unless
    it hangs past :data:`PROGRESS_SETTLE_WAIT` (the server then refuses
    it, arriving after the result)."""

    def __init__(self, worker: Worker, lease: worker_service_pb2.JobLease,
                 running: _Running) -> None:
        self._worker = worker
        self._lease = lease
        self._running = running
        self._cond = threading.Condition(threading.Lock())
        self._pending: worker_service_pb2.UpdateJobRequest | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, task: int, percent: int) -> None:
        """Reports that ``task`` starts, ``percent`` of the plan done."""
        req = self._worker._update(self._lease, common_pb2.JOB_STATUS_RUNNING)
        req.current_task = task
        req.progress_percent = percent
        with self._cond:
            if self._closed or self._worker._leaving.is_set():
                return
            self._pending = req
            if self._thread is None:
                thread = threading.Thread(
                    target=self._send_all, name=f"agq-progress-{self._lease.job.job_id}",
                    daemon=True,
                )
                thread.start()
                self._thread = thread
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Ends the reports: the one not sent yet is dropped, and the one
        in flight is waited for, up to ``timeout`` seconds."""
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify()
            thread = self._thread
        if thread is None or timeout <= 0:
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("job %s: a progress report is still unanswered after %.1f s; "
                        "reporting the result anyway", self._lease.job.job_id, timeout)

    def _send_all(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                req, self._pending = self._pending, None
                if self._closed or req is None:
                    return
            if not self._send(req):
                with self._cond:
                    self._closed = True
                    self._pending = None
                return

    def _send(self, req: worker_service_pb2.UpdateJobRequest) -> bool:
        """Sends one report; False once the job is stopped by its answer."""
        w, job_id = self._worker, self._lease.job.job_id
        try:
            w._stub.UpdateJob(req, timeout=w.call_timeout, metadata=w._metadata)
        except ValueError:
            self._running.stop("the worker has stopped")
            return False
        except grpc.RpcError as e:
            code, details = status_of(e)
            if code in _LEASE_GONE:
                log.warning("job %s: lease no longer ours (%s): stopping it", job_id, details)
                self._running.stop(f"lease lost: {details}")
                return False
            log.debug("job %s: progress not reported: %s: %s", job_id, code.name, details)
        except Exception:  # noqa: BLE001 - progress is advisory: the job runs on
            log.exception("job %s: progress report failed", job_id)
        return True


class Worker:
    """A worker that runs AGQ jobs as Python functions.

    ``address``, ``token`` and ``tls`` as for :class:`agq.Client`; with
    auth on, ``token`` must be a worker token bound to ``worker_id`` (or an
    admin token). ``worker_id`` must match ``[A-Za-z0-9_-]{1,64}``.
    ``max_concurrent_jobs`` (1..=1024) is how many leases it holds at once
    and how many task functions run at once (the thread of a stopped task
    whose function ignores ``ctx.cancelled`` counts until it returns);
    ``drain_timeout`` (seconds) how long running jobs may take after SIGTERM
    or :meth:`stop`; ``call_timeout`` (seconds) the deadline of each unary
    call; ``output_cap_bytes`` the most bytes of a task's output and of its
    stderr kept (the rest is dropped and flagged truncated);
    ``reconnect_backoff`` the first and the largest delay in seconds between
    reconnects (doubling, jittered); ``tags`` free-form labels (at most 64);
    ``hostname`` defaults to this host's name. An option out of range
    (a timeout that is negative, zero for ``call_timeout`` or not finite, a
    negative ``output_cap_bytes``, a ``reconnect_backoff`` not
    ``0 < first <= largest``) raises ValueError naming it.

    Register functions with :meth:`task` or :meth:`register` (each on a
    thread of this process, or with ``isolation="process"`` in a child
    process per task, which a stop kills), then call :meth:`run` once (it
    closes the connection when it returns). The ``connected`` event is set
    while both streams are open.
    """

    def __init__(
        self,
        address: str,
        worker_id: str,
        *,
        token: str | None = None,
        tls: bool | grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
        max_concurrent_jobs: int = 1,
        tags: Mapping[str, str] | None = None,
        hostname: str | None = None,
        drain_timeout: float = 30.0,
        call_timeout: float = 15.0,
        output_cap_bytes: int = 1024 * 1024,
        reconnect_backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", worker_id):
            raise ValueError(f"worker_id must match [A-Za-z0-9_-]{{1,64}}, got {worker_id!r}")
        if not 1 <= max_concurrent_jobs <= 1024:
            raise ValueError("max_concurrent_jobs must be in 1..=1024")
        # `not a > b` rather than `a <= b`: NaN is refused too.
        if not drain_timeout >= 0 or math.isinf(drain_timeout):
            raise ValueError(f"drain_timeout must be a finite number >= 0, got {drain_timeout!r}")
        if not call_timeout > 0 or math.isinf(call_timeout):
            raise ValueError(f"call_timeout must be a finite number > 0, got {call_timeout!r}")
        if output_cap_bytes < 0:
            raise ValueError(f"output_cap_bytes must be >= 0, got {output_cap_bytes!r}")
        tags = dict(tags or {})
        if len(tags) > 64:
            raise ValueError(f"tags: at most 64, got {len(tags)}")
        for k, v in tags.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"tags must map text to text, got {k!r}: {v!r}")
        first, most = reconnect_backoff
        if not 0 < first <= most or math.isinf(most):
            raise ValueError(
                "reconnect_backoff must be (first, largest) with 0 < first <= largest, both "
                f"finite, got {reconnect_backoff!r}"
            )
        self.worker_id = worker_id
        # Random per process: the server lets this process resume its
        # registration and refuses a second live process with the same id.
        self._instance_id = uuid.uuid4().hex
        self.address = address
        self.max_concurrent_jobs = max_concurrent_jobs
        self.tags = tags
        host = hostname or socket.gethostname() or "localhost"
        self.hostname = "".join(c for c in host if " " <= c <= "~")[:255] or "localhost"
        self.drain_timeout = drain_timeout
        self.call_timeout = call_timeout
        self.output_cap_bytes = output_cap_bytes
        self._reconnect_backoff = reconnect_backoff
        self._metadata: Metadata = bearer(token)
        self._channel = make_channel(address, tls, tls_server_name)
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(self._channel)
        self._functions: dict[str, TaskFunction] = {}
        # Names of the functions run in a process of their own.
        self._isolated: set[str] = set()
        self._jobs: dict[str, _Running] = {}
        # Progress senders of the running jobs (under _lock): ended when the
        # worker leaves.
        self._progress: set[_Progress] = set()
        self._lock = threading.Lock()
        # Slots: jobs running their tasks, plus the task threads of stopped
        # jobs whose functions ignored ctx.cancelled and still run; together
        # at most max_concurrent_jobs (see _take_slot).
        self._slots = threading.Condition(threading.Lock())
        self._busy = 0
        self._leftover: set[threading.Thread] = set()
        # Task threads still running a function, per job id (under _slots):
        # a new attempt of a job starts its first task only once the
        # earlier attempt's functions have returned (see _take_slot).
        self._job_threads: dict[str, int] = {}
        self._wake = threading.Event()
        self._stats = _Stats()
        self._interval: float | None = None
        self._draining = False
        self._drain_by_signal = False
        self._killed = False
        self._leaving = threading.Event()
        self._fatal: WorkerError | None = None
        self._signals = 0
        self._ever_connected = False
        #: Set once both streams are open (and again after each reconnect).
        self.connected = threading.Event()

    # -- registration of functions ---------------------------------------

    def register(
        self, fn: TaskFunction, name: str | None = None, *, isolation: str = "thread"
    ) -> None:
        """Registers ``fn`` as the task function ``name`` (default: the
        function's ``__name__``). The name must be a valid plan command:
        ``[A-Za-z0-9._+-]{1,128}``, not "." or "..", not starting with "-".
        ``isolation`` is "thread" (the default: a thread of this process)
        or "process" (a child process per task; see the module's
        documentation). Raises ValueError for a bad or duplicate name, an
        unknown isolation, or a "process" function that cannot be pickled
        by reference (a lambda, a nested function, a method)."""
        n: str = name or str(getattr(fn, "__name__", ""))
        if not _NAME.fullmatch(n) or n in (".", "..") or n.startswith("-"):
            raise ValueError(f"task name must match [A-Za-z0-9._+-]{{1,128}}, got {n!r}")
        if n in self._functions:
            raise ValueError(f"task {n!r} is already registered")
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if isolation == "process":
            try:
                pickle.dumps(fn)
            except Exception as e:  # noqa: BLE001 - any pickling failure means the same
                raise ValueError(
                    f"task {n!r}: a function run in its own process must be defined at the top "
                    f"level of an importable module ({e})"
                ) from e
            self._isolated.add(n)
        self._functions[n] = fn

    def task(self, name: str | None = None, *, isolation: str = "thread") -> Callable[[_F], _F]:
        """Decorator form of :meth:`register`: ``@worker.task()``,
        ``@worker.task("name")`` or ``@worker.task(isolation="process")``."""

        def deco(fn: _F) -> _F:
            self.register(fn, name, isolation=isolation)
            return fn

        return deco

    @property
    def tools(self) -> tuple[str, ...]:
        """The registered function names (advertised as the worker's tools)."""
        return tuple(sorted(self._functions))

    # -- control -----------------------------------------------------------

    def stop(self) -> None:
        """Starts a drain (as SIGTERM): no new leases, running jobs get
        ``drain_timeout`` seconds, then the worker unregisters and
        :meth:`run` returns DRAINED. Thread-safe; may be called early."""
        with self._lock:
            first = not self._drain_by_signal
            self._draining = True
            self._drain_by_signal = True
        if first:
            threading.Thread(target=self._drain_self, name="agq-drain", daemon=True).start()
        self._wake.set()

    def kill(self) -> None:
        """Stops at once (as a second SIGTERM): running tasks are told to
        stop, nothing is reported, the worker does not unregister and
        :meth:`run` returns FORCED. The server re-queues the leases."""
        with self._lock:
            self._killed = True
        self._wake.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs on the main thread between two bytecodes, perhaps while it
        # holds a lock: only count; the supervisor loop acts on the count.
        self._signals += 1

    # -- the main loop -------------------------------------------------------

    def run(self, *, handle_signals: bool = True) -> WorkerExit:
        """Runs the worker until it has drained or is killed; blocks.

        With ``handle_signals`` (and on the main thread) SIGTERM and SIGINT
        start a drain and a second one exits at once; the previous handlers
        are restored on return. Raises :class:`WorkerError` when the server
        refuses the first registration for good (the worker never ran);
        connection losses are retried forever with backoff.
        """
        if not self._functions:
            raise ValueError("register at least one task function before run()")
        old: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                old[s] = signal.signal(s, self._on_signal)
        try:
            return self._supervise()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _supervise(self) -> WorkerExit:
        log.info(
            "worker %s starting: server %s, tools %s, max_concurrent_jobs %d",
            self.worker_id, self.address, ",".join(self.tools), self.max_concurrent_jobs,
        )
        session = threading.Thread(target=self._session_loop, name="agq-session", daemon=True)
        session.start()
        drain_deadline: float | None = None
        report_deadline: float | None = None
        # Jobs stopped at the drain timeout: their reports get
        # KILLED_REPORT_GRACE; a finished job's report is waited for.
        stopped: set[str] = set()
        signals_seen = 0
        while True:
            self._wake.wait(0.2)
            self._wake.clear()
            signals = self._signals
            if signals > signals_seen:
                signals_seen = signals
                if signals == 1:
                    log.info("signal: draining (send another to exit at once)")
                    self.stop()
                else:
                    log.warning("second signal: exiting now")
                    self.kill()
            with self._lock:
                killed, draining, by_signal = self._killed, self._draining, self._drain_by_signal
                running = len(self._jobs)
            if killed:
                self._abort_all("worker killed")
                self._leave()
                self._channel.close()
                return WorkerExit.FORCED
            if self._fatal is not None:
                self._abort_all("worker stopped")
                self._leave()
                self._channel.close()
                raise self._fatal
            if draining and running == 0:
                break
            now = time.monotonic()
            if by_signal and drain_deadline is None:
                drain_deadline = now + self.drain_timeout
            if drain_deadline is not None and report_deadline is None and now >= drain_deadline:
                log.warning("drain timeout: stopping %d running jobs", running)
                stopped = self._abort_running(f"drain timeout ({self.drain_timeout:g} s)")
                report_deadline = now + KILLED_REPORT_GRACE
            if report_deadline is not None and now >= report_deadline:
                with self._lock:
                    pending = any(j not in stopped for j in self._jobs)
                if not pending:
                    log.warning("stopped jobs did not report in time; unregistering anyway")
                    break
                # As agw: a finished job's result must not be thrown away.
                log.warning("results of finished jobs still wait for the server; waiting for "
                            "it (kill() or another signal exits at once)")
                report_deadline = math.inf
        self._leave()
        if self._ever_connected:
            # As agw: kill() or a signal while unregistering exits at once.
            seen = self._signals
            if self._unregister(lambda: self._killed or self._signals > seen):
                log.warning("exiting now, without unregistering")
                with self._lock:
                    self._killed = True
                self._channel.close()
                return WorkerExit.FORCED
        self._channel.close()
        return WorkerExit.DRAINED

    def _leave(self) -> None:
        """Marks the worker as leaving and ends the jobs' progress reports."""
        self._leaving.set()
        with self._lock:
            senders = list(self._progress)
        for p in senders:
            p.close(0.0)

    def _abort_all(self, reason: str) -> None:
        with self._lock:
            for r in self._jobs.values():
                r.stop(reason)

    def _abort_running(self, reason: str) -> set[str]:
        """Stops the jobs still running, not those whose final report is
        on its way (their result stands); returns the ids of those stopped."""
        with self._lock:
            running = {j: r for j, r in self._jobs.items() if not r.reporting}
            for r in running.values():
                r.stop(reason)
        return set(running)

    def _call_unary(self, method: str, fn: Callable[..., object], req: object) -> object:
        try:
            return fn(req, timeout=self.call_timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise AgqError.from_rpc(method, e) from e

    def _drain_self(self, retry: bool = True) -> None:
        """Tells the server that this worker drains (DrainWorker). With
        ``retry`` a transient failure (UNAVAILABLE: the server is down or
        its store cannot commit, ...) is retried with backoff until the
        server takes it or the worker leaves: while the connection stays
        up no reconnect repeats it, and the server would keep sending
        leases that the drain timeout kills. Other refusals (NOT_FOUND
        before the first registration) are left to the next reconnect,
        which repeats the call once."""
        delays = _backoff(0.25, 5.0)
        while True:
            try:
                self._call_unary(
                    "DrainWorker", self._stub.DrainWorker,
                    worker_service_pb2.DrainWorkerRequest(worker_id=self.worker_id),
                )
                log.info("server set %s DRAINING", self.worker_id)
                return
            except AgqError as e:
                if retry and e.code in _TRANSIENT and not self._leaving.is_set():
                    d = next(delays)
                    log.warning("DrainWorker failed: %s; retrying in %.2f s", e, d)
                    if self._leaving.wait(d):
                        return
                    continue
                log.warning("DrainWorker failed (a reconnect repeats it): %s", e)
                return
            except ValueError:
                return  # the channel is closed: the worker has left

    def _unregister(self, give_up: Callable[[], bool]) -> bool:
        """Unregisters, retrying transient failures for up to
        :data:`UNREGISTER_TIMEOUT`; True (not unregistered) as soon as
        ``give_up`` says so between tries."""
        deadline = time.monotonic() + UNREGISTER_TIMEOUT
        delays = _backoff(0.25, 2.0)
        while True:
            if give_up():
                return True
            try:
                resp = self._stub.UnregisterWorker(
                    worker_service_pb2.UnregisterWorkerRequest(worker_id=self.worker_id),
                    timeout=max(0.1, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
                log.info("unregistered (%d jobs re-queued)", resp.requeued_jobs)
                return False
            except grpc.RpcError as e:
                code, details = status_of(e)
                if code in _TRANSIENT and time.monotonic() < deadline:
                    until = time.monotonic() + min(
                        next(delays), max(0.0, deadline - time.monotonic()))
                    while not give_up() and time.monotonic() < until:
                        self._wake.wait(min(0.1, max(0.0, until - time.monotonic())))
                        self._wake.clear()
                    continue
                log.warning("UnregisterWorker failed: %s: %s", code.name, details)
                return False

    # -- sessions ------------------------------------------------------------

    def _session_loop(self) -> None:
        delays = _backoff(*self._reconnect_backoff)
        registered_once = False
        while not self._leaving.is_set():
            try:
                established = self._session(registered_once)
            except Exception:  # noqa: BLE001 - a session must not end the worker's sessions
                # grpc raises ValueError for calls on a closed channel: the
                # worker is leaving (run() closed it).
                if self._leaving.is_set():
                    return
                # Anything else (no thread for a lease, say) ends this
                # session only: the streams are closed (the leases not yet
                # started come again) and the worker reconnects.
                log.exception("session failed; reconnecting")
                established = self.connected.is_set()
            self.connected.clear()
            if self._fatal is not None:
                self._wake.set()
                return
            if established:
                registered_once = True
                delays = _backoff(*self._reconnect_backoff)
            if self._leaving.is_set():
                return
            d = next(delays)
            with self._lock:
                holding = bool(self._jobs)
            if holding:
                # Jobs held (running, or results not yet acknowledged): try
                # at least once per heartbeat interval, so that a server
                # back from an outage hears from this worker well within the
                # stale window it waits for its workers.
                d = min(d, self._interval or DEFAULT_HEARTBEAT_INTERVAL)
            log.warning("connection lost; reconnecting in %.1f s", d)
            self._leaving.wait(d)

    def _heartbeat(self, first: bool) -> worker_service_pb2.HeartbeatRequest:
        with self._lock:
            active = len(self._jobs)
            held = [r.lease_id for r in self._jobs.values()]
        req = worker_service_pb2.HeartbeatRequest(
            worker_id=self.worker_id, stats=self._stats.message(active)
        )
        if first:
            req.held_leases.CopyFrom(worker_service_pb2.HeldLeases(lease_ids=held))
        return req

    def _session(self, registered_once: bool) -> bool:
        """One connection: register, both streams, serve. Returns True when
        both streams were opened."""
        caps = common_pb2.WorkerCapabilities(tools=list(self.tools))
        req = worker_service_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id,
            hostname=self.hostname,
            platform=f"{platform.system().lower()}-{platform.machine()}"[:64],
            agw_version=f"agq-python/{__version__}",
            capabilities=caps,
            max_concurrent_jobs=self.max_concurrent_jobs,
            tags=self.tags,
            sandboxed=False,
            instance_id=self._instance_id,
        )
        try:
            resp = self._stub.RegisterWorker(
                req, timeout=self.call_timeout, metadata=self._metadata
            )
            if resp.heartbeat_interval_ms > 0:
                self._interval = resp.heartbeat_interval_ms / 1000.0
            elif resp.heartbeat_interval_secs > 0:
                self._interval = float(resp.heartbeat_interval_secs)
        except grpc.RpcError as e:
            code, details = status_of(e)
            if code == grpc.StatusCode.ALREADY_EXISTS:
                # This process's instance id resumes without an error, so
                # ALREADY_EXISTS means another live process runs this id.
                err = WorkerError(
                    f"worker id {self.worker_id} is taken by another live worker process: "
                    f"{details}"
                )
                err.__cause__ = AgqError.from_rpc("RegisterWorker", e)
                self._fatal = err
                return False
            elif not registered_once and code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                err = WorkerError(f"RegisterWorker refused: {code.name}: {details}")
                err.__cause__ = AgqError.from_rpc("RegisterWorker", e)
                self._fatal = err
                return False
            else:
                log.warning("RegisterWorker: %s: %s", code.name, details)
                return False

        with self._lock:
            draining = self._draining
        if draining:
            self._drain_self(retry=False)  # the heartbeats must not wait

        events: queue.Queue[tuple[str, object]] = queue.Queue()
        done = threading.Event()

        def requests() -> Iterator[worker_service_pb2.HeartbeatRequest]:
            yield self._heartbeat(first=True)
            while not done.wait(self._interval or DEFAULT_HEARTBEAT_INTERVAL):
                yield self._heartbeat(first=False)

        hb_call = self._stub.Heartbeat(requests(), metadata=self._metadata)
        calls: list[grpc.Call] = [hb_call]

        def pump(kind: str, it: Iterator[object]) -> None:
            try:
                for m in it:
                    events.put((kind, m))
                events.put((kind + "-end", None))
            except grpc.RpcError as e:
                events.put((kind + "-end", e))

        threading.Thread(target=pump, args=("hb", hb_call), daemon=True).start()
        try:
            try:
                kind, m = events.get(timeout=self.call_timeout)
            except queue.Empty:
                log.warning("no answer to the first heartbeat")
                return False
            if kind != "hb":
                log.warning("heartbeat stream: %s", self._describe(m))
                return False
            first = m
            assert isinstance(first, worker_service_pb2.HeartbeatResponse)
            if self._interval is None and first.HasField("next_deadline"):
                left = timestamp(first.next_deadline).timestamp() - time.time()
                self._interval = min(60.0, max(0.1, left / 2))
            self._on_heartbeat(first)

            lease_call = self._stub.LeaseJobs(
                worker_service_pb2.LeaseJobsRequest(worker_id=self.worker_id),
                metadata=self._metadata,
            )
            calls.append(lease_call)
            threading.Thread(target=pump, args=("lease", lease_call), daemon=True).start()
            self._ever_connected = True
            self.connected.set()
            log.info(
                "registered %s with %d tools: %s (heartbeat every %.2f s)",
                self.worker_id, len(self.tools), ",".join(self.tools),
                self._interval or DEFAULT_HEARTBEAT_INTERVAL,
            )
            while not self._leaving.is_set():
                try:
                    kind, m = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if kind == "hb":
                    assert isinstance(m, worker_service_pb2.HeartbeatResponse)
                    self._on_heartbeat(m)
                elif kind == "lease":
                    assert isinstance(m, worker_service_pb2.JobLease)
                    self._start_job(m)
                else:
                    log.warning("%s stream ended: %s", kind[:-4], self._describe(m))
                    return True
            return True
        finally:
            done.set()
            for c in calls:
                c.cancel()

    @staticmethod
    def _describe(m: object) -> str:
        if isinstance(m, grpc.RpcError):
            code, details = status_of(m)
            return f"{code.name}: {details}"
        return "closed by the server"

    def _on_heartbeat(self, r: worker_service_pb2.HeartbeatResponse) -> None:
        # Leases named on reconnecting that the server took back meanwhile
        # (the job was cancelled, or went to another worker): stop them.
        if r.revoked_lease_ids:
            revoked = set(r.revoked_lease_ids)
            with self._lock:
                stale = [(j, run) for j, run in self._jobs.items() if run.lease_id in revoked]
            for job_id, held in stale:
                log.warning("job %s: lease revoked while disconnected: stopping it", job_id)
                held.stop("lease revoked")
        which = r.WhichOneof("command")
        if which == "drain":
            with self._lock:
                already = self._draining
                self._draining = True
            if not already:
                log.info("server asked us to drain (%s): taking no new leases", r.drain.reason)
            self._wake.set()
        elif which == "cancel_job_id":
            with self._lock:
                running = self._jobs.get(r.cancel_job_id)
            # Only the attempt named: a newer lease of the same job, which
            # may have arrived first on the lease stream, runs on.
            if running is not None and r.cancel_lease_id not in ("", running.lease_id):
                log.debug("cancel of an earlier attempt of job %s: ignored", r.cancel_job_id)
                running = None
            if running is not None:
                log.info("job %s cancelled by the server: stopping it", r.cancel_job_id)
                running.stop("cancelled")
        elif which == "verify":
            # Capability challenges are for agw's executables; a Python
            # worker's functions are not verified (its challenge stays
            # pending, so plans that require verification never run here).
            log.warning(
                "capability challenge for %s ignored: Python workers do not answer them",
                r.verify.command,
            )

    # -- jobs ------------------------------------------------------------------

    def _start_job(self, lease: worker_service_pb2.JobLease) -> None:
        job_id = lease.job.job_id
        with self._lock:
            old = self._jobs.get(job_id)
            if old is not None and old.lease_id == lease.lease_id:
                return
            if old is not None:
                old.stop("superseded by a newer lease")
            running = _Running(lease.lease_id)
            self._jobs[job_id] = running
        log.info("lease %s: job %s attempt %d", lease.lease_id, job_id, lease.attempt)
        try:
            threading.Thread(
                target=self._run_job, args=(lease, running), name=f"agq-job-{job_id}",
                daemon=True,
            ).start()
        except BaseException:
            # Not held: the session ends and the lease comes again (or is
            # re-queued) once the worker has reconnected without it.
            with self._lock:
                if self._jobs.get(job_id) is running:
                    del self._jobs[job_id]
            raise

    def _update(
        self, lease: worker_service_pb2.JobLease, status: common_pb2.JobStatus.ValueType
    ) -> worker_service_pb2.UpdateJobRequest:
        return worker_service_pb2.UpdateJobRequest(
            job_id=lease.job.job_id,
            worker_id=self.worker_id,
            lease_id=lease.lease_id,
            status=status,
        )

    def _run_job(self, lease: worker_service_pb2.JobLease, running: _Running) -> None:
        """Runs the leased job and reports its result. Whatever goes wrong
        on the way, the job is reported (failed) and let go: an exception
        here would leave the lease held, listed in ``held_leases``, never
        reported and counted by a drain until its timeout."""
        job_id = lease.job.job_id
        progress = _Progress(self, lease, running)
        with self._lock:
            self._progress.add(progress)
        try:
            try:
                req = self._attempt(lease, running, progress)
            except Exception as e:  # noqa: BLE001 - reported as the attempt's failure
                log.exception("job %s: the worker failed to run it", job_id)
                req = self._update(lease, common_pb2.JOB_STATUS_FAILED)
                req.error = f"the worker failed to run the job: {_exc_text(e)}"
            finally:
                # The report in flight is waited for, so that it lands
                # before the final one, but not past its call's deadline
                # (call_timeout after it started; the extra second is slack
                # for the thread) nor PROGRESS_SETTLE_WAIT: a RUNNING report
                # that arrives after the final one is refused, and a hung
                # server must not hold the result back. Nothing is waited
                # for when nothing is reported (killed).
                progress.close(0.0 if self._killed
                               else min(self.call_timeout + 1.0, PROGRESS_SETTLE_WAIT))
                with self._lock:
                    self._progress.discard(progress)
            with self._lock:
                running.reporting = True
            self._report_final(lease, req, aborted=running.cancel.is_set())
        except ValueError:
            log.warning("job %s: result not reported: the worker has stopped", job_id)
        finally:
            with self._lock:
                if self._jobs.get(job_id) is running:
                    del self._jobs[job_id]
            self._wake.set()

    def _attempt(
        self, lease: worker_service_pb2.JobLease, running: _Running, progress: _Progress
    ) -> worker_service_pb2.UpdateJobRequest:
        """Runs the leased job's tasks, reporting each one's start to
        ``progress``; returns its final report."""
        started = time.monotonic()
        job = lease.job
        results: list[TaskResult] = []
        outputs: dict[int, str] = {}
        error = ""
        permanent = False
        tasks = list(lease.plan.tasks)
        if not tasks:
            error = "the lease carries no plan"
        # Waits while earlier jobs' task threads fill every slot; False when
        # the job was stopped meanwhile (the loop then reports it stopped
        # before its first task).
        expires = lease.expires_at.ToNanoseconds() / 1e9 if lease.HasField("expires_at") else None
        slot = bool(tasks) and self._take_slot(job.job_id, running, expires)
        try:
            for task in tasks:
                n = task.task_number
                if running.cancel.is_set():
                    error = f"stopped before task {n}: {running.reason}"
                    break
                fn = self._functions.get(task.command)
                if fn is None:
                    error = f"task {n}: no Python function named {task.command!r} on this worker"
                    results.append(TaskResult(n, task.command, -1, stderr=error + "\n"))
                    break
                try:
                    args = tuple(render(a, job.input) for a in task.args)
                except KeyError as e:
                    error = (f"task {n}: job input has no value for template variable "
                             f"{{{{{e.args[0]}}}}}")
                    results.append(TaskResult(n, task.command, -1, stderr=error + "\n"))
                    break
                progress.submit(n, (n - 1) * 100 // len(tasks))
                stdin = (outputs.get(task.input_from_task, "")
                         if task.HasField("input_from_task") else "")
                ctx = TaskContext(
                    job_id=job.job_id, action_id=job.action_id, plan_id=lease.plan.plan_id,
                    attempt=lease.attempt, task_number=n, command=task.command,
                    input=dict(job.input), args=args, stdin=stdin,
                    timeout_secs=task.timeout_secs, cancelled=running.cancel,
                    log_cap=self.output_cap_bytes,
                )
                result, err, permanent = self._run_task(fn, ctx, task.timeout_secs, running)
                results.append(result)
                outputs[n] = result.stdout
                if err:
                    error = err
                    break
        finally:
            if slot:
                self._give_slot()
        success = not error
        ms = int((time.monotonic() - started) * 1000)
        self._stats.record(success, ms)
        log.info("job %s %s in %d ms%s", job.job_id, "completed" if success else "failed",
                 ms, "" if success else f": {error}")
        req = self._update(
            lease, common_pb2.JOB_STATUS_COMPLETED if success else common_pb2.JOB_STATUS_FAILED
        )
        req.current_task = results[-1].task_number if results else 0
        req.progress_percent = 100 if success else 0
        req.error = _text(error)
        req.permanent = permanent and not success
        budget = REPORT_BUDGET_BYTES
        for r in results:
            out, out_cut = _clip(r.stdout, max(0, budget))
            budget -= len(out.encode())
            err_text, err_cut = _clip(r.stderr, max(0, budget))
            budget -= len(err_text.encode())
            req.task_results.append(
                TaskResult(
                    r.task_number, r.command, r.exit_code, out, err_text, r.duration_ms,
                    r.stdout_truncated or out_cut, r.stderr_truncated or err_cut,
                ).to_pb()
            )
        return req

    def _take_slot(self, job_id: str, running: _Running, expires: float | None) -> bool:
        """Waits until a slot is free and no earlier attempt of the job
        still runs a function, then takes the slot; False (nothing taken)
        when the job is stopped first, or its lease expires (``expires``,
        Unix seconds) while it waits.

        A slot is taken by each job running its tasks and by each task
        thread of a stopped job whose function ignored ``ctx.cancelled`` and
        still runs (Python cannot kill it): together at most
        ``max_concurrent_jobs``, so such threads cannot pile up. A lease the
        server sends while they fill the slots waits here (held, listed in
        ``held_leases``) until one of them returns. A job leased again while
        its earlier attempt's function still runs (the attempt was
        superseded, revoked or timed out) waits here too: one job's
        functions never run beside each other on this worker."""
        told_slots = told_job = False
        with self._slots:
            while True:
                earlier = self._job_threads.get(job_id, 0)
                full = self._busy + len(self._leftover) >= self.max_concurrent_jobs
                if not earlier and not full:
                    break
                if running.cancel.is_set():
                    return False
                if expires is not None and time.time() >= expires:
                    running.stop("the lease expired while the job waited to start")
                    return False
                if earlier and not told_job:
                    told_job = True
                    log.warning(
                        "job %s waits for its earlier attempt: %d task function(s) of it still "
                        "run (they ignore ctx.cancelled)", job_id, earlier,
                    )
                elif full and not earlier and not told_slots:
                    told_slots = True
                    log.warning(
                        "job %s waits for a slot: %d task thread(s) of stopped jobs still run "
                        "(their functions ignore ctx.cancelled) and count toward "
                        "max_concurrent_jobs=%d", job_id, len(self._leftover),
                        self.max_concurrent_jobs,
                    )
                self._slots.wait(0.2)
            self._busy += 1
        if told_slots or told_job:
            log.info("job %s: nothing holds it back any more, starting it", job_id)
        return True

    def _give_slot(self) -> None:
        with self._slots:
            self._busy -= 1
            self._slots.notify_all()

    def _run_task(
        self, fn: TaskFunction, ctx: TaskContext, timeout_secs: int, running: _Running
    ) -> tuple[TaskResult, str, bool]:
        """Runs one task function on its own thread; returns its result, the
        job error ("" on success) and whether the failure is permanent (the
        function raised :class:`PermanentFailure`)."""
        box: dict[str, object] = {}
        finished = threading.Event()
        isolated = ctx.command in self._isolated

        def call() -> None:
            try:
                if isolated:
                    self._call_in_process(fn, ctx, running, box)
                else:
                    # Made text here: a value whose str() raises fails the task.
                    box["value"] = _output_text(fn(ctx))
            except BaseException as e:  # noqa: BLE001 - reported as the task's failure
                box["error"] = e
                box["trace"] = traceback.format_exc()
            finally:
                # Under the slots' lock: the abandonment below checks
                # `finished` under it, so a thread is never left counted.
                with self._slots:
                    finished.set()
                    left = self._job_threads.get(ctx.job_id, 1) - 1
                    if left > 0:
                        self._job_threads[ctx.job_id] = left
                    else:
                        self._job_threads.pop(ctx.job_id, None)
                    self._slots.notify_all()
                    if thread in self._leftover:
                        self._leftover.discard(thread)
                        self._slots.notify_all()
                        log.info(
                            "job %s: the function of stopped task %d returned after %.1f s; "
                            "its slot is free", ctx.job_id, ctx.task_number,
                            time.monotonic() - t0,
                        )

        t0 = time.monotonic()
        thread = threading.Thread(target=call, name=f"agq-task-{ctx.job_id}-{ctx.task_number}",
                                  daemon=True)
        with self._slots:
            # Checked under the lock that a newer attempt waits on: once it
            # sees no function of this job running, none starts.
            if running.cancel.is_set():
                return (TaskResult(ctx.task_number, ctx.command, -1, "",
                                   f"stopped: {running.reason}\n", 0),
                        f"stopped before task {ctx.task_number}: {running.reason}", False)
            self._job_threads[ctx.job_id] = self._job_threads.get(ctx.job_id, 0) + 1
            thread.start()
        limit = t0 + (timeout_secs if timeout_secs > 0 else 86_400)
        stopped = ""
        while not finished.wait(0.05):
            if running.cancel.is_set():
                # Give a cooperative function a moment to notice.
                finished.wait(1.0)
                stopped = running.reason
                break
            if time.monotonic() >= limit:
                running.stop(f"task {ctx.task_number} timed out after {timeout_secs} s")
                finished.wait(1.0)
                stopped = running.reason
                break
        if not stopped and running.cancel.is_set():
            stopped = running.reason
        ms = int((time.monotonic() - t0) * 1000)
        cap = self.output_cap_bytes
        n, cmd = ctx.task_number, ctx.command
        abandoned = 0
        if stopped:
            with self._slots:
                if not finished.is_set():
                    self._leftover.add(thread)
                    abandoned = len(self._leftover)
        if abandoned:
            log.warning(
                "job %s: the function of task %d (%s) ignores ctx.cancelled and still runs; "
                "its thread holds a slot until it returns (%d such thread(s), "
                "max_concurrent_jobs=%d)", ctx.job_id, n, cmd, abandoned,
                self.max_concurrent_jobs,
            )
        if stopped and not finished.is_set():
            stderr, cut = _clip(ctx.stderr() + f"stopped: {stopped}\n", cap)
            cut |= ctx._log_cut
            return (TaskResult(n, cmd, -1, "", stderr, ms, False, cut),
                    f"task {n} ({cmd}) stopped: {stopped}", False)
        if "error" in box:
            exc = box["error"]
            stderr, cut = _clip(ctx.stderr() + str(box.get("trace", "")), cap)
            cut |= ctx._log_cut
            if stopped:
                return (TaskResult(n, cmd, -1, "", stderr, ms, False, cut),
                        f"task {n} ({cmd}) stopped: {stopped}", False)
            if isinstance(exc, _ChildFailure):
                return (TaskResult(n, cmd, exc.exit_code, "", stderr, ms, False, cut),
                        f"task {n} ({cmd}) failed: {exc.what}", exc.permanent)
            what = _exc_text(exc) if isinstance(exc, BaseException) else str(exc)
            return (TaskResult(n, cmd, 1, "", stderr, ms, False, cut),
                    f"task {n} ({cmd}) failed: {what}", isinstance(exc, PermanentFailure))
        stdout, out_cut = _clip(_output_text(box.get("value")), cap)
        out_cut |= bool(box.get("cut"))
        stderr, err_cut = _clip(ctx.stderr(), cap)
        err_cut |= ctx._log_cut
        if stopped:
            return (TaskResult(n, cmd, -1, stdout, stderr, ms, out_cut, err_cut),
                    f"task {n} ({cmd}) stopped: {stopped}", False)
        return TaskResult(n, cmd, 0, stdout, stderr, ms, out_cut, err_cut), "", False

    def _call_in_process(
        self, fn: TaskFunction, ctx: TaskContext, running: _Running, box: dict[str, object]
    ) -> None:
        """Runs ``fn`` in a child process (spawned) and puts its outcome in
        ``box`` as the thread form does: "value" (its output, already
        text), or "error" (a :class:`_ChildFailure`) and "trace". Kills the
        child once ``running`` is stopped; its logged lines join
        ``ctx``'s."""
        mp = multiprocessing.get_context("spawn")
        recv, send = mp.Pipe(duplex=False)
        fields = {
            "job_id": ctx.job_id, "action_id": ctx.action_id, "plan_id": ctx.plan_id,
            "attempt": ctx.attempt, "task_number": ctx.task_number, "command": ctx.command,
            "input": dict(ctx.input), "args": ctx.args, "stdin": ctx.stdin,
            "timeout_secs": ctx.timeout_secs,
        }
        proc = mp.Process(
            target=_child_main, args=(send, fn, fields, self.output_cap_bytes),
            name=f"agq-task-{ctx.job_id}-{ctx.task_number}", daemon=True,
        )
        try:
            with _REAP_LOCK:
                proc.start()
        except BaseException:
            recv.close()
            raise
        finally:
            send.close()
        msg: tuple[Any, ...] | None = None
        try:
            while msg is None and not running.cancel.is_set():
                if recv.poll(0.05):
                    try:
                        msg = recv.recv()
                    except (EOFError, OSError):
                        break  # the child exited without a result
                elif _ended(proc) and not recv.poll(0):
                    break
        finally:
            # A process that sent its result exits on its own (unless, say,
            # its function left a non-daemon thread running); a stopped one
            # is killed at once.
            if msg is not None:
                _await_end(proc, 2.0)
            if not _ended(proc):
                _signal(proc, signal.SIGTERM)
                if not _await_end(proc, PROCESS_KILL_GRACE):
                    _signal(proc, signal.SIGKILL)
                    _await_end(proc, None)
            # Reaps it: its sentinel is ready a moment before its status.
            code = _exit_status(proc)
            recv.close()
        if msg is None:
            if running.cancel.is_set():
                box["value"] = None  # reported as stopped by the caller
                return
            if code is None:
                how = "ended (its exit status was taken by another part of the program)"
            elif code < 0:
                how = f"was killed by signal {-code}"
            else:
                how = f"exited with code {code}"
            box["error"] = _ChildFailure(
                f"the task's process {how} without a result", False,
                code if code is not None and code > 0 else -1)
            box["trace"] = ""
            return
        kind, text, logged = msg[0], msg[1], msg[2]
        with ctx._lock:
            ctx._log.append(logged)
            ctx._log_cut |= bool(msg[-1])
        if kind == "value":
            box["value"] = text
            box["cut"] = bool(msg[3])
        else:
            what, trace, permanent = msg[3], msg[4], msg[5]
            box["error"] = _ChildFailure(what, permanent, 1)
            box["trace"] = trace

    def _report_final(
        self,
        lease: worker_service_pb2.JobLease,
        req: worker_service_pb2.UpdateJobRequest,
        *,
        aborted: bool,
    ) -> None:
        """Sends the final report until the server acknowledges it (a report
        already applied by a try whose reply was lost is acknowledged again)
        or fences it (FAILED_PRECONDITION, PERMISSION_DENIED, NOT_FOUND: the
        lease is no longer ours). While the server is unreachable, its
        store cannot commit (UNAVAILABLE, DEADLINE_EXCEEDED, ...) or it is
        too busy to take the report now (a refusal with a retry pushback:
        sent again as it is, outputs included, no sooner than the
        pushback), it retries with backoff (:data:`REPORT_BACKOFF`), past
        the lease's expiry too:
        only the server can say the attempt is over, and the job stays held
        (listed in ``held_leases`` on reconnect) meanwhile, as agw does. It
        gives up only when the worker is killed (a second signal,
        :meth:`Worker.kill`) or has left (a drain leaves once every report
        is acknowledged, except those of jobs stopped at the drain timeout,
        which get :data:`KILLED_REPORT_GRACE`): the server then re-queues
        the lease."""
        if self._killed:
            return  # left without reporting: the server re-queues the lease
        expires = timestamp(lease.expires_at).timestamp() if lease.HasField("expires_at") else None
        delays = _backoff(*REPORT_BACKOFF)
        # How much was cut to fit the server's limit: 0 none, 1 the outputs
        # (and the error past 4 KiB), 2 all but the outcome and 256 bytes of
        # the error, which fits any limit the server may set.
        stripped = 0
        told_expired = False
        job_id = lease.job.job_id
        while True:
            try:
                self._stub.UpdateJob(req, timeout=self.call_timeout, metadata=self._metadata)
                if told_expired:
                    log.info("job %s: result acknowledged after the lease's expiry", job_id)
                return
            except grpc.RpcError as e:
                code, details = status_of(e)
                pushed = _pushback(e)
            if (code in _TRANSIENT or pushed is not None
                    or (stripped == 2 and code == grpc.StatusCode.RESOURCE_EXHAUSTED)):
                if self._killed or self._leaving.is_set():
                    log.warning("job %s: result not reported (%s: %s): the worker is leaving",
                                job_id, code.name, details)
                    return
                if not told_expired and expires is not None and time.time() > expires:
                    told_expired = True
                    log.info("job %s: the lease expired before the server acknowledged the "
                             "result; reporting until it acknowledges or fences it", job_id)
                d = max(next(delays), pushed or 0.0)
                log.warning("job %s: result not acknowledged yet (%s: %s); retrying in %.2f s",
                            job_id, code.name, details, d)
                self._leaving.wait(d)
                continue
            if code in _LEASE_GONE:
                (log.debug if aborted else log.warning)(
                    "job %s: result refused, the lease is no longer ours: %s", job_id, details)
                return
            if stripped < 2 and code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.OUT_OF_RANGE,
            ):
                stripped += 1
                if stripped == 1:
                    log.warning("job %s: result refused (%s); sending it without outputs",
                                job_id, details)
                    for r in req.task_results:
                        r.stdout_truncated |= bool(r.stdout)
                        r.stderr_truncated |= bool(r.stderr)
                        r.stdout = ""
                        r.stderr = ""
                    req.error = _cut(req.error, 4096)
                else:
                    log.warning("job %s: result refused again (%s); sending only its outcome",
                                job_id, details)
                    del req.task_results[:]
                    req.error = _cut(req.error, 256)
                continue
            log.error("job %s: result refused: %s: %s", job_id, code.name, details)
            return
