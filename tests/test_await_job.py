"""AwaitJob (protocol.md 14.27): a caller waits until a job has ended and
gets its final state, data and lastError, over a real server, on SQLite
and PostgreSQL. The outcome is kept for --keep-outcomes seconds after the
end (the job itself is deleted as Bedrock deletes it), so an ended job is
answered at once, and a caller that asks again after a restart is too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

from helpers import create, ok, until
from wire import Client, Reply

pytestmark = pytest.mark.backends

DEADLINE = 15.0
NOT_ENDED = "202 Job not ended yet"


def take(client: Client, name: str) -> dict[str, Any]:
    return ok(client.request("GetJob", name=name)).json


def running(client: Client, name: str = "work", **params: Any) -> int:
    job_id = create(client, name, **params)
    assert take(client, name)["jobID"] == job_id
    return job_id


class Awaiting:
    """An AwaitJob sent on a connection of its own, its reply read in a
    thread, as a caller blocked in it would."""

    def __init__(self, server: Any, job_id: int, timeout_ms: int = int(DEADLINE * 1000)) -> None:
        self.client = server.client(timeout=DEADLINE + 5)
        self.client.send(
            f"AwaitJob\r\njobID: {job_id}\r\ntimeout: {timeout_ms}\r\n\r\n".encode()
        )
        self.reply: Reply | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        # The server may go away first: no reply.
        with contextlib.suppress(OSError):
            self.reply = self.client.read_reply()

    def result(self) -> Reply:
        self.thread.join(DEADLINE + 5)
        self.client.close()
        assert self.reply is not None, "no reply to AwaitJob"
        return self.reply

    def answered(self) -> bool:
        return self.reply is not None


def awaiters(server: Any) -> int:
    """The AwaitJobs waiting on a ThreadServer (every node's, with several)."""
    nodes = getattr(server, "nodes", [server])
    return sum(len(node.server.core.engine.awaits) for node in nodes)


def test_an_ended_job_is_answered_at_once_with_its_outcome(server, client):
    job_id = running(client, data={"n": 1})
    ok(client.request("FinishJob", jobID=job_id, data={"result": 42}))
    # Deleted as Bedrock deletes it: QueryJob is unchanged.
    assert client.request("QueryJob", jobID=job_id).status.startswith("404")
    began = time.monotonic()
    reply = ok(client.request("AwaitJob", jobID=job_id, timeout=60_000))
    assert time.monotonic() - began < 5
    outcome = reply.json
    assert outcome["jobID"] == job_id and outcome["name"] == "work"
    assert outcome["state"] == "FINISHED"
    assert outcome["data"] == {"result": 42}
    assert outcome["lastError"] == ""
    assert outcome["ended"]


def test_several_callers_await_one_job_and_all_get_its_outcome(server, client):
    job_id = running(client)
    waiting = [Awaiting(server, job_id) for _ in range(5)]
    until(lambda: awaiters(server) == 5, DEADLINE, "five AwaitJobs waiting")
    assert not any(w.answered() for w in waiting)
    ok(client.request("FinishJob", jobID=job_id, data={"done": True}))
    for each in waiting:
        reply = ok(each.result())
        assert reply.json["state"] == "FINISHED" and reply.json["data"] == {"done": True}
    until(lambda: awaiters(server) == 0, DEADLINE, "the awaiters gone")


def test_a_job_that_does_not_end_in_time_answers_not_ended(server, client):
    job_id = create(client, "slow")
    began = time.monotonic()
    reply = client.request("AwaitJob", jobID=job_id, timeout=300)
    assert reply.status == NOT_ENDED
    assert reply.json == {"jobID": job_id, "state": "QUEUED"}
    assert 0.25 <= time.monotonic() - began < 5
    # Still there, untouched but for the mark.
    assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "QUEUED"


def test_a_job_failed_for_good_answers_failed_with_its_error(server, client):
    job_id = running(client, data={"x": 1})
    waiting = Awaiting(server, job_id)
    until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
    ok(client.request("FailJob", jobID=job_id, error="disk full"))
    reply = ok(waiting.result())
    assert reply.json["state"] == "FAILED"
    assert reply.json["lastError"] == "disk full"
    assert reply.json["data"] == {"x": 1}


def test_a_failed_attempt_that_is_retried_is_not_an_end(server, client):
    job_id = running(client, maxAttempts=2)
    waiting = Awaiting(server, job_id)
    until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
    ok(client.request("FailJob", jobID=job_id, error="first try"))
    assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "QUEUED"
    # Woken or not, it must still be waiting: the job runs again.
    time.sleep(0.3)
    assert not waiting.answered()
    until(lambda: client.request("GetJob", name="work").status.startswith("200"),
          DEADLINE, "the retry handed out")
    ok(client.request("FailJob", jobID=job_id, error="second try"))
    reply = ok(waiting.result())
    assert reply.json["state"] == "FAILED" and reply.json["lastError"] == "second try"


def test_a_retryjob_and_a_repeat_are_not_ends(server, client):
    job_id = running(client, repeat="SCHEDULED, +1 HOUR")
    ok(client.request("FinishJob", jobID=job_id))
    reply = client.request("AwaitJob", jobID=job_id, timeout=200)
    assert reply.status == NOT_ENDED
    other = running(client, "again")
    ok(client.request("RetryJob", jobID=other, delay=3600))
    assert client.request("AwaitJob", jobID=other, timeout=200).status == NOT_ENDED


def test_a_cancelled_child_answers_cancelled(server, client):
    parent = running(client, "parent")
    child = create(client, "child", parentJobID=parent, data={"c": 1})
    ok(client.request("FinishJob", jobID=parent))
    waiting = Awaiting(server, child)
    until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
    ok(client.request("CancelJob", jobID=child))
    reply = ok(waiting.result())
    assert reply.json["state"] == "CANCELLED" and reply.json["data"] == {"c": 1}


def test_a_job_deleted_before_it_ended_answers_deleted(server, client):
    job_id = create(client, "doomed", data={"d": 2})
    waiting = Awaiting(server, job_id)
    until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
    ok(client.request("DeleteJob", jobID=job_id))
    reply = ok(waiting.result())
    assert reply.json["state"] == "DELETED" and reply.json["data"] == {"d": 2}


def test_finishjobs_ends_each_job_and_wakes_each_awaiter(server, client):
    ids = [create(client, "batch") for _ in range(20)]
    handed = ok(client.request("GetJobs", name="batch", numResults=20)).json["jobs"]
    assert sorted(job["jobID"] for job in handed) == sorted(ids)
    waiting = [Awaiting(server, job_id) for job_id in ids[:3]]
    until(lambda: awaiters(server) == 3, DEADLINE, "three AwaitJobs waiting")
    elements = [{"jobID": job_id, "data": {"i": i}} for i, job_id in enumerate(ids)]
    results = ok(client.request("FinishJobs", jobs=elements)).json["results"]
    assert all(r["status"] == "200 OK" for r in results)
    for i, each in enumerate(waiting):
        assert ok(each.result()).json["data"] == {"i": i}
    for i, job_id in enumerate(ids):
        assert ok(client.request("AwaitJob", jobID=job_id, timeout=0)).json["data"] == {"i": i}


def test_an_unknown_job_is_404_and_bad_parameters_are_refused(server, client):
    assert client.request("AwaitJob", jobID=999_999).status == "404 No job with this jobID"
    assert client.request("AwaitJob").status.startswith("402")
    assert client.request("AwaitJob", jobID="x").status == "402 Malformed jobID"
    job_id = create(client)
    assert client.request("AwaitJob", jobID=job_id, timeout=-1).status == "402 Malformed timeout"
    assert client.request("AwaitJob", jobID=job_id, timeout="soon").status == (
        "402 Malformed timeout"
    )
