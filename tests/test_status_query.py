"""Ping, Status and the read-only Query command, over real sockets."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from harness import ThreadServer
from helpers import HeldSync, create, outside_address
from wire import Client, encode


def test_ping(client):
    reply = client.request("Ping")
    assert (reply.status, reply.body) == ("200 OK", b"")


def test_status_counts_jobs_waiters_and_connections(server, client):
    create(client, "a")
    create(client, "b")
    client.request("GetJob", name="a")
    with server.client() as waiter:
        waiter.send(b"GetJob\nname: none\nConnection: wait\ntimeout: 20000\n\n")
        with server.client() as third:
            status = _status_when(third, lambda s: s["waitingGetJobs"] == 1)
            assert status["jobs"] == {"QUEUED": 1, "RUNNING": 1}
            assert status["connections"] == 3
            assert status["database"]["path"] == str(server.db)
            assert status["database"]["bytes"] > 0
            assert status["version"]
            assert status["uptime"] >= 0
            assert status["commandsServed"] >= 3


def _status_when(client: Client, condition, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        reply = client.request("Status")
        assert reply.status == "200 OK"
        if condition(reply.json) or time.monotonic() > deadline:
            return reply.json
        time.sleep(0.02)


def test_query_list_format_has_a_header_row(client):
    create(client, "one")
    create(client, "two")
    reply = client.request("Query", query="SELECT jobID, name FROM jobs ORDER BY jobID;")
    assert reply.status == "200 OK"
    assert reply.body == b"jobID|name\n1|one\n2|two\n"


def test_query_json_format(client):
    create(client, "one")
    reply = client.request("Query", query="SELECT jobID, name, lastRun FROM jobs;", format="json")
    assert reply.json == {"headers": ["jobID", "name", "lastRun"], "rows": [[1, "one", ""]]}


def test_query_on_the_method_line(client):
    create(client, "one")
    client.send(b"Query: SELECT COUNT(*) AS n FROM jobs;\n\n")
    assert client.read_reply().body == b"n\n1\n"


def test_query_needs_a_semicolon_and_some_sql(client):
    # A client's mistake: 4xx, so that nobody retries it unchanged.
    assert client.request("Query", query="SELECT 1").status == "402 Query Missing Semicolon"
    assert client.request("Query").status == "402 Missing query"
    long = "SELECT '" + "x" * 1024 * 1024 + "';"
    assert client.request("Query", query=long).status == (
        "402 Query too large (1048576 characters at most)"
    )


def test_a_query_without_a_semicolon_on_the_method_line_is_402_too(client):
    client.send(b"Query: SELECT 1\r\n\r\n")
    assert client.read_reply().status == "402 Query Missing Semicolon"
    assert client.request("Ping").status == "200 OK"


def test_bad_query_reply_is_byte_for_byte_the_protocol_example(server):
    # protocol.md section 2: no `Connection: close`; the connection stays open.
    expected = (
        b"402 Bad query\r\n"
        b"error: no such table: nosuch\r\n"
        b"Content-Length: 21\r\n"
        b"\r\n"
        b"no such table: nosuch"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"Query: SELECT * FROM nosuch;\r\n\r\n")
        received = b""
        while len(received) < len(expected):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert received == expected
        sock.sendall(b"Ping\r\n\r\n")
        assert sock.recv(65536) == b"200 OK\r\nContent-Length: 0\r\n\r\n"


def test_bad_sql_says_why(client):
    reply = client.request("Query", query="SELECT nonsense FROM nowhere;")
    assert reply.status == "402 Bad query"
    assert "nowhere" in reply.headers["error"]
    assert b"nowhere" in reply.body


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM jobs;",
        "UPDATE jobs SET state = 'FAILED';",
        "INSERT INTO jobs (created, state, name, nextRun) VALUES ('', '', '', '');",
        "DROP TABLE jobs;",
        "CREATE TABLE evil (x);",
        "ATTACH DATABASE 'evil.db' AS evil;",
        "PRAGMA user_version = 99;",
        "PRAGMA journal_mode = DELETE;",
        "VACUUM;",
        "SELECT load_extension('/tmp/evil.so');",
        "SELECT 1; DELETE FROM jobs;",
        "WITH x AS (SELECT 1) DELETE FROM jobs;",
    ],
)
def test_query_cannot_write_or_escape(server, client, sql, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job_id = create(client, "kept")
    reply = client.request("Query", query=sql)
    assert reply.status == "402 Bad query", reply
    job = client.request("QueryJob", jobID=job_id).json
    assert (job["name"], job["state"]) == ("kept", "QUEUED")
    assert client.request("Query", query="PRAGMA user_version;").status == "402 Bad query"
    assert not (tmp_path / "evil.db").exists()


def test_query_cannot_build_huge_strings(client):
    reply = client.request("Query", query="SELECT zeroblob(100000000);")
    assert reply.status == "402 Bad query"


def test_query_that_runs_too_long_is_stopped(tmp_path):
    running = ThreadServer(tmp_path / "jobs.db", query_seconds=0.3)
    try:
        with running.client() as client:
            endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) " \
                      "SELECT COUNT(*) FROM c;"
            assert client.request("Query", query=endless).status == "555 Timeout"
            assert client.request("Ping").status == "200 OK"
    finally:
        running.stop()


def test_query_rows_are_capped(client):
    reply = client.request(
        "Query",
        query="WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 10001) "
        "SELECT x FROM c;",
    )
    assert reply.status == "413 Query returned more than 10000 rows"


@pytest.mark.parametrize("allowed", [False, True])
def test_query_from_a_non_loopback_client(tmp_path, allowed):
    address = outside_address()
    if address is None:
        pytest.skip("no non-loopback interface on this machine")
    running = ThreadServer(tmp_path / "jobs.db", host="0.0.0.0", allow_remote_query=allowed)
    try:
        with Client(running.port, host=address) as remote:
            reply = remote.request("Query", query="SELECT 1 AS one;")
            assert reply.status == ("200 OK" if allowed else "401 Unauthorized")
            assert remote.request("Ping").status == "200 OK"
    finally:
        running.stop()


def test_query_shows_no_write_before_it_is_synced(tmp_path: Path) -> None:
    """Query reads through a connection of its own, which sees commits
    not yet synced: its reply waits for their sync, as theirs do."""
    running = ThreadServer(tmp_path / "jobs.db")
    held = HeldSync(running.server.store)
    try:
        with running.client() as writer, running.client() as reader:
            writer.send(encode("CreateJob", {"name": "unsynced"}))
            assert held.entered.wait(10), "the CreateJob was never synced"
            reader.send(encode("Query", {"query": "SELECT name FROM jobs;"}))
            reader.sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                reader.read_reply()
            held.release.set()
            reader.sock.settimeout(10)
            reply = reader.read_reply()
            assert (reply.status, reply.body) == ("200 OK", b"name\nunsynced\n")
            assert writer.read_reply().status == "200 OK"
    finally:
        held.release.set()
        running.stop()
