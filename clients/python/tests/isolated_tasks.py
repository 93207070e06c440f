"""Task functions the tests run with ``isolation="process"``: they must be
importable by the spawned child, so they live at a module's top level."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import agq


def shout(ctx: agq.TaskContext) -> str:
    """Logs a line and returns its args in upper case, with its pid."""
    ctx.log(f"shouting in {os.getpid()}")
    return " ".join(a.upper() for a in ctx.args) + f" pid={os.getpid()}"


def broken(ctx: agq.TaskContext) -> str:
    """Fails with ValueError (or PermanentFailure when the input says so)."""
    ctx.log("about to fail")
    if ctx.input.get("permanent"):
        raise agq.PermanentFailure("no point in retrying")
    raise ValueError("bad input")


def stubborn(ctx: agq.TaskContext) -> str:
    """Writes its pid to the input's ``pidfile``, then sleeps 60 s,
    ignoring ctx.cancelled."""
    Path(ctx.input["pidfile"]).write_text(str(os.getpid()))
    time.sleep(60)
    return "too late"


def crash(ctx: agq.TaskContext) -> str:
    """Ends its process at once with exit code 3, as a crash would."""
    os._exit(3)


def crash_leaving_child(ctx: agq.TaskContext) -> str:
    """Forks a process that holds the task process's pipes for 0.2 s, then
    ends its own process at once with exit code 3: the worker learns of
    the crash from the process's state, not from its pipe."""
    if os.fork() == 0:
        time.sleep(0.2)
        os._exit(0)
    os._exit(3)


def hog(ctx: agq.TaskContext) -> str:
    """One regular expression call that holds the GIL for the input's
    ``n`` steps of backtracking (2^n)."""
    n = int(ctx.input["n"])
    t0 = time.monotonic()
    matched = re.match(r"(a+)+$", "a" * n + "b") is not None
    return f"matched={matched} in {time.monotonic() - t0:.1f} s"


def flood(ctx: agq.TaskContext) -> str:
    """Logs the input's ``lines`` lines of 99 bytes and returns ``size`` bytes."""
    for _ in range(int(ctx.input["lines"])):
        ctx.log("z" * 98)
    return "y" * int(ctx.input["size"])
