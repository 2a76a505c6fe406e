"""PostgreSQL neighbours: other roles of the queue's database, against
the nodes. (Query's own boundary is tests/test_security_query.py; notices
between nodes are tests/test_security_notices.py.)"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import pg
import psycopg
import pytest

WARNING = "create objects in it"


@pytest.fixture
def queue() -> Iterator[str]:
    with pg.fresh_schema() as url:
        yield url


def schema_of(url: str) -> str:
    options = unquote(parse_qs(urlsplit(url).query)["options"][0])
    return options.removeprefix("-csearch_path=")


def test_a_schema_others_may_create_in_is_warned_of(queue: str, start_server) -> None:
    quiet = start_server(queue)
    assert quiet.started, quiet.log
    assert WARNING not in quiet.log
    quiet.kill()
    with psycopg.connect(pg.database_url(), autocommit=True) as db:
        db.execute(f"GRANT CREATE ON SCHEMA {schema_of(queue)} TO PUBLIC".encode())
    warned = start_server(queue)
    assert warned.started, warned.log
    assert f"lets PUBLIC {WARNING}" in warned.log
    with warned.client() as client:
        assert client.request("Ping").status == "200 OK"


# Locks. Any role that can connect may take any advisory lock, so the nodes
# lock rows of a table of their own instead (jobserver_locks).


@pytest.fixture
def neighbour(queue: str) -> Iterator[psycopg.Connection]:
    """A session of another role of the database: it may connect, nothing more."""
    role = f"neighbour_{schema_of(queue)}"
    with psycopg.connect(pg.database_url(), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN".encode())
    try:
        with psycopg.connect(pg.database_url(), user=role, autocommit=True) as db:
            yield db
    finally:
        with psycopg.connect(pg.database_url(), autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}".encode())
            admin.execute(f"DROP ROLE {role}".encode())


def test_a_neighbour_cannot_lock_what_the_nodes_lock(
    queue: str, start_server, neighbour: psycopg.Connection
) -> None:
    node = start_server(queue)
    assert node.started, node.log
    # An application that shares the schema, as one that enqueues may.
    with psycopg.connect(pg.database_url(), autocommit=True) as admin:
        user = neighbour.info.user
        admin.execute(f"GRANT USAGE ON SCHEMA {schema_of(queue)} TO {user}".encode())
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        neighbour.execute(
            f"SELECT slot FROM {schema_of(queue)}.jobserver_locks FOR UPDATE".encode()
        )


def test_advisory_locks_held_by_a_neighbour_hold_up_no_node(
    queue: str, start_server, neighbour: psycopg.Connection
) -> None:
    """Every key the nodes once locked, held by another role's session:
    limits, reply keys, unique names and the pruner's go on."""
    node = start_server(queue, "--keep-finished", "1s")
    schema = schema_of(queue)
    keys = [f"{schema}:limit:send/*", f"{schema}:reply:order-1", f"{schema}:name:only-one",
            f"{schema}:prune"]
    neighbour.execute("BEGIN")
    for key in keys:
        neighbour.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (0x4A0B5E7, key))
    try:
        with node.client(timeout=10) as client:
            assert client.request("SetLimit", name="send/*", max=1).status == "200 OK"
            assert client.request("CreateJob", name="send/mail").status == "200 OK"
            assert client.request("GetJob", name="send/mail").status == "200 OK"
            made = client.request("CreateJob", name="only-one", unique="true")
            assert made.status == "200 OK"
            waiting = client.request("CreateJob", name="awaits").json["jobID"]
            assert client.request("GetJob", name="awaits").status == "200 OK"
            awaited = client.request("AwaitReply", jobID=waiting, key="order-1")
            assert awaited.status == "200 OK", awaited.status
            delivered = client.request("DeliverReply", key="order-1", data={"ok": True})
            assert delivered.status == "200 OK", delivered.status
    finally:
        neighbour.execute("ROLLBACK")


def test_a_migration_lock_held_for_good_is_named_not_waited_for(
    queue: str, neighbour: psycopg.Connection, tmp_path, monkeypatch
) -> None:
    from harness import ThreadServer
    from jobserver.storage import postgres_schema

    monkeypatch.setattr(postgres_schema, "MIGRATION_WAIT_SECONDS", 0.5)
    key = neighbour.execute(
        "SELECT hashtext('migrate:' || %s)", (schema_of(queue),)
    ).fetchone()
    assert key is not None
    neighbour.execute("SELECT pg_advisory_lock(%s, %s)", (0x4A0B5E7, key[0]))
    with pytest.raises(RuntimeError, match="migration lock") as refused:
        ThreadServer(queue)
    assert neighbour.info.user in str(refused.value)


def test_a_database_error_on_several_lines_is_one_status_line(queue: str, start_server) -> None:
    """PostgreSQL's errors carry a DETAIL on a line of its own: in a status
    line it became headers of the reply on the wire, and a 500 over HTTP."""
    node = start_server(queue, "--http-port", "0")
    with node.client() as client:
        first = client.request("CreateJob", name="first").json["jobID"]
        # The next jobIDs taken behind the nodes' back.
        for job_id in range(first + 1, first + 21):
            pg.execute(queue, "INSERT INTO jobs (jobID, name, state, nextRun, created) "
                       "VALUES (%s, 'planted', 'QUEUED', '2026-01-01 00:00:00', "
                       "'2026-01-01 00:00:00')", (job_id,))
        collided = client.request("CreateJob", name="collides")
        assert collided.code == 502 and "DETAIL" in collided.status, collided.status
        assert not any("DETAIL" in name or "DETAIL" in value
                       for name, value in collided.headers.items()), collided.headers
        assert client.request("Ping").status == "200 OK"
    found = node.matching(HTTP_PORT, 1, 10)
    assert found, node.log
    match = HTTP_PORT.search(found[0])
    assert match is not None
    code, status = _api_create(int(match.group(1)))
    assert code == 500 and status.startswith("502 "), (code, status)
    assert "DETAIL" in status and "\n" not in status, status


HTTP_PORT = re.compile(r"HTTP on \S+:(\d+)")


def _api_create(port: int) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/CreateJob", data=b'{"name": "collides"}',
        method="POST", headers={"Content-Type": "application/json"},
    )
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(request, timeout=10) as reply:
            return int(reply.status), reply.headers.get("Jobserver-Status", "")
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Jobserver-Status", "")


def test_enqueueing_needs_execute_on_the_function_and_no_right_on_the_tables(
    queue: str, start_server, neighbour: psycopg.Connection
) -> None:
    """jobserver_create_job runs with the nodes' rights: an application is
    given EXECUTE on it, and cannot write rows the nodes did not check."""
    node = start_server(queue)
    assert node.started, node.log
    schema = schema_of(queue)
    function = f"{schema}.jobserver_create_job(TEXT, TEXT, INTEGER, TIMESTAMPTZ)"
    with psycopg.connect(pg.database_url(), autocommit=True) as admin:
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {neighbour.info.user}".encode())
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        neighbour.execute(f"SELECT {schema}.jobserver_create_job('not-granted')".encode())
    with psycopg.connect(pg.database_url(), autocommit=True) as admin:
        admin.execute(f"GRANT EXECUTE ON FUNCTION {function} TO {neighbour.info.user}".encode())
    row = neighbour.execute(
        f"SELECT {schema}.jobserver_create_job('from-the-app', '{{}}')".encode()
    ).fetchone()
    assert row is not None
    with node.client() as client:
        assert client.request("QueryJob", jobID=row[0]).json["name"] == "from-the-app"
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        neighbour.execute(
            f"INSERT INTO {schema}.jobs (name, state, nextRun, created) "
            "VALUES ('planted', 'QUEUED', '0000', '0000')".encode()
        )
