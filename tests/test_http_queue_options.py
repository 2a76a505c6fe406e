"""POST /queue with CreateJob's options beside Jobber's `type` and
`payload`, over real HTTP to a real server; each job then read through
the wire protocol's QueryJob."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from harness import ThreadServer
from helpers import ok, until

TIMEOUT = 10.0


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


def post_queue(server: ThreadServer, document: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}/queue",
        data=json.dumps(document).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def created(server: ThreadServer, document: Any) -> dict[str, Any]:
    """The job a POST /queue created, as QueryJob shows it."""
    status, body = post_queue(server, document)
    assert status == 201, body
    with server.client() as client:
        return ok(client.request("QueryJob", jobID=int(body["job-id"]))).json


def stored(server: ThreadServer, job_id: int, column: str) -> Any:
    with server.client() as client:
        reply = ok(client.request(
            "Query", query=f"SELECT {column} FROM jobs WHERE jobID = {job_id};", format="json"
        ))
        return reply.json["rows"][0][0]


def test_a_producer_sets_a_job_s_options(http_server: ThreadServer) -> None:
    job = created(http_server, {
        "type": "email/send", "payload": {"to": "ann"}, "priority": 1000, "maxAttempts": 5,
        "retryBackoff": "exponential", "retryDelay": 10, "retryMaxDelay": 600,
        "retryAfter": "+5 MINUTES", "key": "customer-17", "repeat": "FINISHED, +1 HOUR",
        "firstRun": "2031-01-02 03:04:05",
    })
    assert (job["name"], job["data"], job["priority"]) == ("email/send", {"to": "ann"}, 1000)
    assert (job["retryAfter"], job["repeat"]) == ("+5 MINUTES", "FINISHED, +1 HOUR")
    assert job["nextRun"].startswith("2031-01-02 03:04:05")
    assert job["key"] == "customer-17"
    assert stored(http_server, job["jobID"], "maxAttempts") == 5
    assert stored(http_server, job["jobID"], "retryBackoff") == "exponential"


def test_delay_is_first_run_from_now(http_server: ThreadServer) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    job = created(http_server, {"type": "later", "delay": 3600})
    due = datetime.fromisoformat(job["nextRun"][:19]).replace(tzinfo=UTC)
    after = datetime.now(UTC)
    assert 3600 <= (due - before).total_seconds() <= (after - before).total_seconds() + 3601
    with http_server.client() as client:
        assert client.request("GetJob", name="later").status == "404 No job found"


def test_unique_reuses_the_queued_job(http_server: ThreadServer) -> None:
    first = created(http_server, {"type": "nightly", "unique": True, "payload": {"n": 1}})
    again = created(http_server, {"type": "nightly", "unique": True, "payload": {"n": 2}})
    assert again["jobID"] == first["jobID"]


def test_an_idempotency_key_creates_once(http_server: ThreadServer) -> None:
    document = {"type": "charge", "idempotencyKey": "order-9", "payload": {"cents": 500}}
    assert post_queue(http_server, document) == post_queue(http_server, document)


@pytest.mark.parametrize(
    "document,status,message",
    [
        ({"type": "x", "maxAttempts": "3"}, 400,
         'maxAttempts: expected an integer from 1 to 10000, got the string "3"'),
        ({"type": "x", "priorty": 1000}, 400,
         "priorty: not a parameter here (did you mean priority?)"),
        ({"type": "x", "name": "y"}, 400, "name: not a parameter here"),
        ({"type": "x", "delay": -1}, 400,
         "delay: expected an integer from 0 to 99999999, got the integer -1"),
        ({"type": "x", "delay": 5, "firstRun": "2031-01-01"}, 400,
         "delay: give firstRun or delay, not both"),
        ({"type": "x", "repeat": "NEVER"}, 400, "402 Malformed repeat"),
        ({"type": "x", "retryAfter": "soon"}, 400, "402 Malformed retryAfter"),
        ({"payload": {}}, 400, "type: required, and missing"),
        ([], 400, 'the body must be a JSON object: {"type": ..., "payload": {...}}'),
    ],
)
def test_a_bad_option_is_refused_and_stores_nothing(
    http_server: ThreadServer, document: Any, status: int, message: str
) -> None:
    code, body = post_queue(http_server, document)
    assert code == status and body["error"].startswith(message), body
    with http_server.client() as client:
        reply = ok(client.request("Query", query="SELECT COUNT(*) FROM jobs;", format="json"))
        assert reply.json["rows"][0][0] == 0
