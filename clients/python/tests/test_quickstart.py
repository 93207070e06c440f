"""examples/quickstart.py runs end to end against a live server."""

from __future__ import annotations

import subprocess
import sys

from conftest import HERE, WAIT, Server


def test_quickstart_example(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, str(HERE.parent / "examples" / "quickstart.py"),
         "--server", server.address, "to be or not to be", "a b a"],
        capture_output=True, text=True, timeout=WAIT * 2,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "'to be or not to be': completed on py-quickstart: be=2 to=2" in out.stdout
    assert "'a b a': completed on py-quickstart: a=2 b=1" in out.stdout
