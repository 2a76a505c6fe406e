"""BLOCKED jobs as Status, Queues, /metrics, the dashboard and HTTP show
them (protocol.md 14.25): a state of their own, counted as such."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, start
from test_http import api, scrape

from harness import ThreadServer
from helpers import create, ok


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = start(tmp_path / "jobs.db")
    yield running
    running.stop()


def test_blocked_jobs_are_counted_and_shown_as_such(server: ThreadServer) -> None:
    with server.client() as client:
        first = create(client, "etl/extract")
        blocked = [
            create(client, "etl/load", dependsOn=json.dumps([first])) for _ in range(2)
        ]
        status = ok(client.request("Status")).json
        assert status["jobs"] == {"QUEUED": 1, "BLOCKED": 2}
        etl = ok(client.request("Queues")).json["queues"][0]
        assert etl["jobs"] == {"QUEUED": 1, "BLOCKED": 2} and etl["total"] == 3
    metrics = scrape(server)
    assert metrics[("jobserver_jobs", (("queue", "etl"), ("state", "BLOCKED")))] == 2
    visitor = Visitor(server)
    front = visitor.get("/").text
    assert "BLOCKED" in front
    page = visitor.get(f"/jobs/{blocked[0]}").text
    assert "BLOCKED" in page and "waits for 1 job (fail if one does not finish)" in page
    # A BLOCKED job can be cancelled from its page, a child or not.
    assert 'action="/actions/cancel"' in page
    page = visitor.get(f"/jobs/{first}").text
    assert "2 jobs wait for it" in page


def call(server: ThreadServer, command: str, params: dict[str, Any]) -> tuple[int, Any]:
    status, _, body = api(server, command, params)
    return status, json.loads(body) if body else None


def test_http_takes_dependencies_as_json(server: ThreadServer) -> None:
    status, body = call(server, "CreateJobs", {"jobs": [
        {"name": "a"}, {"name": "b", "dependsOn": ["#0"], "onDependencyFailure": "run"},
    ]})
    assert status == 200, body
    first, then = body["jobIDs"]
    status, body = call(server, "CreateJob", {"name": "c", "dependsOn": [first, then]})
    assert status == 200, body
    status, body = call(server, "QueryJob", {"jobID": then})
    assert body["state"] == "BLOCKED" and body["onDependencyFailure"] == "run"
    assert body["dependencyCounts"]["pending"] == 1
    status, body = call(server, "CreateJob", {"name": "d", "dependsOn": ["#0"]})
    assert status == 400, body
    status, body = call(server, "CreateJob", {"name": "d", "dependsOn": [10**9]})
    assert status == 404, body
