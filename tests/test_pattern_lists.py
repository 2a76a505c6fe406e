"""Several GLOB patterns in one GetJob or GetJobs (issue 35, item 2;
protocol.md 5.3): `name: thumb/*,email/*` takes a job that any of them
matches, waiting or not, while Bedrock's comma list of exact names stays
exact. Real servers on loopback, every backend."""

from __future__ import annotations

import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.model.globmatch import MAX_PATTERNS, MAX_WILDCARDS
from wire import encode

pytestmark = pytest.mark.backends


def test_a_list_of_patterns_takes_what_any_of_them_matches(server: ThreadServer) -> None:
    with server.client() as client:
        thumb, email, other = (create(client, n) for n in ("thumb/1", "email/1", "sms/1"))
        reply = ok(client.request("GetJobs", name="thumb/*, email/*", numResults=10)).json
        assert sorted(job["jobID"] for job in reply["jobs"]) == [thumb, email]
        assert client.request("GetJob", name="thumb/*,email/*").status == "404 No job found"
        assert ok(client.request("GetJob", name="x/*,sms/1")).json["jobID"] == other


def test_a_waiting_list_of_patterns_is_woken_by_any_of_them(server: ThreadServer) -> None:
    with server.client() as client, server.client(timeout=30) as waiting:
        for name in ("email/2", "thumb/2"):
            waiting.send(
                encode(
                    "GetJob", {"name": "thumb/*,email/*", "Connection": "wait", "timeout": 20_000}
                )
            )
            until(lambda: ok(client.request("Status")).json["waitingGetJobs"] == 1, 10, "a waiter")
            create(client, "sms/2")
            job_id = create(client, name)
            assert ok(waiting.read_reply()).json["jobID"] == job_id


def test_a_list_of_patterns_is_bounded(server: ThreadServer) -> None:
    with server.client() as client:
        create(client, "p/1")
        many = ",".join(f"p/{i}" for i in range(MAX_PATTERNS)) + ",p/*"
        assert (
            client.request("GetJob", name=many).status
            == f"402 Too many patterns ({MAX_PATTERNS} at most)"
        )
        at_most = ",".join(f"p/{i}" for i in range(MAX_PATTERNS - 1)) + ",p/*"
        assert ok(client.request("GetJob", name=at_most)).json["name"] == "p/1"
        # The wildcards of all the patterns count together.
        stars = ",".join(["q/*"] * (MAX_WILDCARDS + 1))
        refused = f"402 Name too complex ({MAX_WILDCARDS} wildcards at most)"
        assert client.request("GetJobs", name=stars, numResults=2).status == refused
        # Bedrock's list of exact names holds none, however long.
        names = ",".join(f"n/{i}" for i in range(MAX_PATTERNS * 2))
        assert client.request("GetJob", name=names).status == "404 No job found"
