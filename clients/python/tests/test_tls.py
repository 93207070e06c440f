"""TLS: a client and a worker against a server with --tls-cert/--tls-key
(a test CA made with openssl)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import agq

from conftest import WAIT, Server, WorkerThread


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is needed to make the test certificates")
    d.mkdir(parents=True, exist_ok=True)
    ext = d / "ext.cnf"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=WAIT)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=agq-test-ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return d / "ca.pem", d / "server.pem", d / "server.key"


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    ca, cert, key = make_certs(tmp_path / "certs")
    s = Server(tmp_path / "server", ["--tls-cert", str(cert), "--tls-key", str(key)])
    try:
        yield s, ca
    finally:
        s.stop()


def test_client_and_worker_over_tls(
    tls_server: tuple[Server, Path], start_worker: Callable[[agq.Worker], WorkerThread]
) -> None:
    server, ca = tls_server
    with agq.Client(server.address, timeout=5,
                    retry=agq.RetryPolicy(attempts=1)) as plaintext:
        with pytest.raises(agq.AgqError) as e:
            plaintext.queue_stats()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

    creds = agq.tls_credentials(ca_file=str(ca))
    with agq.Client(server.address, tls=creds, timeout=10) as client:
        w = agq.Worker(server.address, "py-tls-1", tls=agq.tls_credentials(ca_file=str(ca)))
        w.register(lambda ctx: ctx.input["x"] * 2, name="double")
        start_worker(w).wait_connected()
        client.submit_plan(agq.Plan("py-double", [agq.Task("double")]))
        sub = client.submit_action("py-double", [{"x": "ab"}])
        assert client.wait_action(sub.action_id, timeout=WAIT).completed == 1
        assert client.get_job(sub.job_ids[0]).result == "abab"
