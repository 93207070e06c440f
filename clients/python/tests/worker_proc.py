"""A Python worker process for the tests (so that it can be SIGKILLed or
SIGTERMed on its own). Offers the functions ``block`` and ``upper``, and
``stubborn`` (``isolated_tasks.stubborn``, run with ``isolation="process"``).

``block`` writes ``<dir>/started-<job_id>`` and then waits (at most 60 s)
until ``<dir>/release`` exists, returning ``released by <worker_id>``; it
stops early when the job is cancelled. Exit code: 0 after a drain, 130
when stopped at once, 2 when the server refused the registration.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import agq
import isolated_tasks


def build(address: str, worker_id: str, workdir: Path, token: str | None,
          drain_timeout: float) -> agq.Worker:
    """The worker with its two functions."""
    w = agq.Worker(address, worker_id, token=token, max_concurrent_jobs=2,
                   drain_timeout=drain_timeout, reconnect_backoff=(0.2, 2.0))

    @w.task("block")
    def block(ctx: agq.TaskContext) -> str:
        (workdir / f"started-{ctx.job_id}").write_text(worker_id)
        deadline = time.monotonic() + 60
        while not (workdir / "release").exists():
            ctx.check()
            if time.monotonic() > deadline:
                raise TimeoutError("never released")
            ctx.cancelled.wait(0.05)
        return f"released by {worker_id}"

    @w.task("upper")
    def upper(ctx: agq.TaskContext) -> str:
        return ctx.input.get("text", "").upper()

    w.register(isolated_tasks.stubborn, isolation="process")
    return w


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--token")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    w = build(a.address, a.worker_id, a.dir, a.token, a.drain_timeout)
    try:
        result = w.run()
    except agq.WorkerError as e:
        print(f"worker_proc: {e}", file=sys.stderr)
        return 2
    print(f"worker_proc: {result.value}", flush=True)
    return 0 if result is agq.WorkerExit.DRAINED else 130


if __name__ == "__main__":
    sys.exit(main())
