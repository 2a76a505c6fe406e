"""Jobs that wait for an external reply (protocol.md 14.11): AwaitReply,
DeliverReply, early replies, reply timeouts, over a real server.

Waits poll with a deadline; reply timeouts are 1 s, so the file runs in
seconds.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from test_cli import Cli
from test_flow_control import Waiter, v2_file
from test_workers import python_worker

from harness import ThreadServer
from helpers import create, ok, until
from jobserver import client as jobclient
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import MIGRATIONS, SCHEMA_VERSION
from wire import Client, Reply

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

DEADLINE = 10.0


def take(client: Client, name: str, **params: Any) -> dict[str, Any]:
    return ok(client.request("GetJob", name=name, **params)).json


def query(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def replies(client: Client) -> dict[str, int]:
    return ok(client.request("Status")).json["replies"]


def running_job(client: Client, name: str = "hook", **params: Any) -> int:
    job_id = create(client, name, **params)
    assert take(client, name)["jobID"] == job_id
    return job_id


# Await, then deliver.


def test_await_then_deliver_queues_the_job_with_the_reply(server, client):
    job_id = running_job(client, data={"order": 7})
    reply = ok(client.request("AwaitReply", jobID=job_id, key="order-7", timeout=600))
    assert reply.json["state"] == "WAITING"
    waiting = query(client, job_id)
    assert waiting["state"] == "WAITING"
    assert waiting["replyKey"] == "order-7"
    assert waiting["replyDeadline"] == reply.json["replyDeadline"] == waiting["nextRun"]
    assert replies(client) == {"waiting": 1, "early": 0}
    # A WAITING job is never handed out, whatever its nextRun.
    assert client.request("GetJob", name="hook").status == "404 No job found"

    delivered = ok(client.request("DeliverReply", key="order-7", data={"paid": True}))
    assert delivered.json == {"jobID": job_id}
    queued = query(client, job_id)
    assert queued["state"] == "QUEUED" and "replyKey" not in queued
    assert queued["data"] == {"order": 7, "reply": {"paid": True}}
    assert take(client, "hook")["data"] == {"order": 7, "reply": {"paid": True}}
    assert replies(client) == {"waiting": 0, "early": 0}


def test_a_delivery_serves_a_waiting_getjob_at_once(server, client):
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="k"))
    waiter = Waiter(server, "hook", timeout_ms=int(DEADLINE * 1000))
    ok(client.request("DeliverReply", key="k", data={"v": 1}))
    got = ok(waiter.result()).json
    assert (got["jobID"], got["data"]) == (job_id, {"reply": {"v": 1}})


def test_a_leased_job_awaits_with_its_lease(server, client):
    job_id = create(client, "hook", retryAfter="+1 HOUR", maxAttempts=3)
    lease = ok(client.request("GetJob", name="hook")).headers["leaseID"]
    assert client.request(
        "AwaitReply", jobID=job_id, key="k", leaseID="0" * 16
    ).status == "409 Lease expired"
    ok(client.request("AwaitReply", jobID=job_id, key="k", leaseID=lease))
    ok(client.request("DeliverReply", key="k", data={}))
    job = query(client, job_id)
    # The wait ended well: the next run gets every attempt again.
    assert (job["state"], job["attempt"]) == ("QUEUED", 0)


# Deliver, then await: the race.


def test_a_reply_before_its_await_is_kept_and_taken_at_once(server, client):
    job_id = running_job(client)
    early = client.request("DeliverReply", key="fast", data={"ok": 1})
    assert early.status == "202 Reply kept" and "expires" in early.json
    assert replies(client) == {"waiting": 0, "early": 1}

    taken = ok(client.request("AwaitReply", jobID=job_id, key="fast", timeout=600))
    assert taken.json == {"state": "QUEUED"}
    assert query(client, job_id)["data"] == {"reply": {"ok": 1}}
    assert replies(client) == {"waiting": 0, "early": 0}
    # Claimed: a second delivery is refused.
    assert client.request("DeliverReply", key="fast", data={}).status == (
        "404 Reply already delivered"
    )


def test_await_and_deliver_racing_from_two_connections_lose_nothing(server):
    count = 40
    with server.client() as setup:
        ids = [running_job(setup, f"race/{i}") for i in range(count)]
    errors: list[Reply] = []

    def awaiting() -> None:
        with server.client() as c:
            for i, job_id in enumerate(ids):
                reply = c.request("AwaitReply", jobID=job_id, key=f"key-{i}", timeout=600)
                if reply.status != "200 OK":
                    errors.append(reply)

    def delivering() -> None:
        with server.client() as c:
            for i in range(count):
                reply = c.request("DeliverReply", key=f"key-{i}", data={"i": i})
                if reply.status not in ("200 OK", "202 Reply kept"):
                    errors.append(reply)

    threads = [threading.Thread(target=awaiting), threading.Thread(target=delivering)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    assert errors == []
    with server.client() as c:
        for i, job_id in enumerate(ids):
            job = query(c, job_id)
            assert (job["state"], job["data"]) == ("QUEUED", {"reply": {"i": i}})
        assert replies(c) == {"waiting": 0, "early": 0}


def test_an_unclaimed_early_reply_expires_after_the_grace_period(tmp_path):
    server = ThreadServer(tmp_path / "jobs.db", reply_grace=1.0)
    try:
        with server.client() as client:
            assert client.request("DeliverReply", key="late", data={}).code == 202
            assert replies(client)["early"] == 1
            until(lambda: replies(client)["early"] == 0, DEADLINE, "the early reply to expire")
            job_id = running_job(client)
            reply = ok(client.request("AwaitReply", jobID=job_id, key="late"))
            assert reply.json["state"] == "WAITING"
    finally:
        server.stop()


# Exactly one delivery, one waiter per key.


def test_a_second_delivery_of_a_kept_reply_says_it_was_delivered(server, client):
    assert client.request("DeliverReply", key="early", data={"n": 1}).status == "202 Reply kept"
    assert client.request("DeliverReply", key="early", data={"n": 2}).status == (
        "404 Reply already delivered"
    )
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="early"))
    assert query(client, job_id)["data"] == {"reply": {"n": 1}}


def test_a_second_delivery_changes_nothing(server, client):
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="once"))
    ok(client.request("DeliverReply", key="once", data={"n": 1}))
    assert client.request("DeliverReply", key="once", data={"n": 2}).status == (
        "404 Reply already delivered"
    )
    assert query(client, job_id)["data"] == {"reply": {"n": 1}}
    assert replies(client) == {"waiting": 0, "early": 0}


def test_a_key_has_one_waiter(server, client):
    first = running_job(client)
    second = running_job(client)
    ok(client.request("AwaitReply", jobID=first, key="shared"))
    assert client.request("AwaitReply", jobID=second, key="shared").status == (
        "409 Another job waits on this key"
    )
    assert query(client, second)["state"] == "RUNNING"
    # Once delivered, the key may be waited on again.
    ok(client.request("DeliverReply", key="shared", data={}))
    ok(client.request("AwaitReply", jobID=second, key="shared"))
    assert ok(client.request("DeliverReply", key="shared", data={})).json == {"jobID": second}


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"key": "k"}, "402 Missing jobID"),
        ({"jobID": 1}, "402 Missing key"),
        ({"jobID": 1, "key": "k" * 256}, "402 Key too large (255 bytes at most)"),
        ({"jobID": 1, "key": "k", "timeout": 0}, "402 Malformed timeout"),
        ({"jobID": 1, "key": "k", "timeout": "1.5"}, "402 Malformed timeout"),
        ({"jobID": 1, "key": "k", "timeout": 30 * 86400 + 1}, "402 Malformed timeout"),
        ({"jobID": 99, "key": "k"}, "404 No job with this jobID"),
        ({"jobID": 1, "key": "k"}, "405 Can only await a reply for RUNNING or RUNQUEUED jobs"),
    ],
)
def test_await_reply_checks_its_parameters(client, params, status):
    create(client, "queued")
    assert client.request("AwaitReply", **params).status == status


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"data": {}}, "402 Missing key"),
        ({"key": "k"}, "402 Missing data"),
        ({"key": "k", "data": "[1]"}, "402 Data is not a valid JSON Object"),
    ],
)
def test_deliver_reply_checks_its_parameters(client, params, status):
    assert client.request("DeliverReply", **params).status == status
    assert replies(client)["early"] == 0


# Timeouts.


def test_a_timeout_without_a_policy_fails_the_job(server, client):
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="never", timeout=1))
    # Nobody waits in GetJob: the clock fires for the deadline on its own.
    until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the reply timeout")
    failed = ok(client.request("FailedJobs")).json["jobs"]
    assert [(j["jobID"], j["lastError"]) for j in failed] == [(job_id, "reply timeout")]
    assert client.request("DeliverReply", key="never", data={}).code == 202


def test_a_timeout_goes_through_the_retry_policy(server, client):
    job_id = running_job(client, maxAttempts=2, retryBackoff="fixed", retryDelay=0)
    ok(client.request("AwaitReply", jobID=job_id, key="slow", timeout=1))
    waiter = Waiter(server, "hook", timeout_ms=int(DEADLINE * 1000))
    again = ok(waiter.result()).json
    assert (again["jobID"], again["attempt"]) == (job_id, 2)
    assert query(client, job_id)["lastError"] == "reply timeout"
    ok(client.request("AwaitReply", jobID=job_id, key="slow", timeout=1))
    until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the last attempt to fail")


# Durability.


def test_nothing_is_lost_when_the_server_is_killed_while_a_job_waits(start_server):
    first = start_server()
    with first.client() as client:
        waiting = running_job(client, "a")
        ok(client.request("AwaitReply", jobID=waiting, key="a-key", timeout=600))
        early = running_job(client, "b")
        assert client.request("DeliverReply", key="b-key", data={"b": 1}).code == 202
        timing_out = running_job(client, "c")
        ok(client.request("AwaitReply", jobID=timing_out, key="c-key", timeout=2))
    first.proc.kill()
    first.proc.wait(DEADLINE)

    second = start_server()
    with second.client() as client:
        assert query(client, waiting)["state"] == "WAITING"
        # The c job's two seconds may run out while a loaded machine restarts
        # the server: counted as waiting, it must still be WAITING or have
        # timed out since; not counted, it must have timed out already.
        counted = replies(client)
        timing_out_state = query(client, timing_out)["state"]
        assert counted["early"] == 1
        assert (counted["waiting"], timing_out_state) in {
            (2, "WAITING"), (2, "FAILED"), (1, "FAILED")
        }, (counted, timing_out_state)
        assert ok(client.request("DeliverReply", key="a-key", data={"a": 1})).json == {
            "jobID": waiting
        }
        assert take(client, "a")["data"] == {"reply": {"a": 1}}
        assert ok(client.request("AwaitReply", jobID=early, key="b-key")).json == {
            "state": "QUEUED"
        }
        assert take(client, "b")["data"] == {"reply": {"b": 1}}
        # A deadline set before the restart still fires after it.
        until(lambda: query(client, timing_out)["state"] == "FAILED", DEADLINE, "the reply timeout")


def v3_file(path: Path) -> Path:
    v2_file(path)
    db = sqlite3.connect(path)
    for statement in MIGRATIONS[2]:
        db.execute(statement)
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    return path


def schema(path: Path) -> tuple[Any, ...]:
    db = sqlite3.connect(path)
    try:
        # ALTER TABLE changes the text of jobs and limits: their columns
        # are compared instead.
        columns = [db.execute(f"PRAGMA table_info({t})").fetchall() for t in ("jobs", "limits")]
        # Every index and table as written, but `jobs`, whose text ALTER
        # TABLE changes: its columns are compared instead.
        objects = db.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT IN ('jobs', 'limits') ORDER BY name"
        ).fetchall()
        return db.execute("PRAGMA user_version").fetchone()[0], columns, objects
    finally:
        db.close()


def test_a_version_3_file_is_migrated_to_version_4(tmp_path):
    old = v3_file(tmp_path / "old.db")
    Store(str(old)).close()
    Store(str(tmp_path / "fresh.db")).close()
    assert SCHEMA_VERSION == 11
    assert schema(old) == schema(tmp_path / "fresh.db")
    db = sqlite3.connect(old)
    assert db.execute("SELECT state, replyKey FROM jobs WHERE name = 'dead'").fetchone() == (
        "FAILED", "")
    db.close()


# The client library, the command line, the worker manager.


def test_the_client_library_awaits_and_delivers(server):
    with jobclient.Client(port=server.port, timeout=10) as jobs:
        job_id = jobs.create_job("hook")
        jobs.get_job("hook")
        waiting = jobs.await_reply(job_id, "lib-key", timeout=60)
        assert waiting["state"] == "WAITING"
        assert jobs.deliver_reply("lib-key", {"x": 1}) == {"jobID": job_id}
        with pytest.raises(jobclient.JobNotFound):
            jobs.deliver_reply("lib-key", {"x": 2})
        assert "expires" in jobs.deliver_reply("other", {})


def test_the_cli_delivers_a_reply(server, client):
    cli = Cli(f"127.0.0.1:{server.port}")
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="cli-key"))
    assert cli.ok("deliver", "cli-key", "--data", '{"via": "cli"}') == {"jobID": job_id}
    assert query(client, job_id)["data"] == {"reply": {"via": "cli"}}
    cli.refused("404 Reply already delivered", 1, "deliver", "cli-key", "--data", "{}")


def test_a_managed_worker_awaits_and_a_second_run_gets_the_reply(
    server, client, workers, manager, tmp_path
):
    out = tmp_path / "second-run.json"
    python_worker(
        workers,
        "Webhook",
        f"""
job = json.load(sys.stdin)
if "reply" in job["data"]:
    open({str(out)!r}, "w").write(json.dumps(job["data"]))
else:
    print(json.dumps({{"awaitReply": {{"key": "hook-" + os.environ["JOB_ID"], "timeout": 60}},
                      "sent": True}}))
""",
    )
    job_id = create(client, "Webhook", data={"url": "https://example.test"})
    running = manager(server.port)
    running.wait_for(rf"job {job_id} Webhook awaiting a reply")
    until(lambda: query(client, job_id)["state"] == "WAITING", DEADLINE, "AwaitReply")
    assert query(client, job_id)["data"] == {"sent": True}
    ok(client.request("DeliverReply", key=f"hook-{job_id}", data={"status": "done"}))
    until(lambda: client.request("QueryJob", jobID=job_id).code == 404, DEADLINE, "FinishJob")
    assert json.loads(out.read_text()) == {"sent": True, "reply": {"status": "done"}}


async def test_the_async_client_awaits_and_delivers(server):
    async with jobclient.TrioClient(port=server.port, timeout=10) as jobs:
        job_id = await jobs.create_job("hook")
        job = await jobs.get_job("hook")
        assert job is not None
        assert (await jobs.deliver_reply("async-key", {"early": True}))["expires"]
        assert await jobs.await_reply(job_id, "async-key") == {"state": "QUEUED"}
        again = await jobs.get_job("hook")
        assert again is not None and again["data"] == {"reply": {"early": True}}


def test_update_job_moving_a_deadline_earlier_rearms_the_clock(server, client):
    job_id = running_job(client)
    ok(client.request("AwaitReply", jobID=job_id, key="moved", timeout=86400))
    soon = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%d %H:%M:%S")
    ok(client.request("UpdateJob", jobID=job_id, data={}, nextRun=soon))
    until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the moved reply deadline")
