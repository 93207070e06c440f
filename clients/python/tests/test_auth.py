"""Bearer tokens against a server started with --auth-file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import agq

from conftest import WAIT, Server, WorkerThread

CLIENT_TOKEN = "client-token-0123456789abcdef"
WORKER_TOKEN = "worker-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[Server]:
    auth = tmp_path / "auth.toml"
    auth.write_text(
        f'[[tokens]]\ntoken = "{CLIENT_TOKEN}"\nrole = "client"\n\n'
        f'[[tokens]]\ntoken = "{WORKER_TOKEN}"\nrole = "worker"\nworker_id = "py-auth"\n\n'
        f'[[tokens]]\ntoken = "{ADMIN_TOKEN}"\nrole = "admin"\n'
    )
    s = Server(tmp_path / "server", ["--auth-file", str(auth)])
    try:
        yield s
    finally:
        s.stop()


def echo_worker(address: str, worker_id: str, token: str | None) -> agq.Worker:
    w = agq.Worker(address, worker_id, token=token)
    w.register(lambda ctx: ctx.input["say"], name="say")
    return w


def test_tokens_are_sent_and_checked(
    auth_server: Server, start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    with agq.Client(auth_server.address, timeout=10) as anonymous:
        with pytest.raises(agq.AgqError) as e:
            anonymous.queue_stats()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with agq.Client(auth_server.address, token="wrong-token-0123456789", timeout=10) as bad:
        with pytest.raises(agq.AgqError) as e:
            bad.list_plans()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED

    client = agq.Client(auth_server.address, token=CLIENT_TOKEN, timeout=10)
    try:
        client.submit_plan(agq.Plan("py-say", [agq.Task("say")]))
        # A worker token may not act for another worker id.
        impostor = echo_worker(auth_server.address, "py-other", WORKER_TOKEN)
        with pytest.raises(agq.WorkerError) as we:
            impostor.run(handle_signals=False)
        assert isinstance(we.value.__cause__, agq.AgqError)
        assert we.value.__cause__.code == grpc.StatusCode.PERMISSION_DENIED

        w = start_worker(echo_worker(auth_server.address, "py-auth", WORKER_TOKEN))
        w.wait_connected()
        sub = client.submit_action("py-say", [{"say": "hello"}])
        assert client.wait_action(sub.action_id, timeout=WAIT).completed == 1
        job = client.get_job(sub.job_ids[0])
        assert job.result == "hello" and job.worker_id == "py-auth"

        # A client token may read workers but not drain them; an admin may.
        with pytest.raises(agq.AgqError) as e:
            client.drain_worker("py-auth")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with agq.Client(auth_server.address, token=ADMIN_TOKEN, timeout=10) as admin:
            assert admin.drain_worker("py-auth").state is agq.WorkerState.DRAINING
        # The server's drain command ends the idle worker's run.
        w.thread.join(WAIT)
        assert w.exit is agq.WorkerExit.DRAINED
        assert client.get_worker("py-auth").state is agq.WorkerState.UNREGISTERED

        # Forgetting a worker takes the same token as draining it: a client
        # token is refused, the worker's own is accepted.
        with pytest.raises(agq.AgqError) as e:
            client.forget_worker("py-auth")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with agq.Client(auth_server.address, token=WORKER_TOKEN, timeout=10) as own:
            own.forget_worker("py-auth")
        with pytest.raises(agq.AgqError) as e:
            client.get_worker("py-auth")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        client.close()
