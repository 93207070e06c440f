"""Fixtures: a live ``agq serve`` on loopback (binary from $AGQ_BIN, default
<repo>/target/debug/agq), clients and in-process Python workers."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import agq

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
AGQ_BIN = os.environ.get("AGQ_BIN", str(REPO / "target" / "debug" / "agq"))

#: Every wait in these tests is bounded by this many seconds.
WAIT = 30.0


def wait_until(pred: Callable[[], object], what: str, timeout: float = WAIT) -> None:
    """Polls ``pred`` every 50 ms until it is truthy; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Server:
    """One ``agq serve`` process with a fresh database under ``tmp``; its
    workers beat every ``heartbeat_interval_ms`` (DEAD after 3 missed)."""

    def __init__(self, tmp: Path, extra: Sequence[str] = (), listen: str = "127.0.0.1:0",
                 heartbeat_interval_ms: int = 500) -> None:
        if not os.access(AGQ_BIN, os.X_OK):
            pytest.fail(f"agq binary not found at {AGQ_BIN}: build it (cargo build) or set AGQ_BIN")
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "agq.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                AGQ_BIN, "serve",
                "--listen", listen,
                "--metrics-listen", "127.0.0.1:0",
                "--console-listen", "127.0.0.1:0",
                "--db", str(tmp / "agq.db"),
                "--heartbeat-interval-ms", str(heartbeat_interval_ms),
                # Re-queue a dead worker's leases soon, and retry soon.
                "--lease-grace-ms", "1000",
                "--retry-backoff-base-ms", "100",
                "--retry-backoff-max-ms", "500",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
        )
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                lines.put(raw.decode("utf-8", "replace").rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
        try:
            first = lines.get(timeout=WAIT)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"agq serve printed nothing; log: {self.log()}") from None
        if not first.startswith("listening on "):
            self.stop()
            raise AssertionError(f"unexpected first line {first!r}; log: {self.log()}")
        self.address = first.removeprefix("listening on ").strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=WAIT)
        self._log.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "server")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(server: Server) -> Iterator[agq.Client]:
    with agq.Client(server.address, timeout=10) as c:
        yield c


class WorkerThread:
    """An :class:`agq.Worker` running on a background thread."""

    def __init__(self, worker: agq.Worker) -> None:
        self.worker = worker
        self.exit: agq.WorkerExit | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.exit = self.worker.run(handle_signals=False)
        except BaseException as e:  # noqa: BLE001 - kept for the test to assert
            self.error = e

    def wait_connected(self) -> None:
        wait_until(
            lambda: self.worker.connected.is_set() or not self.thread.is_alive(),
            f"worker {self.worker.worker_id} to connect",
        )
        if self.error is not None:
            raise self.error
        assert self.worker.connected.is_set()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(timeout=WAIT + 15)
        assert not self.thread.is_alive(), "worker did not drain in time"


@pytest.fixture
def start_worker() -> Iterator[Callable[[agq.Worker], WorkerThread]]:
    started: list[WorkerThread] = []

    def start(w: agq.Worker) -> WorkerThread:
        t = WorkerThread(w)
        started.append(t)
        return t

    yield start
    for t in started:
        if t.thread.is_alive():
            t.worker.kill()
            t.thread.join(timeout=WAIT)


def spawn_worker(
    address: str, worker_id: str, workdir: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """Runs tests/worker_proc.py as a separate process (its own signals)."""
    log = open(workdir / f"{worker_id}.log", "wb")
    return subprocess.Popen(
        [sys.executable, str(HERE / "worker_proc.py"), "--address", address,
         "--worker-id", worker_id, "--dir", str(workdir), *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
