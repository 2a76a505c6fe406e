"""A server that is broken or hostile cannot end a client, a worker or the
worker manager (issue 34, item 4): a reply that means nothing or is too
large to read is a broken connection, closed and replaced, whatever else
runs meanwhile; and a job handed out again while it runs is never run
twice at once.

The bad replies come from tests/hostile_front.py, a front on a real
loopback socket before a real server: every other request reaches the
real server. Nothing sleeps for a fixed time: tests wait for the server's
state or a log line, each with a deadline."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import trio

from hostile_front import FLOOD, FLOOD_HEAD, HostileFront, reply
from jobserver.client import AsyncClient, Client, ConnectionFailed, MalformedReply, TrioClient
from jobserver.wire.framing import ReplyReader
from jobserver.wire.limits import (
    DEFAULT_CLIENT_MAX_REPLY_BYTES,
    MAX_CLIENT_MAX_REPLY_BYTES,
    MIN_MAX_REPLY_BYTES,
)

DEADLINE = 15.0
PATTERN = "hostile/*"
# What a client may have taken of a flood before it closed the connection:
# the head, and what the socket buffers between held.
FLOOD_READ = 32 * 1024 * 1024

# Framed replies to GetJobs that mean nothing.
MEANINGLESS = {
    "not JSON": reply("200 OK", b"<html>Service Unavailable</html>"),
    "a job without a name": reply("200 OK", b'{"jobs":[{"jobID":7,"data":{}}]}'),
    "a list as jobID": reply("200 OK", b'{"jobs":[{"jobID":[7],"name":"hostile/x"}]}'),
    "a text as jobID": reply("200 OK", b'{"jobs":[{"jobID":"7","name":"hostile/x"}]}'),
    "jobs not a list": reply("200 OK", b'{"jobs":{"jobID":7,"name":"hostile/x"}}'),
}


@pytest.fixture
def front(server: Any) -> Iterator[HostileFront]:
    hostile = HostileFront(server.port)
    yield hostile
    hostile.close()


# The clients: one reply reader, one reading of replies, for all three.

CLIENTS = ("sync", "asyncio", "trio")


def get_jobs_twice(kind: str, port: int) -> list[object]:
    """Two GetJobs on one client of `kind`: what each returned or raised."""
    if kind == "sync":
        results: list[object] = []
        with Client("127.0.0.1", port) as client:
            for _ in range(2):
                try:
                    results.append(client.get_jobs(PATTERN, 5))
                except ConnectionFailed as error:
                    results.append(error)
        return results
    if kind == "asyncio":
        return anyio.run(_get_jobs_twice, AsyncClient("127.0.0.1", port), backend="asyncio")
    return trio.run(_get_jobs_twice, TrioClient("127.0.0.1", port))


async def _get_jobs_twice(client: AsyncClient | TrioClient) -> list[object]:
    results: list[object] = []
    async with client:
        for _ in range(2):
            try:
                results.append(await client.get_jobs(PATTERN, 5))
            except ConnectionFailed as error:
                results.append(error)
    return results


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("bad", MEANINGLESS.values(), ids=MEANINGLESS.keys())
def test_a_client_closes_a_connection_whose_reply_means_nothing(server, front, kind, bad):
    with server.client() as c:
        job_id = c.request("CreateJob", name="hostile/a").json["jobID"]
    front.answer_get_jobs_with(bad)

    first, second = get_jobs_twice(kind, front.port)

    assert isinstance(first, MalformedReply), first
    assert first.sent  # the server may have handed jobs out
    assert [job["jobID"] for job in second] == [job_id]  # type: ignore[attr-defined]
    assert front.connections == 2  # the first was closed, not read on


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_client_reads_no_reply_past_its_max_reply_bytes(server, front, kind):
    with server.client() as c:
        job_id = c.request("CreateJob", name="hostile/a").json["jobID"]
    # GetJobs is sent once more after a connection that broke: both floods.
    front.answer_get_jobs_with(FLOOD, FLOOD)

    first, second = get_jobs_twice(kind, front.port)

    assert isinstance(first, ConnectionFailed) and not isinstance(first, MalformedReply)
    assert "more than the 134,217,728 this client reads" in str(first)
    assert len(front.flooded) == 2
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded
    assert [job["jobID"] for job in second] == [job_id]  # type: ignore[attr-defined]


def test_the_reply_reader_refuses_a_body_past_its_bound_before_reading_it():
    at_bound = ReplyReader(MIN_MAX_REPLY_BYTES)
    at_bound.feed(f"200 OK\r\nContent-Length: {MIN_MAX_REPLY_BYTES}\r\n\r\n".encode())
    assert at_bound.reply() is None  # waits for the body
    past = ReplyReader(MIN_MAX_REPLY_BYTES)
    past.feed(f"200 OK\r\nContent-Length: {MIN_MAX_REPLY_BYTES + 1}\r\n\r\n".encode())
    with pytest.raises(ValueError, match="more than the 4,194,304 this client reads"):
        past.reply()
    flood = ReplyReader()
    flood.feed(FLOOD_HEAD)
    with pytest.raises(ValueError, match="100,000,000,000 bytes announced"):
        flood.reply()


@pytest.mark.parametrize(
    "value", [MIN_MAX_REPLY_BYTES - 1, MAX_CLIENT_MAX_REPLY_BYTES + 1, 2**20 * 8.0, True]
)
def test_a_clients_max_reply_bytes_is_range_checked(value):
    with pytest.raises(ValueError, match="max_reply_bytes must be 4,194,304 to 2,147,483,648"):
        Client(max_reply_bytes=value)
    assert Client().max_reply_bytes == DEFAULT_CLIENT_MAX_REPLY_BYTES
    assert Client(max_reply_bytes=MAX_CLIENT_MAX_REPLY_BYTES).max_reply_bytes > 0
