"""Retries on UNAVAILABLE that cannot duplicate work: a reply lost after
the server acted is retried, and the retry's ALREADY_EXISTS is resolved."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

import agq


class LostReply(grpc.RpcError):
    """What grpc raises when the connection drops before the reply."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset (test)"


def flaky(real: Any, calls: list[Any]) -> Any:
    """Wraps a stub method: the first call reaches the server but its reply is lost."""

    def call(req: Any, timeout: float | None = None, metadata: Any = None) -> Any:
        calls.append(req)
        resp = real(req, timeout=timeout, metadata=metadata)
        if len(calls) == 1:
            raise LostReply()
        return resp

    return call


FAST = agq.RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05)


def test_submit_action_retried_after_a_lost_reply_creates_it_once(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    client.submit_plan(agq.Plan("py-once", [agq.Task("nobody")]))
    calls: list[Any] = []
    monkeypatch.setattr(client._actions, "SubmitAction",
                        flaky(client._actions.SubmitAction, calls))
    sub = client.submit_action("py-once", [{"i": "1"}, {"i": "2"}])
    assert len(calls) == 2 and calls[0].action_id == calls[1].action_id == sub.action_id
    assert len(sub.job_ids) == 2
    assert client.get_action(sub.action_id).total_jobs == 2
    assert [client.get_job(j).input["i"] for j in sub.job_ids] == ["1", "2"]


def test_submit_plan_retried_after_a_lost_reply_succeeds(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.retry = FAST
    calls: list[Any] = []
    monkeypatch.setattr(client._plans, "SubmitPlan", flaky(client._plans.SubmitPlan, calls))
    assert client.submit_plan(agq.Plan("py-plan-once", [agq.Task("x")])) == "py-plan-once"
    assert len(calls) == 2


def test_unavailable_is_raised_after_the_last_attempt(
    client: agq.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[Any] = []

    def down(req: Any, timeout: float | None = None, metadata: Any = None) -> Any:
        tries.append(req)
        raise LostReply()

    client.retry = FAST
    monkeypatch.setattr(client._jobs, "GetJob", down)
    with pytest.raises(agq.AgqError) as e:
        client.get_job("x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(tries) == 3
