"""gRPC plumbing shared by the client and the worker: channels, bearer
metadata, the error type and retries with backoff on UNAVAILABLE."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

Metadata = tuple[tuple[str, str | bytes], ...]

#: Largest message the client accepts (job results carry task output).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class AgqError(Exception):
    """A call to the AGQ server failed.

    ``code`` is the gRPC status (e.g. ``grpc.StatusCode.NOT_FOUND``),
    ``details`` the server's message and ``method`` the RPC that failed.
    The original :class:`grpc.RpcError` is the ``__cause__``.
    """

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, method: str, err: grpc.RpcError) -> AgqError:
        """Wraps a grpc error (any code; UNKNOWN when it carries none)."""
        code, details = status_of(err)
        return cls(method, code, details)


def status_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a grpc error."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else None
    return code, details or str(err)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that fail with UNAVAILABLE (server down or unreachable).

    ``attempts`` is the total number of tries (1 disables retries); the
    delay before try n+1 is ``initial_backoff * multiplier**(n-1)`` seconds,
    capped at ``max_backoff`` seconds, with +-20 % jitter. Each try has its
    own deadline (the call's timeout). Raises ValueError naming a field out
    of range: ``attempts`` under 1, a backoff negative or not finite, a
    ``multiplier`` under 1 or not finite.
    """

    attempts: int = 5
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1 (1: no retry), got {self.attempts!r}")
        for name in ("initial_backoff", "max_backoff"):
            value = getattr(self, name)
            # `not value >= 0` rather than `value < 0`: NaN is refused too.
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.multiplier >= 1 or math.isinf(self.multiplier):
            raise ValueError(f"multiplier must be a finite number >= 1, got {self.multiplier!r}")

    def delays(self) -> Iterator[float]:
        """The jittered delays in seconds between tries (``attempts - 1`` of them)."""
        d = self.initial_backoff
        for _ in range(max(0, self.attempts - 1)):
            yield min(d, self.max_backoff) * random.uniform(0.8, 1.2)
            d *= self.multiplier


def bearer(token: str | None) -> Metadata:
    """The ``authorization: Bearer <token>`` metadata; empty without a token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def tls_credentials(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files: ``ca_file`` verifies the server
    (system roots when None); ``cert_file`` and ``key_file`` together present
    a client certificate (mutual TLS). Raises OSError when a file cannot be read."""

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file),
        private_key=read(key_file),
        certificate_chain=read(cert_file),
    )


def make_channel(
    address: str,
    tls: bool | grpc.ChannelCredentials | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel:
    """A channel to ``address`` (``host:port``; a leading ``http://`` is
    stripped, ``https://`` implies TLS). ``tls``: None/False for plaintext,
    True for TLS with the system roots, or credentials from
    :func:`tls_credentials`. ``tls_server_name`` overrides the name the
    server certificate is checked against.

    Each channel is its own HTTP/2 connection (gRPC would otherwise share
    one among all channels of the process to the same address): the
    server allows at most 256 calls open at once on a connection, and
    every open stream (a Worker's heartbeat and lease streams, a watch)
    counts, so many Workers or Clients in one process on one connection
    would wait for each other's streams to end."""
    target = address.strip()
    if target.startswith("http://"):
        target = target[len("http://") :]
    elif target.startswith("https://"):
        target = target[len("https://") :]
        if tls is None:
            tls = True
    target = target.rstrip("/")
    options: list[tuple[str, str | int]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        # Reconnect soon after a server restart (gRPC's default backoff
        # grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        # A connection of this channel's own, not the process-wide pool's.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    if tls is None or tls is False:
        return grpc.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials() if tls is True else tls
    return grpc.secure_channel(target, creds, options=options)


def call_unary(
    method: str,
    fn: Callable[[_Req, float, Metadata], _Resp],
    request: _Req,
    *,
    timeout: float,
    metadata: Metadata,
    retry: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> _Resp:
    """Calls ``fn(request, timeout, metadata)`` (a unary stub method) with a
    ``timeout`` in seconds per try, retrying
    UNAVAILABLE per ``retry``. Raises :class:`AgqError` with the last status."""
    delays = retry.delays()
    while True:
        try:
            return fn(request, timeout, metadata)
        except grpc.RpcError as e:
            code, _ = status_of(e)
            if code == grpc.StatusCode.UNAVAILABLE:
                d = next(delays, None)
                if d is not None:
                    sleep(d)
                    continue
            raise AgqError.from_rpc(method, e) from e
