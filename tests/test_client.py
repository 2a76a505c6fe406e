"""jobserver.client: encoding, reply reading, every method against a real
server, typed errors, and the reconnect rules against a scripted fake."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from fake_server import HANG_UP, NO_REPLY, OK, FakeServer, reply
from helpers import free_port, until
from jobserver.client import (
    Client,
    Conflict,
    ConnectionFailed,
    Fail,
    IllegalState,
    InvalidRequest,
    JobNotFound,
    JobServerError,
    MalformedRequest,
    OutcomeUnknown,
    ReplyReader,
    ServerError,
    TLSFailed,
    TrioClient,
    UnrecognizedCommand,
    encode_request,
    parse_address,
)
from jobserver.wire.framing import RequestParser
from tls_certs import tls_server

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

DEADLINE = 5.0


@pytest.fixture
def jobs(server) -> Iterator[Client]:
    with Client("127.0.0.1", server.port, timeout=10) as client:
        yield client


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def start(*scripts: list[bytes | str | None]) -> FakeServer:
        started.append(FakeServer(*scripts))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def fake_client(server: FakeServer, timeout: float = 5.0) -> Client:
    return Client("127.0.0.1", server.port, timeout)


# Encoding: what goes on the wire.


def test_request_bytes_follow_the_protocol_example():
    data = {"path": "C:\\temp", "quote": 'say "hi"'}
    raw = encode_request("CreateJob", {"name": "escaped", "data": data, "repeat": None})
    assert raw == (
        b"CreateJob\r\nname: escaped\r\n"
        + rb'data: {"path":"C:\\\\temp","quote":"say \\"hi\\""}'
        + b"\r\n\r\n"
    )


def test_flags_numbers_and_lists():
    raw = encode_request("X", {"unique": True, "ignoreRepeat": False, "numResults": 3, "l": [1]})
    assert raw == b"X\r\nunique: true\r\nignoreRepeat: false\r\nnumResults: 3\r\nl: [1]\r\n\r\n"


@pytest.mark.parametrize("method, params", [
    ("Ping\r\nFake: header", {}),
    ("", {}),
    ("Ping", {"name\nx": "v"}),
    ("Ping", {"a:b": "v"}),
    ("Ping", {" lead": "v"}),
])
def test_lines_cannot_be_injected(method, params):
    with pytest.raises(ValueError):
        encode_request(method, params)


def test_values_that_are_not_json_are_refused():
    with pytest.raises(TypeError):
        encode_request("CreateJob", {"data": object()})
    with pytest.raises(ValueError):
        encode_request("CreateJob", {"data": {"x": float("nan")}})


def server_reads(raw: bytes) -> dict[str, str]:
    [request] = RequestParser().feed(raw)
    return request.headers


@given(st.text())
def test_any_text_arrives_as_sent(text):
    assert server_reads(encode_request("X", {"v": text})).get("v", "") == text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@given(st.dictionaries(st.text(), json_values, max_size=4))
def test_any_json_object_arrives_as_sent(data):
    assert json.loads(server_reads(encode_request("X", {"data": data}))["data"]) == data


# Reading replies, without a socket.


def test_reply_reader_byte_by_byte():
    raw = b"402 Bad query\r\nConnection: close\r\nerror: a\\nb\\\\c\r\nContent-Length: 3\r\n\r\nabc"
    reader = ReplyReader()
    for byte in raw[:-1]:
        reader.feed(bytes([byte]))
        assert reader.reply() is None
    reader.feed(raw[-1:])
    got = reader.reply()
    assert got is not None
    assert (got.status, got.code, got.body) == ("402 Bad query", 402, b"abc")
    assert got.headers == {"connection": "close", "error": "a\nb\\c", "content-length": "3"}
    assert got.closes_connection
    assert reader.leftover == 0


def test_reply_reader_keeps_what_follows_a_reply():
    reader = ReplyReader()
    reader.feed(b'200 OK\r\nContent-Length: 2\r\n\r\n{}200 OK\r\n')
    got = reader.reply()
    assert got is not None and got.json() == {} and not got.closes_connection
    assert reader.leftover == len(b"200 OK\r\n")


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"200 OK\r\n\r\n",
    b"200 OK\r\nContent-Length: -1\r\n\r\n",
    b"200 OK\r\nno colon\r\nContent-Length: 0\r\n\r\n",
    b"200 OK\r\nContent-Length: 0\xff\r\n\r\n",
])
def test_reply_reader_refuses_what_is_not_a_reply(raw):
    reader = ReplyReader()
    reader.feed(raw)
    with pytest.raises(ValueError):
        reader.reply()


def test_reply_reader_end_of_stream_mid_reply():
    reader = ReplyReader()
    reader.feed(b"200 OK\r\nContent-Length: 5\r\n\r\nab")
    assert reader.reply() is None
    with pytest.raises(ValueError, match="closed the connection"):
        reader.feed(b"")


# Addresses.


@pytest.mark.parametrize("address, expected", [
    ("jobs.example.com:9000", ("jobs.example.com", 9000)),
    ("10.0.0.5", ("10.0.0.5", 8888)),
    ("[::1]:8889", ("::1", 8889)),
    ("[::1]", ("::1", 8888)),
])
def test_parse_address(address, expected):
    assert parse_address(address) == expected
    client = Client.from_address(address, timeout=2)
    assert (client.host, client.port, client.timeout) == (*expected, 2)


@pytest.mark.parametrize(
    "address", ["", "::1", "host:", "host:http", "host:0", "host:70000", "[::1"]
)
def test_parse_address_refuses(address):
    with pytest.raises(ValueError):
        parse_address(address)


def _ping_each_client(address: str, port: int = 1) -> None:
    """A ping through the blocking, asyncio, trio (anyio) and trio-alone
    clients given `address` as their one host argument (`port` a wrong
    port, which an address's own port overrides)."""
    import anyio

    from jobserver.client import AsyncClient

    with Client(address, port, timeout=10) as jobs:
        jobs.ping()

    async def on_anyio() -> None:
        async with AsyncClient(address, port, timeout=10) as jobs:
            await jobs.ping()

    async def on_trio() -> None:
        async with TrioClient(address, port, timeout=10) as jobs:
            await jobs.ping()

    anyio.run(on_anyio, backend="asyncio")
    anyio.run(on_anyio, backend="trio")
    trio.run(on_trio)


def test_every_client_takes_one_host_port_string(server):
    _ping_each_client(f"127.0.0.1:{server.port}")
    _ping_each_client(f" localhost:{server.port} ")
    assert Client(f"127.0.0.1:{server.port}").servers.addresses == (("127.0.0.1", server.port),)
    # A host alone is still at `port`, an IPv6 address without brackets too.
    assert Client("localhost", 9000).servers.addresses == (("localhost", 9000),)
    assert Client("fe80::1%eth0", 9000).servers.addresses == (("fe80::1%eth0", 9000),)


def test_every_client_takes_one_bracketed_ipv6_address(tmp_path):
    from harness import ThreadServer

    running = ThreadServer(tmp_path / "jobs.db", host="::1")
    try:
        _ping_each_client(f"[::1]:{running.port}")
        _ping_each_client("::1", running.port)
    finally:
        running.stop()


@pytest.mark.parametrize(
    "address",
    ["", "host:", "host:http", "host:0", "host:70000", "[::1", "a:1:2", "::1::2", "h st:80"],
)
def test_a_malformed_host_argument_is_a_value_error(address):
    from jobserver.client import AsyncClient

    for client in (Client, AsyncClient, TrioClient):
        with pytest.raises(ValueError, match="server address"):
            client(address, 8888)


# Every method against the real server.


def test_create_and_query_keep_data_and_name_exactly(jobs):
    data = {"path": "C:\\temp", "quote": 'say "hi"', "lines": "a\r\nb\tc", "u": "ü😀\u2028"}
    job_id = jobs.create_job("  spaced name\\ ", data)
    job = jobs.query_job(job_id)
    assert (job["name"], job["data"], job["state"]) == ("  spaced name\\ ", data, "QUEUED")


def test_create_job_options(jobs):
    first_run = datetime(2030, 1, 1, 6, 0, tzinfo=timezone(timedelta(hours=2)))
    job_id = jobs.create_job(
        "report/daily",
        first_run=first_run,
        repeat="finished, +1 day",
        priority=1000,
        retry_after="+5 MINUTES",
    )
    job = jobs.query_job(job_id)
    assert job["nextRun"] == "2030-01-01 04:00:00"
    assert (job["repeat"], job["priority"], job["retryAfter"]) == (
        "FINISHED, +1 DAY", 1000, "+5 MINUTES")
    later = jobs.create_job("later", first_run="2031-02-03 04:05:06")
    assert jobs.query_job(later)["nextRun"] == "2031-02-03 04:05:06"


def test_create_job_flow_options_and_unique_without_overwrite(jobs):
    job_id = jobs.create_job("night/report", {"a": 1}, cost=3, time_windows="01:00-05:00",
                             time_zone="Europe/Paris")
    job = jobs.query_job(job_id)
    assert (job["cost"], job["timeWindows"], job["timeZone"]) == (3, "01:00-05:00", "Europe/Paris")
    assert jobs.create_job("night/report", {"a": 2}, unique=True, overwrite=False) == job_id
    assert jobs.query_job(job_id)["data"] == {"a": 1}
    assert jobs.create_job("night/report", {"a": 2}, unique=True) == job_id
    assert jobs.query_job(job_id)["data"] == {"a": 2}


def test_naive_datetimes_are_refused_before_sending(jobs):
    with pytest.raises(ValueError):
        jobs.create_job("x", first_run=datetime(2030, 1, 1))
    assert jobs.status()["jobs"] == {}


def test_unique_returns_the_existing_job(jobs):
    first = jobs.create_job("only/one", {"a": 1}, unique=True)
    assert jobs.create_job("only/one", {"b": 2}, unique=True) == first
    assert jobs.query_job(first)["data"] == {"a": 1, "b": 2}
    assert jobs.create_job("only/one") != first


def test_create_jobs(jobs):
    ids = jobs.create_jobs(
        [{"name": "thumb", "data": {"img": 1}}, {"name": "thumb", "jobPriority": 1000}]
    )
    assert ids == [ids[0], ids[0] + 1]
    assert jobs.query_job(ids[1])["priority"] == 1000


def test_get_job_and_get_jobs(jobs):
    assert jobs.get_job("mail/*") is None
    assert jobs.get_jobs("mail/*", 5) == []
    low = jobs.create_job("mail/low", priority=0)
    high = jobs.create_job("mail/high", priority=1000)
    assert jobs.get_job("mail/*", priority=0)["jobID"] == low
    assert jobs.query_job(low)["state"] == "RUNNING"
    more = jobs.create_jobs([{"name": "mail/a"}, {"name": "mail/b"}])
    assert [job["jobID"] for job in jobs.get_jobs("mail/*", 2)] == [high, more[0]]
    assert [job["jobID"] for job in jobs.get_jobs("mail/*", 5, priority=500)] == [more[1]]


def test_update_job(jobs):
    job_id = jobs.create_job("u", {"a": 1})
    jobs.update_job(job_id, {"b": 2}, repeat="HOURLY", priority=250, next_run="2030-05-06 07:08:09")
    job = jobs.query_job(job_id)
    assert (job["data"], job["repeat"], job["priority"], job["nextRun"]) == (
        {"b": 2}, "HOURLY", 250, "2030-05-06 07:08:09")
    jobs.update_job(job_id, {"c": 3}, clear_repeat=True)
    assert (jobs.query_job(job_id)["repeat"], jobs.query_job(job_id)["data"]) == ("", {"c": 3})


def test_query_returns_headers_and_rows(jobs):
    first = jobs.create_job("q/one", priority=1000)
    second = jobs.create_job("q/two")
    body = jobs.query("SELECT jobID, name, priority FROM jobs ORDER BY jobID;")
    assert body == {"headers": ["jobID", "name", "priority"],
                    "rows": [[first, "q/one", 1000], [second, "q/two", 500]]}
    with pytest.raises(InvalidRequest, match="402 Query Missing Semicolon"):
        jobs.query("SELECT 1")


def test_touch_job_gives_when_a_running_job_must_next_report(jobs):
    job_id = jobs.create_job("t")
    job = jobs.get_job("t")
    # No lease: RUNNING, and the stale-job net's deadline (--stale-after, a day) comes back.
    stale_at = jobs.touch_job(job_id, lease_id=job["leaseID"])
    assert stale_at is not None and stale_at > job["nextRun"]
    assert jobs.query_job(job_id)["state"] == "RUNNING"


def test_finish_job(jobs):
    once = jobs.create_job("once")
    repeating = jobs.create_job("again", repeat="FINISHED, +1 HOUR")
    assert {job["jobID"] for job in jobs.get_jobs("*", 2)} == {once, repeating}
    jobs.finish_job(once)
    jobs.finish_job(repeating, {"done": 1})
    with pytest.raises(JobNotFound):
        jobs.query_job(once)
    job = jobs.query_job(repeating)
    assert (job["state"], job["data"]) == ("QUEUED", {"done": 1})


def test_fail_job(jobs):
    job_id = jobs.create_job("f", {"a": 1})
    jobs.get_job("f")
    jobs.fail_job(job_id, {"why": "broken"})
    job = jobs.query_job(job_id)
    assert (job["state"], job["data"]) == ("FAILED", {"why": "broken"})


def test_retry_job(jobs):
    job_id = jobs.create_job("r", repeat="FINISHED, +1 DAY")
    jobs.get_job("r")
    next_run = datetime(2032, 1, 2, 3, 4, 5, tzinfo=UTC)
    jobs.retry_job(job_id, next_run=next_run, data={"n": 1}, name="r2", priority=750,
                   ignore_repeat=True)
    job = jobs.query_job(job_id)
    assert (job["state"], job["nextRun"], job["data"], job["name"], job["priority"]) == (
        "QUEUED", "2032-01-02 03:04:05", {"n": 1}, "r2", 750)
    jobs.update_job(job_id, {}, next_run="2000-01-01")
    jobs.get_job("r2")
    jobs.retry_job(job_id, delay=3600, ignore_repeat=True)
    assert jobs.query_job(job_id)["nextRun"] > datetime.now(UTC).strftime("%Y-%m-%d %H:%M")


def test_cancel_delete_and_requeue(jobs):
    parent = jobs.create_job("parent")
    jobs.get_job("parent")
    child = jobs.create_job("child", parent_job_id=parent)
    assert jobs.query_job(child)["state"] == "PAUSED"
    jobs.finish_job(parent)
    jobs.cancel_job(child)
    assert jobs.query_job(child)["state"] == "CANCELLED"
    assert jobs.query_job(parent)["state"] == "QUEUED"

    failed = jobs.create_job("flaky")
    jobs.get_job("flaky")
    jobs.fail_job(failed)
    jobs.requeue_jobs([failed], name="flaky2")
    job = jobs.query_job(failed)
    assert (job["state"], job["name"]) == ("QUEUED", "flaky2")
    jobs.delete_job(failed)
    with pytest.raises(JobNotFound):
        jobs.query_job(failed)


def test_ping_status_and_request(jobs):
    jobs.ping()
    jobs.create_job("s")
    status = jobs.status()
    assert status["jobs"] == {"QUEUED": 1} and status["connections"] == 1
    got = jobs.request("Status", {})
    assert (got.status, got.code, got.headers) == (
        "200 OK", 200, {"content-length": str(len(got.body))})
    assert got.json()["jobs"] == {"QUEUED": 1}


def test_retry_policy_leases_and_the_dead_set(jobs):
    job_id = jobs.create_job("p", retry_after="+1 HOUR", max_attempts=2, retry_backoff="fixed",
                             retry_delay=0.25, retry_max_delay=10)
    job = jobs.get_job("p")
    assert (job["jobID"], job["attempt"], job["maxAttempts"], len(job["leaseID"])) == (
        job_id, 1, 2, 16)
    assert jobs.touch_job(job_id, lease_id=job["leaseID"]) > job["nextRun"]
    jobs.update_job(job_id, {"step": 1}, lease_id=job["leaseID"])
    with pytest.raises(Conflict, match="409 Lease expired"):
        jobs.finish_job(job_id, lease_id="not-the-lease")
    jobs.fail_job(job_id, lease_id=job["leaseID"], error="first try")
    shown = jobs.query_job(job_id)
    assert (shown["state"], shown["lastError"], shown["retryDelay"]) == (
        "QUEUED", "first try", 0.25)
    [job] = jobs.get_jobs("p", 5, wait=5)
    assert job["attempt"] == 2
    jobs.fail_job(job_id, {"error": "in the data"}, lease_id=job["leaseID"], error="for good")
    [dead] = jobs.failed_jobs("p*", limit=10)
    assert (dead["jobID"], dead["lastError"], dead["attempt"]) == (job_id, "for good", 2)
    assert jobs.failed_jobs("other") == []


# Refusals, each as its own exception.


def raised(action: Callable[[], Any]) -> JobServerError:
    with pytest.raises(JobServerError) as caught:
        action()
    return caught.value


@pytest.mark.parametrize("action, kind, status", [
    (lambda c: c.create_jobs([]), MalformedRequest, "401 Invalid JSON"),
    (lambda c: c.create_job("x", priority=1), InvalidRequest, "402 Invalid priority value"),
    (lambda c: c.query_job(424242), JobNotFound, "404 No job with this jobID"),
    (lambda c: c.finish_job(c.create_job("q")), IllegalState,
     "405 Can only retry/finish RUNNING and RUNQUEUED jobs"),
    (lambda c: c.request("Bogus", {}), UnrecognizedCommand, "430 Unrecognized command"),
    (lambda c: c.request("Query", {"query": "SELECT 1"}), InvalidRequest,
     "402 Query Missing Semicolon"),
    (lambda c: c.request("Query", {"query": "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL "
                                   "SELECT x + 1 FROM n WHERE x <= 10000) SELECT x FROM n;"}),
     JobServerError, "413 Query returned more than 10000 rows"),
])
def test_refusals_from_the_server(jobs, action, kind, status):
    error = raised(lambda: action(jobs))
    assert type(error) is kind
    assert (error.status, error.code, error.reason) == (status, int(status[:3]), status[4:])
    jobs.ping()  # the connection is still good


@pytest.mark.parametrize("status, kind", [
    ("401 Unauthorized", MalformedRequest),
    ("402 Missing name", InvalidRequest),
    ("404 No job found", JobNotFound),
    ("405 Cannot create grandchildren", IllegalState),
    ("409 Conflict", Conflict),
    ("430 Unrecognized command", UnrecognizedCommand),
    ("500 Unhandled Exception: KeyError", ServerError),
    ("503 Database unavailable: disk I/O error", ServerError),
    ("555 Timeout", ServerError),
    ("418 I'm a teapot", JobServerError),
    ("302 Found", JobServerError),
])
def test_every_status_code_maps_to_its_exception(fake, status, kind):
    server = fake([reply(status)])
    with fake_client(server) as client:
        error = raised(lambda: client.create_job("x"))
    assert type(error) is kind and error.status == status


def test_only_no_job_found_is_an_empty_answer(fake):
    server = fake([reply("404 No job found"), reply("404 No job found")])
    with fake_client(server) as client:
        assert client.get_job("x") is None
        assert client.get_jobs("x", 3) == []


# Waiting GetJob.


def test_waiting_get_job_is_woken_by_a_create(server, jobs):
    got: list[dict[str, Any] | None] = []
    worker = threading.Thread(target=lambda: got.append(jobs.get_job("wake/*", wait=20)))
    worker.start()
    with Client(port=server.port, timeout=10) as other:
        until(lambda: other.status()["waitingGetJobs"] == 1, DEADLINE, "the GetJob to wait")
        job_id = other.create_job("wake/up")
    worker.join(DEADLINE)
    assert not worker.is_alive()
    assert got[0] is not None and got[0]["jobID"] == job_id


def test_waiting_get_jobs_is_woken_by_a_create(server, jobs):
    got: list[list[dict[str, Any]]] = []
    worker = threading.Thread(target=lambda: got.append(jobs.get_jobs("batch", 10, wait=20)))
    worker.start()
    with Client(port=server.port, timeout=10) as other:
        until(lambda: other.status()["waitingGetJobs"] == 1, DEADLINE, "the GetJob to wait")
        ids = other.create_jobs([{"name": "batch"}, {"name": "batch"}])
    worker.join(DEADLINE)
    assert not worker.is_alive()
    assert [job["jobID"] for job in got[0]] == ids


def test_a_wait_longer_than_the_timeout_is_not_cut_short(server):
    with Client(port=server.port, timeout=0.2) as client:
        started = time.monotonic()
        assert client.get_job("never", wait=0.6) is None
        assert time.monotonic() - started >= 0.6


def test_reply_to_a_wait_is_awaited_for_the_wait_plus_the_timeout(fake):
    server = fake([])  # reads the request, never answers
    with fake_client(server, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(ConnectionFailed, match="timed out"):
            client.get_job("x", wait=0.3)
        assert 0.55 <= time.monotonic() - started < DEADLINE


# Reconnect rules.


def test_cannot_connect():
    with (
        Client(port=free_port(), timeout=2) as client,
        pytest.raises(ConnectionFailed, match="cannot connect"),
    ):
        client.ping()


@pytest.mark.parametrize("stop", ["terminate", "kill"])
def test_reconnects_after_a_server_restart(start_server, stop):
    first = start_server()
    with Client(port=first.port, timeout=10) as client:
        job_id = client.create_job("survivor")
        getattr(first.proc, stop)()
        first.wait()
        start_server(first.db, "--port", str(first.port))
        # A write, which is never sent twice: it succeeds only if the dead
        # connection was replaced before sending.
        assert client.create_job("after") == job_id + 1
        assert client.query_job(job_id)["name"] == "survivor"


def test_a_connection_closed_while_idle_is_replaced_before_sending(fake):
    server = fake([OK, HANG_UP], [reply("200 OK", b'{"jobID":7}')])
    with fake_client(server) as client:
        client.ping()
        server.wait_closed(1)
        assert client.create_job("x") == 7
    assert server.methods() == [(0, "Ping"), (1, "CreateJob")]


def test_a_send_that_fails_on_a_kept_connection_is_made_on_a_new_one(fake):
    server = fake([OK], [reply("200 OK", b'{"jobID":7}')])
    with fake_client(server) as client:
        client.ping()
        # White box: from now on sending fails at once, though the
        # connection has nothing to read and so looks alive.
        client._sock.shutdown(socket.SHUT_WR)
        assert client.create_job("x") == 7
    assert server.methods() == [(0, "Ping"), (1, "CreateJob")]


def test_bytes_beyond_the_reply_retire_the_connection(fake):
    server = fake([OK + b"200 OK\r\n"], [OK])
    with fake_client(server, timeout=1) as client:
        client.ping()
        client.ping()
    assert server.methods() == [(0, "Ping"), (1, "Ping")]


def test_connection_close_in_a_reply_closes_the_connection(fake):
    server = fake([reply("200 OK", b"", "Connection: close")], [OK])
    with fake_client(server) as client:
        client.ping()
        client.ping()
    assert server.methods() == [(0, "Ping"), (1, "Ping")]


def test_connection_close_from_the_real_server(jobs):
    assert jobs.request("Ping", {"Connection": "close"}).closes_connection
    jobs.create_job("next")  # a write: sent on a new connection, not retried


SENT_ONCE = {
    "UpdateJob": lambda c: c.update_job(1, {}),
    "FinishJob": lambda c: c.finish_job(1),
    "FailJob": lambda c: c.fail_job(1),
    "RetryJob": lambda c: c.retry_job(1),
    "CancelJob": lambda c: c.cancel_job(1),
    "DeleteJob": lambda c: c.delete_job(1),
    "RequeueJobs": lambda c: c.requeue_jobs([1, 2]),
}


@pytest.mark.parametrize("method", SENT_ONCE)
def test_a_request_that_may_have_run_is_not_sent_again(fake, method):
    server = fake([NO_REPLY], [OK])
    with (
        fake_client(server) as client,
        pytest.raises(ConnectionFailed, match="may have been carried out"),
    ):
        SENT_ONCE[method](client)
    assert server.methods() == [(0, method)]


@pytest.mark.parametrize("method, action, body", [
    ("CreateJob", lambda c: c.create_job("x", {"a": 1}), b'{"jobID":7}'),
    ("CreateJobs", lambda c: c.create_jobs([{"name": "x"}]), b'{"jobIDs":[7]}'),
])
def test_a_create_is_sent_once_more_under_the_same_idempotency_key(fake, method, action, body):
    # The server the second try goes to is asked first whether it keeps
    # keys: a CreateJobs of no jobs, refused, that names no key ignored.
    server = fake([NO_REPLY], [reply("401 Invalid JSON"), reply("200 OK", body)])
    with fake_client(server) as client:
        action(client)
    assert server.methods() == [(0, method), (1, "CreateJobs"), (1, method)]
    keys = [
        [line for line in head.split(b"\r\n") if line.startswith(b"idempotencyKey: ")]
        for _, head in server.requests
    ]
    assert keys[1] == [b"idempotencyKey: probe"]
    assert len(keys[0]) == 1 and keys[0] == keys[2], keys


def test_a_create_is_not_sent_again_to_a_server_that_ignores_idempotency_keys(fake):
    # A server older than the keys names the key among the headers it
    # ignores: sent there again, the create would be made twice.
    older = reply("401 Invalid JSON", b"", "ignoredHeaders: idempotencyKey")
    server = fake([NO_REPLY], [older])
    with fake_client(server) as client, pytest.raises(ConnectionFailed) as lost:
        client.create_job("x")
    assert lost.value.sent
    assert server.methods() == [(0, "CreateJob"), (1, "CreateJobs")]


def test_a_create_with_an_empty_key_goes_without_one_and_is_not_sent_again(fake):
    server = fake([NO_REPLY], [OK])
    with fake_client(server) as client, pytest.raises(ConnectionFailed) as lost:
        client.create_job("x", idempotency_key="")
    assert lost.value.sent
    assert server.methods() == [(0, "CreateJob")]
    assert b"idempotencyKey" not in server.requests[0][1]


def test_a_server_seen_to_keep_keys_is_not_asked_again(fake):
    server = fake([reply("200 OK", b'{"jobID":1}'), NO_REPLY], [reply("200 OK", b'{"jobID":2}')])
    with fake_client(server) as client:
        assert client.create_job("x") == 1
        assert client.create_job("y") == 2
    assert server.methods() == [(0, "CreateJob"), (0, "CreateJob"), (1, "CreateJob")]


def test_a_lone_surrogate_in_a_report_is_sent_as_utf_8_can_carry_it(fake):
    """Data or an error text made of what a client sent may hold a lone
    surrogate (a JSON escape), which UTF-8 cannot carry: data keeps it as
    an escape, a plain text gets U+FFFD, and the report is sent."""
    server = fake([OK, reply("200 OK", b'{"results":[{"jobID":2,"status":"200 OK"}]}')])
    with fake_client(server) as client:
        client.fail_job(1, data={"to": "\udcff"}, error="bad \udcff")
        client.fail_jobs([Fail(2, error="\ud800", data={"k": ["\udfff"]})])
    [(_, first), (_, second)] = server.requests
    assert b'data: {"to":"\\\\udcff"}' in first and "error: bad \ufffd".encode() in first
    # The data's lone surrogate made the whole text ASCII, U+FFFD escaped.
    assert b'"error":"\\\\ufffd"' in second and b'\\\\udfff' in second


def test_a_create_whose_second_try_is_refused_with_a_5xx_is_an_unknown_outcome(fake):
    server = fake([NO_REPLY], [reply("401 Invalid JSON"), reply("503 Database unavailable: gone")])
    with fake_client(server) as client, pytest.raises(OutcomeUnknown) as unknown:
        client.create_job("x", idempotency_key="mine")
    assert unknown.value.status == "503 Database unavailable: gone"
    assert "idempotency key mine" in str(unknown.value)


@pytest.mark.parametrize("method, action", [
    ("Ping", lambda c: c.ping()),
    ("Status", lambda c: c.status()),
    ("QueryJob", lambda c: c.query_job(1)),
    ("Query", lambda c: c.query("SELECT 1;")),
    # Not read-only, but a job handed out in a lost reply is put back (or
    # comes back by its lease), so none is run twice.
    ("GetJob", lambda c: c.get_job("x")),
    ("GetJobs", lambda c: c.get_jobs("x", 5, wait=1)),
])
def test_read_only_requests_and_hand_outs_are_sent_once_more(fake, method, action):
    # A body every one of them can read: GetJob's job, GetJobs' list.
    server = fake([NO_REPLY], [reply("200 OK", b'{"jobID": 1, "name": "x", "jobs": []}')])
    with fake_client(server) as client:
        action(client)
    assert server.methods() == [(0, method), (1, method)]


def test_read_only_requests_are_sent_only_once_more(fake):
    server = fake([NO_REPLY], [NO_REPLY], [OK])
    with fake_client(server) as client, pytest.raises(ConnectionFailed):
        client.ping()
    assert server.methods() == [(0, "Ping"), (1, "Ping")]


def test_a_garbled_reply_breaks_the_connection(fake):
    server = fake([b"HTTP/1.1 200 OK\r\n\r\n"], [OK])
    with fake_client(server) as client:
        with pytest.raises(ConnectionFailed, match="not a status line"):
            client.finish_job(1)
        client.ping()  # on a new connection
    assert server.methods() == [(0, "FinishJob"), (1, "Ping")]


# TrioClient, with trio.


async def test_a_refusal_carries_the_servers_explanation_in_both_clients(server, backend):
    # The database's own message, SQLite's or PostgreSQL's (which goes on to
    # show where in the SQL), beyond the status line: in `detail` and in
    # the exception's text.
    why = {"sqlite": "no such table: jobz", "postgres": 'relation "jobz" does not exist\n'}
    with Client(port=server.port, timeout=10) as jobs, pytest.raises(InvalidRequest) as sync:
        jobs.query("SELECT * FROM jobz;")
    async with TrioClient(port=server.port, timeout=10) as jobs:
        with pytest.raises(InvalidRequest) as trio_side:
            await jobs.query("SELECT * FROM jobz;")
    for refused in (sync.value, trio_side.value):
        assert refused.status == "402 Bad query"
        assert f"{refused.detail}\n".startswith(why[backend]), refused
        assert str(refused) == f"402 Bad query: {refused.detail}"


async def test_async_client_methods(server):
    async with TrioClient(port=server.port, timeout=10) as jobs:
        await jobs.ping()
        job_id = await jobs.create_job("a/one", {"k": "v\n"}, priority=750)
        [other, third] = await jobs.create_jobs([{"name": "a/two"}, {"name": "a/three"}])
        job = await jobs.get_job("a/*")
        assert (job["jobID"], job["data"]) == (job_id, {"k": "v\n"})
        assert sorted(j["jobID"] for j in await jobs.get_jobs("a/*", 5)) == [other, third]
        await jobs.update_job(job_id, {"k": 2}, priority=1000)
        await jobs.finish_job(job_id, {"done": True}, lease_id=job["leaseID"])
        await jobs.fail_job(other, error="broken")
        assert [j["lastError"] for j in await jobs.failed_jobs("a/*")] == ["broken"]
        await jobs.retry_job(third, delay=60)
        assert (await jobs.query_job(other))["state"] == "FAILED"
        await jobs.requeue_jobs([other])
        await jobs.delete_job(other)
        with pytest.raises(JobNotFound):
            await jobs.query_job(job_id)
        with pytest.raises(JobNotFound):
            await jobs.cancel_job(other)
        assert (await jobs.status())["jobs"] == {"QUEUED": 1}
        assert (await jobs.request("Ping", {})).status == "200 OK"
        assert await jobs.get_job("a/*") is None
        assert await jobs.get_jobs("a/*", 2) == []
        leased = await jobs.create_job("a/leased", retry_after="+1 HOUR", max_attempts=3)
        job = await jobs.get_job("a/leased")
        assert job["attempt"] == 1
        assert await jobs.touch_job(leased, lease_id=job["leaseID"]) > job["nextRun"]
        with pytest.raises(Conflict):
            await jobs.update_job(leased, {}, lease_id="stale")
        await jobs.retry_job(leased, lease_id=job["leaseID"])
        costly = await jobs.create_job("a/costly", cost=2, time_windows="01:00-05:00")
        await jobs.update_job(costly, {"k": 3}, repeat="HOURLY")
        await jobs.update_job(costly, {"k": 4}, clear_repeat=True)
        body = await jobs.query(f"SELECT cost, repeat, data FROM jobs WHERE jobID = {costly};")
        assert body["rows"] == [[2, "", '{"k":4}']]


async def test_async_waiting_get_job_is_woken_by_a_create(server):
    got: list[dict[str, Any] | None] = []

    async def wait_for_job() -> None:
        async with TrioClient(port=server.port) as worker:
            got.append(await worker.get_job("wake", wait=20))

    async with TrioClient(port=server.port) as jobs, trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_job)
        with trio.fail_after(DEADLINE):
            while (await jobs.status())["waitingGetJobs"] != 1:  # noqa: ASYNC110 - only the server knows
                await trio.sleep(0.01)
        job_id = await jobs.create_job("wake")
    assert got[0] is not None and got[0]["jobID"] == job_id


async def test_async_cancelled_wait_drops_the_connection(server):
    async with TrioClient(port=server.port) as jobs:
        with trio.move_on_after(0.2):
            await jobs.get_job("later", wait=20)
        with trio.fail_after(DEADLINE):
            while (await jobs.status())["waitingGetJobs"] != 0:  # noqa: ASYNC110 - only the server knows
                await trio.sleep(0.01)
        job_id = await jobs.create_job("later")
        assert (await jobs.get_job("later"))["jobID"] == job_id


async def test_async_reconnect_rules(fake):
    server = fake([OK, HANG_UP], [NO_REPLY], [NO_REPLY], [reply("200 OK", b"{}")])
    async with TrioClient(port=server.port, timeout=5) as jobs:
        await jobs.ping()
        await trio.to_thread.run_sync(server.wait_closed, 1)
        with pytest.raises(ConnectionFailed, match="may have been carried out"):
            await jobs.finish_job(1)
        assert await jobs.query_job(1) == {}
    assert server.methods() == [(0, "Ping"), (1, "FinishJob"), (2, "QueryJob"), (3, "QueryJob")]


async def test_async_cannot_connect():
    async with TrioClient(port=free_port(), timeout=2) as jobs:
        with pytest.raises(ConnectionFailed, match="cannot connect"):
            await jobs.ping()


def test_flow_control_methods(server):
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        jobs.pause_jobs("mail/*")
        jobs.set_limit("mail/*", 3)
        status = jobs.status()
        assert status["paused"] == ["mail/*"]
        assert status["limits"]["mail/*"]["max"] == 3
        job_id = jobs.create_job("mail/one")
        assert jobs.get_job("mail/*") is None
        jobs.resume_jobs("mail/*")
        assert jobs.get_job("mail/*")["jobID"] == job_id
        jobs.set_limit("mail/*", 0)
        assert "mail/*" not in jobs.status()["limits"]
        with pytest.raises(InvalidRequest):
            jobs.set_limit("mail/*", -1)


def test_set_limit_takes_a_rate_per_key_and_fair_and_create_takes_a_key(server):
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        jobs.set_limit("mail/*", 1, rate="100/1m", per_key=True, fair=True)
        assert jobs.status()["limits"]["mail/*"] == {
            "max": 1, "rate": "100/1m", "perKey": True, "fair": True, "running": 0,
            "inWindow": 0, "keys": 0}
        acme = jobs.create_job("mail/a", key="acme")
        assert jobs.query_job(acme)["key"] == "acme"
        jobs.create_job("mail/b", key="acme")
        globex = jobs.create_jobs([{"name": "mail/c", "key": "globex"}])[0]
        # One running job per key: acme's second waits, globex's goes.
        assert {job["jobID"] for job in jobs.get_jobs("mail/*", 5)} == {acme, globex}
        # A rate alone needs no max; set again, the limit is replaced whole.
        jobs.set_limit("api/*", rate="2/1h")
        assert jobs.status()["limits"]["api/*"] == {
                "max": 0, "rate": "2/1h", "running": 0, "inWindow": 0}
        jobs.set_limit("api/*", 0)
        assert "api/*" not in jobs.status()["limits"]


@pytest.mark.parametrize("call, refused", [
    (lambda c: c.set_limit("x/*", rate="5/1w"), "402 Malformed rate (N/DURATION: 1 to 10000 "
     "per 1s to 1d, as 100/1m)"),
    (lambda c: c.set_limit("x/*", rate="10001/1s"), "402 Malformed rate"),
    (lambda c: c.create_job("x/a", key="a\nb"), "402 Malformed key"),
    (lambda c: c.create_job("x/a", key="k" * 256), "402 Key too large"),
    (lambda c: c.create_jobs([{"name": "x/a", "key": "a\tb"}]), "402 Malformed key"),
])
def test_a_bad_rate_or_key_is_refused_by_the_server(server, call, refused):
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        with pytest.raises(InvalidRequest) as error:
            call(jobs)
        assert error.value.status.startswith(refused), error.value.status
        assert jobs.status()["limits"] == {} and jobs.status()["jobs"] == {}


def test_per_key_alone_is_refused_before_sending(server):
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        jobs.set_limit("x/*", 3)
        with pytest.raises(ValueError, match="per_key needs max, rate or fair"):
            jobs.set_limit("x/*", per_key=True)
        assert jobs.status()["limits"]["x/*"]["max"] == 3


async def test_async_flow_control_methods(server):
    async with TrioClient("127.0.0.1", server.port, timeout=10) as jobs:
        await jobs.pause_jobs("x*")
        assert (await jobs.status())["paused"] == ["x*"]
        await jobs.resume_jobs("x*")
        await jobs.set_limit("x*", 2)
        assert (await jobs.status())["limits"]["x*"]["max"] == 2
        await jobs.set_limit("x*", rate="5/1s", per_key=True, fair=True)
        assert (await jobs.status())["limits"]["x*"] == {
            "max": 0, "rate": "5/1s", "perKey": True, "fair": True, "running": 0,
            "inWindow": 0, "keys": 0}
        job_id = await jobs.create_job("x1", key="tenant-1")
        assert (await jobs.query_job(job_id))["key"] == "tenant-1"


# TLS.


def test_tls_trusting_a_ca_file_on_one_kept_connection(secure):
    running, files = secure
    with Client("127.0.0.1", running.port, timeout=10, tls=str(files.ca)) as jobs:
        job_id = jobs.create_job("secure/one", {"k": "v"})
        connection = jobs._sock
        job = jobs.get_job("secure/*", wait=1)
        assert (job["jobID"], job["data"]) == (job_id, {"k": "v"})
        jobs.finish_job(job_id, lease_id=job["leaseID"])
        assert jobs.status()["jobs"] == {}
        # White box: what a TLS 1.3 server sends after the handshake (session
        # tickets) is not taken for the end of an idle connection.
        assert jobs._sock is connection
        assert isinstance(connection, ssl.SSLSocket)


def test_tls_by_host_name_and_with_a_context_of_ones_own(secure):
    running, files = secure
    with Client.from_address(f"localhost:{running.port}", timeout=10, tls=files.ca) as jobs:
        jobs.ping()
    context = ssl.create_default_context(cafile=str(files.ca))
    with Client("127.0.0.1", running.port, timeout=10, tls=context) as jobs:
        assert jobs.create_job("secure") == 1


def test_an_untrusted_certificate_is_refused_and_says_what_to_do(secure):
    running, files = secure
    with (
        Client("127.0.0.1", running.port, timeout=10, tls=True) as jobs,
        pytest.raises(TLSFailed, match=r"certificate is not trusted .*--tls-ca FILE"),
    ):
        jobs.create_job("never")
    with Client("127.0.0.1", running.port, timeout=10, tls=files.ca) as jobs:
        assert jobs.status()["jobs"] == {}


def test_a_certificate_for_another_name_is_refused(tmp_path):
    with (
        tls_server(tmp_path / "tls", "example.org") as (running, files),
        Client("127.0.0.1", running.port, timeout=10, tls=files.ca) as jobs,
        pytest.raises(TLSFailed, match=r"certificate is not for 127.0.0.1"),
    ):
        jobs.ping()


def test_a_ca_file_that_cannot_be_used_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read CA certificates from .*nope.pem"):
        Client(tls=tmp_path / "nope.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot read CA certificates from"):
        TrioClient(tls=str(garbage))


def test_a_handshake_that_ends_is_worth_trying_again(fake):
    # A server that is restarting ends connections too: not a TLSFailed, on
    # which the worker manager gives up for good.
    server = fake([HANG_UP])
    with (
        Client("127.0.0.1", server.port, timeout=5, tls=True) as jobs,
        pytest.raises(ConnectionFailed) as failure,
    ):
        jobs.create_job("x")
    assert not isinstance(failure.value, TLSFailed)
    assert "the connection ended during the TLS handshake" in str(failure.value)
    assert "may not speak TLS" in str(failure.value)


def test_the_reply_of_a_tls_only_port_says_to_use_tls_and_is_not_sent_again(fake):
    server = fake([reply("400 This port requires TLS", b"", "Connection: close")])
    with fake_client(server) as jobs, pytest.raises(TLSFailed) as failure:
        jobs.status()  # read-only: it would be sent once more after a broken connection
    assert str(failure.value) == f"the server at 127.0.0.1:{server.port} requires TLS: use --tls"
    assert server.methods() == [(0, "Status")]


def test_a_plaintext_client_meeting_the_real_tls_server_is_told_to_use_tls(secure):
    running, _ = secure
    with (
        Client("127.0.0.1", running.port, timeout=5) as jobs,
        pytest.raises(TLSFailed, match="requires TLS: use --tls"),
    ):
        jobs.create_job("x")


def test_a_full_tls_server_refuses_in_tls_so_the_client_may_try_again(tmp_path):
    # In plain text, the 503 read as "the server does not speak TLS": a
    # TLSFailed, on which the worker manager exits for good.
    with (
        tls_server(tmp_path / "tls", max_connections=1) as (running, files),
        Client("127.0.0.1", running.port, timeout=10, tls=files.ca) as holder,
    ):
        holder.ping()
        with (
            Client("127.0.0.1", running.port, timeout=10, tls=files.ca) as refused,
            pytest.raises(ServerError, match="503 Too many connections"),
        ):
            refused.ping()


def test_a_tls_client_meeting_the_real_plaintext_server_is_told_it_does_not_speak_tls(server):
    with (
        Client("127.0.0.1", server.port, timeout=5, tls=True) as jobs,
        pytest.raises(TLSFailed, match="does not speak TLS"),
    ):
        jobs.ping()


async def test_async_client_over_tls(secure):
    running, files = secure
    async with TrioClient("127.0.0.1", running.port, timeout=10, tls=files.ca) as jobs:
        job_id = await jobs.create_job("secure/async")
        connection = jobs._stream
        job = await jobs.get_job("secure/*", wait=1)
        await jobs.fail_job(job_id, lease_id=job["leaseID"], error="no")
        assert [j["lastError"] for j in await jobs.failed_jobs()] == ["no"]
        assert jobs._stream is connection and isinstance(connection, trio.SSLStream)
    async with TrioClient("127.0.0.1", running.port, timeout=10, tls=True) as jobs:
        with pytest.raises(TLSFailed, match=r"not trusted .*--tls-ca FILE"):
            await jobs.ping()


async def test_async_client_says_plainly_when_one_side_does_not_speak_tls(fake):
    hangs_up = fake([HANG_UP])
    async with TrioClient("127.0.0.1", hangs_up.port, timeout=5, tls=True) as jobs:
        with pytest.raises(ConnectionFailed, match="may not speak TLS"):
            await jobs.ping()
    tls_only = fake([reply("400 This port requires TLS", b"", "Connection: close")])
    async with TrioClient("127.0.0.1", tls_only.port, timeout=5) as jobs:
        with pytest.raises(TLSFailed, match="requires TLS: use --tls"):
            await jobs.query_job(1)
    assert tls_only.methods() == [(0, "QueryJob")]
