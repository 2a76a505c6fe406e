"""AwaitJob beyond one server's connection (protocol.md 14.27): the kept
outcomes across a restart and under --keep-outcomes and retention, the
bound on waiting AwaitJobs, an awaiter woken by another PostgreSQL node,
and the clients (sync, asyncio, trio), the CLI and POST /api/AwaitJob.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
import trio
from test_await_job import NOT_ENDED, Awaiting, awaiters, running
from test_cli import Cli
from test_dependencies_cascade import rows

from harness import Nodes, ServerProcess, ThreadServer
from helpers import create, ok, until
from jobserver.client import AsyncClient, Client, JobNotFound, TrioClient

pytestmark = pytest.mark.backends

DEADLINE = 15.0


def only_postgres(backend: str) -> None:
    if backend != "postgres":
        pytest.skip("several nodes share a queue on PostgreSQL only")


# Kept outcomes.


def test_an_outcome_is_kept_across_a_restart(db: Path | str, backend: str) -> None:
    first = ServerProcess(db)
    try:
        with first.client() as client:
            job_id = running(client, data={"in": 1})
            waiting = Awaiting(first, job_id, timeout_ms=60_000)
            assert client.request("AwaitJob", jobID=job_id, timeout=0).status == NOT_ENDED
    finally:
        first.kill()
    # The server went away under the awaiter: its connection ended unanswered.
    waiting.thread.join(DEADLINE)
    assert not waiting.answered()
    second = ServerProcess(db)
    try:
        with second.client() as client:
            # The job is still RUNNING (its taker's report is yet to come).
            assert client.request("AwaitJob", jobID=job_id, timeout=0).status == NOT_ENDED
            again = Awaiting(second, job_id)
            ok(client.request("FinishJob", jobID=job_id, data={"out": 2}))
            assert ok(again.result()).json["data"] == {"out": 2}
    finally:
        second.kill()
    third = ServerProcess(db)
    try:
        with third.client() as client:
            # A caller sending its AwaitJob again after the restart.
            outcome = ok(client.request("AwaitJob", jobID=job_id)).json
            assert outcome["state"] == "FINISHED" and outcome["data"] == {"out": 2}
    finally:
        third.kill()


def test_a_server_that_stops_answers_its_awaitjobs_not_ended(db: Path | str) -> None:
    server = ThreadServer(db)
    stopped = False
    try:
        with server.client() as client:
            job_id = create(client)
        waiting = Awaiting(server, job_id, timeout_ms=60_000)
        until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
        began = time.monotonic()
        server.stop()
        stopped = True
        reply = waiting.result()
        assert reply.status == NOT_ENDED and reply.json == {"jobID": job_id, "state": "QUEUED"}
        assert time.monotonic() - began < 10
    finally:
        if not stopped:
            server.stop()


def test_keep_outcomes_0_keeps_only_what_an_awaitjob_waits_for(db: Path | str) -> None:
    server = ThreadServer(db, keep_outcomes=0.0)
    try:
        with server.client() as client:
            unwatched = running(client, "plain")
            ok(client.request("FinishJob", jobID=unwatched))
            assert client.request("AwaitJob", jobID=unwatched, timeout=0).status.startswith("404")
            watched = running(client, "watched")
            waiting = Awaiting(server, watched)
            # Its look committed: with two writers (PostgreSQL's default) a
            # FinishJob sent while the look waits for a writer may commit
            # first, ending a job no one awaited yet (the AwaitJob then
            # finds nothing kept: 404, as if it had come after).
            until(lambda: rows(db, f"jobID = {watched} AND awaited = 1") == 1,
                  DEADLINE, "the job marked awaited")
            ok(client.request("FinishJob", jobID=watched, data={"r": 1}))
            assert ok(waiting.result()).json["data"] == {"r": 1}
    finally:
        server.stop()


def test_retention_prunes_outcomes_past_keep_outcomes(db: Path | str) -> None:
    server = ThreadServer(db, keep_outcomes=1.0, prune_interval=0.2)
    try:
        with server.client() as client:
            job_id = running(client)
            ok(client.request("FinishJob", jobID=job_id))
            assert ok(client.request("AwaitJob", jobID=job_id, timeout=0)).json["state"] == (
                "FINISHED"
            )
            # Deleted by the pruner, not only past its time.
            until(lambda: _outcome_rows(db) == 0, DEADLINE, "the outcome pruned")
            assert client.request("AwaitJob", jobID=job_id, timeout=0).status.startswith("404")
    finally:
        server.stop()


def _outcome_rows(db: Path | str) -> int:
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0])
    with psycopg.connect(str(db)) as conn:
        row = conn.execute("SELECT COUNT(*) FROM outcomes").fetchone()
        assert row is not None
        return int(row[0])


def test_the_number_of_waiting_awaitjobs_is_bounded(server, client) -> None:
    engine = server.server.core.engine if hasattr(server, "server") else None
    if engine is None:
        pytest.skip("one server")
    # The bound is MAX_AWAITING (10,000); a server with a smaller one shows
    # the refusal without 10,000 connections.
    engine.awaits._most = 2
    job_id = create(client)
    waiting = [Awaiting(server, job_id) for _ in range(2)]
    until(lambda: awaiters(server) == 2, DEADLINE, "two AwaitJobs waiting")
    refused = client.request("AwaitJob", jobID=job_id)
    assert refused.status == "503 Too many AwaitJobs waiting (max 10000)"
    ok(client.request("DeleteJob", jobID=job_id))
    for each in waiting:
        assert ok(each.result()).json["state"] == "DELETED"
    assert ok(client.request("AwaitJob", jobID=job_id)).json["state"] == "DELETED"


def test_a_client_that_hangs_up_stops_its_awaitjob(server, client) -> None:
    job_id = create(client)
    waiting = Awaiting(server, job_id)
    until(lambda: awaiters(server) == 1, DEADLINE, "the AwaitJob waiting")
    # Shut down, not only closed: its reading thread holds the socket.
    waiting.client.sock.shutdown(socket.SHUT_RDWR)
    until(lambda: awaiters(server) == 0, DEADLINE, "the awaiter gone with its client")


# Several nodes (PostgreSQL).


def test_an_awaitjob_on_one_node_wakes_when_another_ends_the_job(
    backend: str, db: Path | str
) -> None:
    only_postgres(backend)
    nodes = Nodes(str(db), 2)
    first, second = nodes.nodes
    try:
        with second.client() as other:
            job_id = running(other, data={"n": 1})
            waiting = Awaiting(first, job_id)
            until(lambda: awaiters(first) == 1, DEADLINE, "the AwaitJob waiting on node 1")
            # The listener's fallback wakes no awaiter: only the notice does.
            time.sleep(1.5)
            assert not waiting.answered()
            began = time.monotonic()
            ok(other.request("FinishJob", jobID=job_id, data={"n": 2}))
            until(waiting.answered, DEADLINE, "the awaiter woken")
            woke = time.monotonic() - began
            assert ok(waiting.result()).json["data"] == {"n": 2}
            assert woke < 0.9, woke
    finally:
        nodes.stop()


# Clients.


def test_the_blocking_client_awaits_a_job(server) -> None:
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        job_id = jobs.create_job("work", data={"a": 1})
        assert jobs.await_job(job_id, timeout=0.2) is None
        jobs.get_job("work")
        threading.Timer(0.3, lambda: _finish(server, job_id)).start()
        outcome = jobs.await_job(job_id, timeout=DEADLINE)
        assert outcome is not None
        assert outcome["state"] == "FINISHED" and outcome["data"] == {"done": 1}
        with pytest.raises(JobNotFound):
            jobs.await_job(10**9)


def _finish(server: Any, job_id: int) -> None:
    with server.client() as client:
        ok(client.request("FinishJob", jobID=job_id, data={"done": 1}))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_the_async_client_awaits_a_job(server, loop: str) -> None:
    async def scenario() -> None:
        async with AsyncClient("127.0.0.1", server.port, timeout=10) as jobs:
            job_id = await jobs.create_job("work")
            await jobs.get_job("work")
            async with anyio.create_task_group() as group:
                got: list[Any] = []

                async def wait() -> None:
                    async with AsyncClient("127.0.0.1", server.port, timeout=10) as other:
                        got.append(await other.await_job(job_id, timeout=DEADLINE))

                group.start_soon(wait)
                await anyio.sleep(0.2)
                await jobs.fail_job(job_id, error="broke")
            assert got[0]["state"] == "FAILED" and got[0]["lastError"] == "broke"
            assert await jobs.await_job(job_id, timeout=0) == got[0]

    anyio.run(scenario, backend=loop)


def test_the_trio_client_awaits_a_job(server) -> None:
    async def scenario() -> None:
        async with TrioClient("127.0.0.1", server.port, timeout=10) as jobs:
            job_id = await jobs.create_job("work")
            assert await jobs.await_job(job_id, timeout=0.1) is None
            await jobs.delete_job(job_id)
            outcome = await jobs.await_job(job_id)
            assert outcome is not None and outcome["state"] == "DELETED"

    trio.run(scenario)


def test_the_cli_awaits_a_job(server, client) -> None:
    cli = Cli(f"127.0.0.1:{server.port}")
    job_id = create(client, "work")
    done = cli("await", str(job_id), "--timeout", "0.2")
    assert (done.returncode, done.stdout, done.stderr) == (6, "", "202 Job not ended yet\n")
    ok(client.request("DeleteJob", jobID=job_id))
    assert cli.ok("await", str(job_id))["state"] == "DELETED"
    cli.refused("404 No job with this jobID", 1, "await", "999999")


def test_post_api_awaitjob(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", http_port=0)
    try:
        until(lambda: server.server.http_port, DEADLINE, "the HTTP side to listen")
        with server.client() as client:
            job_id = running(client)
            code, body = _post(server, {"jobID": job_id, "timeout": 100})
            assert (code, body) == (202, {"jobID": job_id, "state": "RUNNING"})
            ok(client.request("FinishJob", jobID=job_id, data={"x": 1}))
            code, body = _post(server, {"jobID": job_id})
            assert code == 200 and body["state"] == "FINISHED" and body["data"] == {"x": 1}
            code, body = _post(server, {"jobID": 10**9})
            assert code == 404
            code, body = _post(server, {"jobID": "one"})
            assert code == 400
    finally:
        server.stop()


def _post(server: ThreadServer, document: dict[str, Any]) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{server.server.http_port}/api/AwaitJob"
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
