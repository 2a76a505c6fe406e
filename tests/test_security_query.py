"""Query cannot leave "read the job tables, one statement, within its time
and its reply bound", whatever text it holds (issue 23: findings 1, 6 and
10). On SQLite the sandbox is the read-only connection, the authorizer and
its allow-list of functions; on PostgreSQL a connection that logs in as a
role of its own (storage/postgres_query.py). Every attack is sent as a
client would send it, to a real server, on a real database."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ServerProcess, ThreadServer
from helpers import create, ok
from jobserver.storage.sqlite_readers import QUERY_FUNCTIONS
from wire import encode

# A reply of 300 rows of 1 MB, made by the query itself.
HUGE_QUERY = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300) "
    "SELECT x, printf('%.*c', 1000000, 'x') AS big FROM c;"
)
SMALLEST_BOUND = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def sqlite_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path_factory.mktemp("query") / "jobs.db")
    yield running
    running.stop()


def _functions_of_this_sqlite() -> dict[str, tuple[int, str]]:
    """Every function this SQLite has: name -> (an arity it takes, its type)."""
    db = sqlite3.connect(":memory:")
    try:
        rows = db.execute("SELECT name, narg, type FROM pragma_function_list").fetchall()
    finally:
        db.close()
    return {name: (max(narg, 1) if narg < 0 else narg, kind) for name, narg, kind in rows}


def _call(name: str, arity: int, kind: str) -> str:
    """A call of a function with `arity` arguments, as a Query."""
    args = ", ".join(["'1'"] * arity)
    if name in ("->", "->>"):
        return f"SELECT '{{}}' {name} '$';"
    over = " OVER ()" if kind == "w" else ""
    return f"SELECT {name}({args}){over};"


# Finding 10: SQLite functions on an allow-list.


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT fts3_tokenizer('simple');",
        "SELECT hex(fts3_tokenizer('simple'));",
        "SELECT fts3_tokenizer('simple', x'0000000000000000');",
        "SELECT load_extension('/tmp/evil.so');",
        "SELECT load_extension('/tmp/evil.so', 'entry');",
        "SELECT sqlite_compileoption_get(0);",
        "SELECT name FROM jobs WHERE name = fts3_tokenizer('simple');",
        "SELECT * FROM pragma_table_info('jobs');",
        "PRAGMA writable_schema = 1;",
        "ATTACH DATABASE '/tmp/other.db' AS other;",
    ],
)
def test_sqlite_query_refuses_what_is_not_on_its_lists(sqlite_node: ThreadServer, sql: str) -> None:
    with sqlite_node.client() as client:
        reply = client.request("Query", query=sql)
        assert reply.status == "402 Bad query", reply
        assert "not authorized" in reply.headers["error"]
        assert client.request("Ping").status == "200 OK"


_UNLISTED = sorted(set(_functions_of_this_sqlite()) - QUERY_FUNCTIONS)


@settings(max_examples=150, deadline=None)
@given(
    name=st.one_of(
        st.sampled_from(_UNLISTED),
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,24}", fullmatch=True).filter(
            lambda name: name.lower() not in QUERY_FUNCTIONS
        ),
    )
)
def test_any_function_not_on_the_list_is_refused(sqlite_node: ThreadServer, name: str) -> None:
    known = _functions_of_this_sqlite().get(name.lower())
    arity, kind = known if known else (1, "s")
    with sqlite_node.client() as client:
        reply = client.request("Query", query=_call(name, arity, kind))
    # Never run: refused by the authorizer if SQLite has it, else unknown
    # (or not even a function name, such as a keyword).
    assert reply.status == "402 Bad query", (name, reply)
    if known:
        assert "not authorized" in reply.headers["error"], (name, reply)


def test_every_listed_function_this_sqlite_has_is_accepted(sqlite_node: ThreadServer) -> None:
    functions = _functions_of_this_sqlite()
    listed = sorted(QUERY_FUNCTIONS & set(functions))
    # The core, date, JSON and math functions are all there.
    assert {"abs", "count", "datetime", "json_extract", "sqrt", "row_number"} <= set(listed)
    with sqlite_node.client() as client:
        for name in listed:
            arity, kind = functions[name]
            reply = client.request("Query", query=_call(name, arity, kind))
            # A call may fail on its arguments ('1' is not a JSON path), never
            # on the authorizer.
            assert "not authorized" not in reply.headers.get("error", ""), (name, reply)


# Finding 6, Query's part: a byte bound on its reply.


def test_a_query_reply_past_the_byte_bound_is_refused(tmp_path: Path) -> None:
    node = ThreadServer(tmp_path / "jobs.db", max_reply_bytes=SMALLEST_BOUND)
    try:
        refused = f"413 Query reply larger than {SMALLEST_BOUND} bytes"
        assert _status_of(node.port, HUGE_QUERY) == refused
        assert _status_of(node.port, HUGE_QUERY, format="json") == refused
        with node.client(timeout=30) as client:
            # Three rows of 1 MB fit, in either format.
            fits = HUGE_QUERY.replace("x < 300", "x < 3")
            assert len(ok(client.request("Query", query=fits)).body) > 3_000_000
            assert len(ok(client.request("Query", query=fits, format="json")).json["rows"]) == 3
    finally:
        node.stop()


def _status_of(port: int, sql: str, **params: str) -> str:
    """The status line of a Query's reply, read without its body (a reply
    of hundreds of megabytes would take the test minutes to read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(encode("Query", {"query": sql, **params}))
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return head.split(b"\r\n", 1)[0].decode()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_eight_huge_queries_at_once_keep_memory_bounded(start_server) -> None:
    server: ServerProcess = start_server()
    assert server.port is not None
    pid = server.proc.pid
    with server.client() as client:
        create(client, "kept")
    before = _rss_bytes(pid)
    peak = before
    replies: list[str] = []

    def huge_query() -> None:
        assert server.port is not None
        replies.append(_status_of(server.port, HUGE_QUERY))

    threads = [threading.Thread(target=huge_query, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    slowest_ping = 0.0
    deadline = time.monotonic() + 60
    with server.client() as neighbour:
        while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
            peak = max(peak, _rss_bytes(pid))
            started = time.monotonic()
            assert neighbour.request("Ping").status == "200 OK"
            slowest_ping = max(slowest_ping, time.monotonic() - started)
            time.sleep(0.02)
    assert replies == ["413 Query reply larger than 33554432 bytes"] * 8
    # Each would be 300 MB, and 8 of them 2.4 GB; bounded, they stay well
    # under a gigabyte together (4 run at once, each under 2 x 32 MiB).
    assert peak - before < 1024**3, (before, peak)
    assert slowest_ping < 2.0
