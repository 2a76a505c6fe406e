"""Blocking GetJob (`Connection: wait` + `timeout` in ms), end to end.

Waiting workers are real connections to a real server. A test that needs a
worker to be waiting before it acts polls the server's wait queue with a
deadline; nothing sleeps for a fixed time. Wait timeouts are long (20 s)
unless the test is about the timeout, and socket timeouts (10 s) turn a
reply that never comes into a failure.
"""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from helpers import create
from wire import Client, Reply, encode

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

LONG_WAIT_MS = 20_000


def wait_request(name: str, timeout_ms: int = LONG_WAIT_MS, **params: Any) -> bytes:
    return encode("GetJob", {"name": name, "Connection": "wait", "timeout": timeout_ms, **params})


def waiting_count(server) -> int:
    # The queue lives in the server's thread; a read may race a change.
    while True:
        try:
            return len(server.server.core.engine.waits)
        except RuntimeError:
            continue


def until_waiting(server, count: int, deadline: float = 10.0) -> None:
    """Poll until exactly `count` GetJobs are waiting."""
    end = time.monotonic() + deadline
    while waiting_count(server) != count:
        assert time.monotonic() < end, f"{waiting_count(server)} waiting, expected {count}"
        time.sleep(0.002)


def start_waiting(server, name: str, timeout_ms: int = LONG_WAIT_MS, **params: Any) -> Client:
    """A new connection whose GetJob is registered as waiting."""
    before = waiting_count(server)
    worker = server.client()
    worker.send(wait_request(name, timeout_ms, **params))
    until_waiting(server, before + 1)
    return worker


def state(client: Client, job_id: int) -> str:
    reply = client.request("QueryJob", jobID=job_id)
    assert reply.status == "200 OK", reply
    return reply.json["state"]


def handed(reply: Reply) -> int:
    assert reply.status == "200 OK", reply
    return reply.json["jobID"]


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def soon() -> tuple[str, float]:
    """A firstRun one to two seconds ahead, and when it falls (epoch seconds)."""
    moment = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    return stamp(moment), moment.timestamp()


# Woken by new jobs.


def test_waiting_get_job_is_woken_by_create_job_on_another_connection(server, client):
    with start_waiting(server, "SendEmail") as worker:
        job_id = create(client, "SendEmail", data={"to": "a@b.c"})
        reply = worker.read_reply()
        assert handed(reply) == job_id
        assert reply.json["name"] == "SendEmail"
        assert reply.json["data"] == {"to": "a@b.c"}
        assert len(reply.json) == 9
    assert state(client, job_id) == "RUNNING"
    assert waiting_count(server) == 0


def test_waiting_get_job_takes_a_job_already_queued(server, client):
    job_id = create(client, "ready")
    client.send(wait_request("ready"))
    assert handed(client.read_reply()) == job_id


def test_waiting_get_job_is_woken_by_update_job_making_a_job_due(server, client):
    job_id = create(client, "postponed", firstRun="2099-01-01")
    with start_waiting(server, "postponed") as worker:
        reply = client.request("UpdateJob", jobID=job_id, data={"go": 1}, nextRun="2000-01-01")
        assert reply.status == "200 OK"
        reply = worker.read_reply()
        assert handed(reply) == job_id
        assert reply.json["data"] == {"go": 1}


def test_waiting_get_job_is_woken_by_finish_job_requeueing_a_due_repeat(server, client):
    # Scheduled two days ago, daily: its next run has passed, so it is due at once.
    two_days_ago = (datetime.now(UTC) - timedelta(days=2)).strftime("%Y-%m-%d %H:%M:%S")
    job_id = create(client, "again", repeat="SCHEDULED, +1 DAY", firstRun=two_days_ago)
    assert handed(client.request("GetJob", name="again")) == job_id
    with start_waiting(server, "again") as worker:
        assert client.request("FinishJob", jobID=job_id).status == "200 OK"
        assert handed(worker.read_reply()) == job_id


# Woken by the clock.


def test_waiting_get_job_gets_a_future_job_when_it_becomes_due(server, client):
    first_run, due = soon()
    job_id = create(client, "timed", firstRun=first_run)
    client.send(wait_request("timed"))
    assert handed(client.read_reply()) == job_id
    assert time.time() >= due


def test_future_job_created_while_waiting_is_handed_out_when_due(server, client):
    with start_waiting(server, "timed") as worker:
        first_run, due = soon()
        job_id = create(client, "timed", firstRun=first_run)
        assert handed(worker.read_reply()) == job_id
        assert time.time() >= due


def test_earlier_future_job_rearms_the_clock(server, client):
    later = create(client, "timed", firstRun="2099-01-01")
    with start_waiting(server, "timed") as worker:
        first_run, _ = soon()
        sooner = create(client, "timed", firstRun=first_run)
        assert handed(worker.read_reply()) == sooner
    assert state(client, later) == "QUEUED"


# Timeouts.


def test_wait_timeout_expiry_is_404_no_job_found(client):
    started = time.monotonic()
    client.send(wait_request("nothing", timeout_ms=300))
    reply = client.read_reply()
    assert reply.status == "404 No job found"
    assert reply.body == b""
    assert time.monotonic() - started >= 0.25
    assert client.request("Ping").status == "200 OK"


def test_wait_timeout_expiry_leaves_later_jobs_queued(server, client):
    client.send(wait_request("late", timeout_ms=300))
    assert client.read_reply().status == "404 No job found"
    job_id = create(client, "late")
    assert state(client, job_id) == "QUEUED"
    assert waiting_count(server) == 0


def test_wait_with_timeout_zero_still_gets_a_due_job(client):
    # protocol.md 9: the first look at the queue always completes, however
    # short the timeout, so a due job is handed out rather than missed.
    job_id = create(client, "now")
    client.send(wait_request("now", timeout_ms=0))
    reply = client.read_reply()
    assert reply.status == "200 OK"
    assert handed(reply) == job_id
    assert state(client, job_id) == "RUNNING"


def test_wait_with_timeout_zero_and_no_job_is_404_at_once(client):
    client.send(wait_request("none-yet", timeout_ms=0))
    assert client.read_reply().status == "404 No job found"


@pytest.mark.parametrize("timeout", ["abc", "-1", "1.5", "10s"])
def test_malformed_timeout_is_402(server, client, timeout):
    job_id = create(client, "t")
    client.send(wait_request("t", timeout_ms=timeout))  # type: ignore[arg-type]
    reply = client.read_reply()
    assert reply.status == "402 Malformed timeout"
    assert reply.body == b""
    assert state(client, job_id) == "QUEUED"
    assert waiting_count(server) == 0
    assert client.request("Ping").status == "200 OK"


def test_waiting_get_job_with_num_results_is_402(client):
    client.send(wait_request("x", numResults=1))
    assert client.read_reply().status == "402 Cannot use numResults with GetJob; try GetJobs"


def test_waiting_get_job_without_name_is_402(client):
    client.send(encode("GetJob", {"Connection": "wait", "timeout": 1000}))
    assert client.read_reply().status == "402 Missing name"


def test_request_pipelined_behind_a_waiting_get_job_is_answered_after_it(client):
    client.send(wait_request("none", timeout_ms=300) + encode("CreateJob", {"name": "next"}))
    assert client.read_reply().status == "404 No job found"
    assert client.read_reply().json == {"jobID": 1}


# Matching.


def test_wait_on_a_pattern_that_does_not_match_keeps_waiting(server, client):
    with start_waiting(server, "alpha*") as worker:
        beta = create(client, "beta")
        alphabet = create(client, "alphabet")
        assert handed(worker.read_reply()) == alphabet
    assert state(client, beta) == "QUEUED"


def test_wait_on_a_comma_list_takes_only_the_exact_names(server, client):
    with start_waiting(server, "one, two") as worker:
        create(client, "one-and-more")
        create(client, "t*")
        two = create(client, "two")
        assert handed(worker.read_reply()) == two


def test_waiters_on_different_names_each_get_their_own_job(server, client):
    workers = [start_waiting(server, f"w{i}") for i in range(10)]
    try:
        ids = {i: create(client, f"w{i}") for i in reversed(range(10))}
        for i, worker in enumerate(workers):
            reply = worker.read_reply()
            assert (handed(reply), reply.json["name"]) == (ids[i], f"w{i}")
    finally:
        for worker in workers:
            worker.close()


# Many waiters.


def test_first_waiter_to_arrive_gets_the_first_job(server, client):
    workers = [start_waiting(server, "fifo") for _ in range(3)]
    try:
        for count, worker in enumerate(workers):
            job_id = create(client, "fifo")
            assert handed(worker.read_reply()) == job_id
            until_waiting(server, len(workers) - count - 1)
    finally:
        for worker in workers:
            worker.close()


def test_many_waiters_each_get_exactly_one_job_and_none_twice(server, client):
    workers = [start_waiting(server, "bulk") for _ in range(20)]
    try:
        batch = (encode("CreateJob", {"name": "bulk", "data": {"i": i}}) for i in range(25))
        client.send(b"".join(batch))
        created = [client.read_reply().json["jobID"] for _ in range(25)]
        assert len(set(created)) == 25
        got = [handed(worker.read_reply()) for worker in workers]
    finally:
        for worker in workers:
            worker.close()
    assert len(set(got)) == 20
    assert set(got) <= set(created)
    rest = [handed(client.request("GetJob", name="bulk")) for _ in range(5)]
    assert sorted(got + rest) == sorted(created)
    assert client.request("GetJob", name="bulk").status == "404 No job found"
    assert {state(client, job_id) for job_id in created} == {"RUNNING"}


def test_many_waiters_and_many_creators(server):
    workers = [start_waiting(server, "mixed*") for _ in range(20)]
    creators = [server.client() for _ in range(4)]
    try:
        for n, creator in enumerate(creators):
            creator.send(b"".join(encode("CreateJob", {"name": f"mixed{n}"}) for _ in range(5)))
        created = {creator.read_reply().json["jobID"] for creator in creators for _ in range(5)}
        got = [handed(worker.read_reply()) for worker in workers]
    finally:
        for connection in workers + creators:
            connection.close()
    assert sorted(got) == sorted(created)


# Waiters that hang up.


def test_waiter_that_hangs_up_is_dropped_and_the_job_stays_queued(server, client):
    worker = start_waiting(server, "lonely")
    worker.close()
    until_waiting(server, 0)
    job_id = create(client, "lonely")
    assert state(client, job_id) == "QUEUED"
    assert handed(client.request("GetJob", name="lonely")) == job_id


HALF_CLOSED = (
    "a waiting GetJob needs its connection open: the client closed its sending "
    "side (as nc -N does at the end of its input); no job was handed out"
)


def told_why(reply: Reply) -> bool:
    return reply.status == "404 No job found" and reply.headers.get("error") == HALF_CLOSED


def test_waiter_that_half_closes_is_told_why_at_once_and_gets_no_job(server, client):
    worker = start_waiting(server, "half")
    with worker:
        worker.sock.shutdown(socket.SHUT_WR)
        assert told_why(worker.read_reply())
        assert worker.at_eof()
    until_waiting(server, 0)
    # As `printf 'GetJob...' | nc -N`: the request, then the half-close at
    # once; the requests before it are answered as usual.
    with server.client() as piped:
        piped.send(encode("Ping", {}) + wait_request("half"))
        piped.sock.shutdown(socket.SHUT_WR)
        assert piped.read_reply().status == "200 OK"
        assert told_why(piped.read_reply())
    job_id = create(client, "half")
    assert state(client, job_id) == "QUEUED"


def test_job_goes_to_the_next_waiter_when_the_first_hangs_up(server, client):
    first = start_waiting(server, "relay")
    with start_waiting(server, "relay") as second:
        first.close()
        until_waiting(server, 1)
        job_id = create(client, "relay")
        assert handed(second.read_reply()) == job_id
    assert state(client, job_id) == "RUNNING"


def test_future_job_from_before_a_restart_is_handed_to_a_waiter_when_due(start_server, tmp_path):
    # After a restart only the database knows the job is coming: no commit
    # of this process has announced it.
    db = tmp_path / "restart.db"
    first = start_server(db)
    first_run, due = soon()
    with first.client() as client:
        job_id = create(client, "timed", firstRun=first_run)
    first.kill()
    second = start_server(db)
    with second.client() as worker:
        worker.send(wait_request("timed"))
        assert handed(worker.read_reply()) == job_id
        assert time.time() >= due


def test_waiting_get_jobs_returns_what_is_ready_when_woken(server, client):
    worker = server.client()
    worker.send(encode("GetJobs", {"name": "batch*", "numResults": 5,
                                    "Connection": "wait", "timeout": LONG_WAIT_MS}))
    until_waiting(server, 1)
    reply = client.request("CreateJobs", jobs=[{"name": "batch1"}, {"name": "batch2"}])
    ids = reply.json["jobIDs"]
    got = worker.read_reply()
    assert got.status == "200 OK"
    # Both jobs were committed together, so the waiter gets both at once.
    assert [job["jobID"] for job in got.json["jobs"]] == ids
    worker.close()


def test_waiting_get_jobs_times_out_with_404(client):
    client.send(encode("GetJobs", {"name": "none", "numResults": 3,
                                    "Connection": "wait", "timeout": 200}))
    assert client.read_reply().status == "404 No job found"


def test_lease_expiry_wakes_a_waiter(server, client):
    job_id = create(client, "leased", retryAfter="+1 SECOND")
    assert handed(client.request("GetJob", name="leased")) == job_id
    worker = start_waiting(server, "leased")
    # Nobody reports on the job: when its lease ends the waiter gets it.
    reply = worker.read_reply()
    assert handed(reply) == job_id
    assert reply.json["data"] == {"retryAfterCount": 1}
    worker.close()
