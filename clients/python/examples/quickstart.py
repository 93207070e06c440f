#!/usr/bin/env python3
"""AGQ from Python in one file: a Python worker and a client.

Starts an ``agq.Worker`` (on a background thread) that offers two Python
functions, ``words`` and ``top``; stores a two-task Plan that runs them
(``top`` reads the output of ``words``); submits one job per text; follows
the Action over ``WatchAction``; prints each job's result; then drains the
worker. Exits 0 when every job completed.

    agq serve &                  # or any AGQ server
    python3 quickstart.py --server 127.0.0.1:6380 "to be or not to be" "a b a"

Passes ``mypy --strict`` (with the package's ``typing`` extra installed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading

import agq


def make_worker(server: str, token: str | None, worker_id: str) -> agq.Worker:
    """A worker whose functions count words and pick the most common ones."""
    worker = agq.Worker(server, worker_id, token=token, max_concurrent_jobs=4)

    @worker.task("words")
    def words(ctx: agq.TaskContext) -> str:
        counts = collections.Counter(ctx.input["text"].lower().split())
        return json.dumps(counts)

    @worker.task("top")
    def top(ctx: agq.TaskContext) -> str:
        counts: dict[str, int] = json.loads(ctx.stdin)
        n = int(ctx.args[0]) if ctx.args else 3
        best = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        return " ".join(f"{word}={count}" for word, count in best)

    return worker


PLAN = agq.Plan(
    "py-quickstart",
    [
        agq.Task("words", timeout_secs=30),
        agq.Task("top", args=["{{n}}"], timeout_secs=30, input_from_task=1),
    ],
    description="word counts in Python, then the top n",
)


def main() -> int:
    """Runs the example; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--server", default=os.environ.get("AGQ_SERVER", "127.0.0.1:6380"))
    p.add_argument("--token", default=os.environ.get("AGQ_TOKEN"))
    p.add_argument("--worker-id", default="py-quickstart")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the Action")
    p.add_argument("texts", nargs="*", default=["to be or not to be", "the cat and the hat"])
    args = p.parse_args()

    worker = make_worker(args.server, args.token, args.worker_id)
    runner = threading.Thread(target=worker.run, kwargs={"handle_signals": False}, daemon=True)
    runner.start()
    if not worker.connected.wait(30):
        print("quickstart: the worker did not connect", file=sys.stderr)
        return 1

    with agq.Client(args.server, token=args.token, timeout=10) as client:
        try:
            client.submit_plan(PLAN)
        except agq.AgqError as e:
            if e.code.name != "ALREADY_EXISTS":
                raise
        sub = client.submit_action(PLAN.plan_id, [{"text": t, "n": "2"} for t in args.texts])
        print(f"action {sub.action_id}: {len(sub.job_ids)} jobs")
        for status in client.watch_action(sub.action_id, timeout=args.timeout):
            print(f"  {status.finished}/{status.total_jobs} done "
                  f"(running {status.running}, pending {status.pending})")
        completed = 0
        for job_id, text in zip(sub.job_ids, args.texts):
            job = client.get_job(job_id)
            print(f"{text!r}: {job.status.name.lower()} on {job.worker_id}: {job.result or job.error}")
            completed += job.status is agq.JobStatus.COMPLETED

    worker.stop()
    runner.join(60)
    return 0 if completed == len(sub.job_ids) else 1


if __name__ == "__main__":
    sys.exit(main())
