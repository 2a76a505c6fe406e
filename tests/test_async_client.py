"""AsyncClient (anyio): the same behaviour on asyncio and on trio, against
a real server. Each test is a plain function running its scenario with
`anyio.run` on the loop it is given: the suite's trio_mode (pytest-trio)
would run any async test function on trio alone."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.tls import TLSStream

from fake_server import HANG_UP, NO_REPLY, OK, FakeServer, reply
from harness import ThreadServer
from helpers import free_port
from jobserver.client import (
    AsyncClient,
    Client,
    Conflict,
    ConnectionFailed,
    Finish,
    InvalidRequest,
    JobNotFound,
    MalformedRequest,
    TLSFailed,
)
from tls_certs import tls_server

on_each_loop = pytest.mark.parametrize("loop", ["asyncio", "trio"])

# For what the server reports once a request has arrived.
DEADLINE = 5.0
TOKEN = "s3cret-token"


def run(loop: str, scenario: Callable[[], Awaitable[None]]) -> None:
    anyio.run(scenario, backend=loop)


async def until_waiting(jobs: AsyncClient, count: int) -> None:
    """Until the server holds `count` waiting GetJobs."""
    with anyio.fail_after(DEADLINE):
        while (await jobs.status())["waitingGetJobs"] != count:  # noqa: ASYNC110 - only the server knows
            await anyio.sleep(0.01)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def start(*scripts: list[bytes | str | None]) -> FakeServer:
        started.append(FakeServer(*scripts))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
        and name not in {"close", "aclose", "from_address", "switch_server"}
    }


def test_it_has_the_methods_of_client_with_the_same_parameters():
    methods = public_methods(AsyncClient)
    assert methods == public_methods(Client)
    assert all(inspect.iscoroutinefunction(getattr(AsyncClient, name)) for name in methods)
    assert AsyncClient.get_job.__doc__ == Client.get_job.__doc__


@on_each_loop
def test_every_method_on_one_kept_connection(loop, server):
    async def scenario() -> None:
        async with AsyncClient("127.0.0.1", server.port, timeout=10) as jobs:
            await jobs.ping()
            connection = jobs._stream
            job_id = await jobs.create_job("a/one", {"k": "v\n"}, priority=750)
            [other, third, fourth] = await jobs.create_jobs(
                [{"name": "a/two"}, {"name": "a/three"}, {"name": "a/four"}]
            )
            job = await jobs.get_job("a/*")
            assert (job["jobID"], job["data"]) == (job_id, {"k": "v\n"})
            batch = await jobs.get_jobs("a/*", 5)
            assert sorted(j["jobID"] for j in batch) == [other, third, fourth]
            await jobs.update_job(job_id, {"k": 2}, priority=1000)
            assert await jobs.touch_job(job_id, lease_id=job["leaseID"]) is not None
            await jobs.finish_job(job_id, {"done": True}, lease_id=job["leaseID"])
            leases = {j["jobID"]: j["leaseID"] for j in batch}
            results = await jobs.finish_jobs(
                [Finish(third, leases[third], None), Finish(fourth, "stale", None)]
            )
            assert results[0].ok and isinstance(results[1].error(), Conflict)
            await jobs.fail_job(other, lease_id=leases[other], error="broken")
            assert [j["lastError"] for j in await jobs.failed_jobs("a/*")] == ["broken"]
            assert (await jobs.query_job(other))["state"] == "FAILED"
            await jobs.requeue_jobs([other])
            held = await jobs.get_job("a/two")
            await jobs.retry_job(other, delay=60, lease_id=held["leaseID"])
            assert (await jobs.await_reply(fourth, "hook", timeout=60, lease_id=leases[fourth]))[
                "state"
            ] == "WAITING"
            assert await jobs.deliver_reply("hook", {"x": 1}) == {"jobID": fourth}
            await jobs.delete_job(other)
            with pytest.raises(JobNotFound):
                await jobs.cancel_job(other)
            parent = await jobs.create_job("p/parent")
            lease = (await jobs.get_job("p/parent"))["leaseID"]
            child = await jobs.create_job("p/child", parent_job_id=parent)
            await jobs.finish_job(parent, lease_id=lease)  # its child is queued
            await jobs.cancel_job(child)
            assert (await jobs.query_job(child))["state"] == "CANCELLED"

            await jobs.pause_jobs("x/*")
            await jobs.set_limit("x/*", 2, rate="10/1m", per_key=True)
            status = await jobs.status()
            assert (status["paused"], status["limits"]["x/*"]) == (
                ["x/*"],
                {"max": 2, "rate": "10/1m", "perKey": True, "running": 0, "inWindow": 0, "keys": 0},
            )
            keyed = await jobs.create_job("x/keyed", key="acme")
            [also] = await jobs.create_jobs([{"name": "x/keyed", "key": "globex"}])
            assert [(await jobs.query_job(j))["key"] for j in (keyed, also)] == ["acme", "globex"]
            await jobs.resume_jobs("x/*")
            assert "a" in {queue["queue"] for queue in (await jobs.queues())["queues"]}
            rows = await jobs.query(f"SELECT name FROM jobs WHERE jobID = {parent};")
            assert rows["rows"] == [["p/parent"]]
            assert (await jobs.request("Ping", {})).status == "200 OK"
            assert (await jobs.backup("copy.db"))["name"] == "copy.db"
            assert await jobs.get_job("nothing/*") is None
            assert await jobs.get_jobs("nothing/*", 2) == []

            # A refusal is the right error, with the server's status line,
            # and leaves the connection in step.
            with pytest.raises(InvalidRequest) as refused:
                await jobs.create_job("a/bad", repeat="NEVER EVER")
            assert (refused.value.code, refused.value.status) == (402, "402 Malformed repeat")
            with pytest.raises(Conflict, match="409 Lease expired"):
                await jobs.update_job(fourth, {}, lease_id="stale")
            assert jobs._stream is connection

    run(loop, scenario)


@on_each_loop
def test_a_cancelled_wait_drops_its_connection_and_a_create_wakes_the_next(loop, server):
    got: list[dict[str, Any] | None] = []

    async def scenario() -> None:
        async with (
            AsyncClient("127.0.0.1", server.port, timeout=10) as worker,
            AsyncClient("127.0.0.1", server.port, timeout=10) as jobs,
        ):
            async with anyio.create_task_group() as waiting:
                waiting.start_soon(worker.get_job, "wake", 20)
                await until_waiting(jobs, 1)
                # Another task's request would take the waiting one's reply.
                with pytest.raises(RuntimeError, match="serves one task at a time"):
                    await worker.ping()
                await until_waiting(jobs, 1)
                waiting.cancel_scope.cancel()
            # Out of step, so closed: the server is told and stops waiting.
            assert worker._stream is None
            await until_waiting(jobs, 0)

            async def wait_for_job() -> None:
                got.append(await worker.get_job("wake", wait=20))

            async with anyio.create_task_group() as waiting:
                waiting.start_soon(wait_for_job)
                await until_waiting(jobs, 1)
                job_id = await jobs.create_job("wake")
            assert got[0] is not None and got[0]["jobID"] == job_id

    run(loop, scenario)


@on_each_loop
def test_reconnect_rules_and_timeouts(loop, fake):
    garbled = b"HTTP/1.1 200 OK\r\n\r\n"
    server = fake([OK, HANG_UP], [NO_REPLY], [garbled], [NO_REPLY], [reply("200 OK", b"{}")])

    async def scenario() -> None:
        async with AsyncClient("127.0.0.1", server.port, timeout=5) as jobs:
            await jobs.ping()
            await anyio.to_thread.run_sync(server.wait_closed, 1)
            # The connection died while idle: replaced before sending. Once
            # sent, a write is never sent again.
            with pytest.raises(ConnectionFailed, match="may have been carried out"):
                await jobs.finish_job(1)
            with pytest.raises(ConnectionFailed, match="not a status line"):
                await jobs.update_job(1, {})
            # A read-only command is sent once more, on a new connection.
            assert await jobs.query_job(1) == {}
            # The fake now keeps silent: a waiting GetJob's reply is
            # awaited for its wait and the timeout; it is sent once more,
            # on a new connection, then given up.
            jobs.timeout = 0.2
            started = time.monotonic()
            with pytest.raises(ConnectionFailed, match="timed out"):
                await jobs.get_job("x", wait=0.2)
            assert 0.7 <= time.monotonic() - started < DEADLINE
        async with AsyncClient("127.0.0.1", free_port(), timeout=2) as jobs:
            with pytest.raises(ConnectionFailed, match="cannot connect"):
                await jobs.ping()

    run(loop, scenario)
    assert server.methods() == [
        (0, "Ping"), (1, "FinishJob"), (2, "UpdateJob"), (3, "QueryJob"), (4, "QueryJob"),
        (4, "GetJob"), (5, "GetJob"),
    ]


@on_each_loop
def test_reconnects_after_the_server_restarts(loop, tmp_path):
    servers = [ThreadServer(tmp_path / "jobs.db")]

    async def restart() -> None:
        await anyio.to_thread.run_sync(servers[0].stop)
        servers.append(ThreadServer(tmp_path / "jobs.db", port=servers[0].port))

    async def scenario() -> None:
        async with AsyncClient("127.0.0.1", servers[0].port, timeout=10) as jobs:
            job_id = await jobs.create_job("survivor")
            await restart()
            # A write, which is never sent twice: it succeeds only if the
            # dead connection was replaced before sending.
            assert await jobs.create_job("after") == job_id + 1
            assert (await jobs.query_job(job_id))["name"] == "survivor"

    try:
        run(loop, scenario)
    finally:
        servers[-1].stop()


@on_each_loop
def test_tls_with_the_test_ca_and_the_token(loop, tmp_path, server, fake):
    hangs_up = fake([HANG_UP])

    async def scenario(running: ThreadServer, ca: Path) -> None:
        address = ("127.0.0.1", running.port)
        async with AsyncClient(*address, timeout=10, auth_token=TOKEN, tls=ca) as jobs:
            job_id = await jobs.create_job("secure/async")
            connection = jobs._stream
            job = await jobs.get_job("secure/*", wait=1)
            await jobs.finish_job(job_id, lease_id=job["leaseID"])
            # What a TLS 1.3 server sends after the handshake (session
            # tickets) is not taken for the end of an idle connection.
            assert jobs._stream is connection and isinstance(connection, TLSStream)
        async with AsyncClient(*address, timeout=10, tls=ca) as jobs:
            with pytest.raises(MalformedRequest, match="401 Unauthorized"):
                await jobs.ping()
        async with AsyncClient(*address, timeout=10, auth_token=TOKEN, tls=True) as jobs:
            with pytest.raises(TLSFailed, match=r"not trusted .*--tls-ca FILE"):
                await jobs.ping()
        async with AsyncClient(*address, timeout=10, auth_token=TOKEN) as jobs:
            with pytest.raises(TLSFailed, match="requires TLS: use --tls"):
                await jobs.status()
        async with AsyncClient("127.0.0.1", server.port, timeout=10, tls=ca) as jobs:
            with pytest.raises(TLSFailed, match="does not speak TLS"):
                await jobs.ping()
        # A server that is restarting ends connections too: worth trying
        # again, so not a TLSFailed.
        async with AsyncClient("127.0.0.1", hangs_up.port, timeout=10, tls=ca) as jobs:
            with pytest.raises(ConnectionFailed) as ended:
                await jobs.ping()
            assert not isinstance(ended.value, TLSFailed)
            assert "the connection ended during the TLS handshake" in str(ended.value)

    with tls_server(tmp_path / "tls", auth_token=TOKEN) as (running, files):
        anyio.run(scenario, running, files.ca, backend=loop)
