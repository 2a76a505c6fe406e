"""A CreateJobs' new jobs sent to PostgreSQL as they are made, in a COPY
left open (storage/postgres_statements.py, STREAM_AFTER): a request refused
once rows of its are on their way spoils the transaction, and the writer
must run its batch again with a savepoint a request, so that the requests
beside it are done and it alone is refused. A real node on PostgreSQL."""

from __future__ import annotations

from typing import Any

import pg
import psycopg
import pytest
from test_pg_writers import HELD, _queued_requests, clients, row_locked, waiting_on_lock

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.storage.postgres_statements import STREAM_AFTER
from wire import encode

pytestmark = pytest.mark.backends(only="postgres")

# Plain elements enough for a COPY of their own, and several sends of it.
MANY = 5 * STREAM_AFTER


def plain(prefix: str, count: int = MANY) -> list[dict[str, Any]]:
    return [{"name": f"{prefix}{i}", "data": {"i": i}} for i in range(count)]


def test_a_request_refused_after_its_rows_were_sent_alone_is_undone(db):
    # Three requests in one batch (the writer held behind a row lock while
    # they queue): the last one's elements are plain until its last, which
    # only the database can refuse (its parent is not there), once hundreds
    # of rows are on their way.
    server = ThreadServer(db, writers=1)
    try:
        with clients(server, 5) as (client, blocked, first, middle, last):
            held = create(client, "held")
            with row_locked(str(db), held):
                blocked.send(encode("QueryJob", {"jobID": held}))
                waiting_on_lock(server, str(db), 1)
                first.send(encode("CreateJobs", {"jobs": plain("first")}))
                middle.send(encode("CreateJob", {"name": "middle"}))
                # Last: no statement of a request after it meets the spoiled
                # transaction, only the batch's COMMIT.
                missing = {"name": "late", "parentJobID": 999_999}
                last.send(encode("CreateJobs", {"jobs": [*plain("last"), missing]}))
                engine = server.server.core.engine
                until(lambda: _queued_requests(engine) == 3, HELD, "the three requests queued")
            ok(blocked.read_reply())
            assert len(ok(first.read_reply()).json["jobIDs"]) == MANY
            ok(middle.read_reply())
            assert last.read_reply().status == "404 parentJobID does not exist"
        with psycopg.connect(str(db)) as session:
            counts = session.execute("SELECT substr(name, 1, 5), count(*) FROM jobs GROUP BY 1")
            assert dict(counts.fetchall()) == {"first": MANY, "held": 1, "middl": 1}
    finally:
        server.stop()


def test_a_request_refused_for_what_it_says_sends_nothing(db):
    # Every element is checked before any job is stored (create._checked):
    # a refusal the request itself gives reasons for comes before any row
    # is on its way, so the table does not grow by the rows of jobs undone.
    server = ThreadServer(db)
    padded = [{"name": f"p{i}", "data": {"pad": "x" * 300}} for i in range(MANY)]
    try:
        with server.client(timeout=HELD) as client, psycopg.connect(str(db)) as session:
            before = _size(session)
            for bad in ({"name": "late", "priority": 7}, {"nme": "x"}, {"name": "a\x01b"}):
                reply = client.request("CreateJobs", jobs=[*padded, bad])
                assert reply.status.startswith("402 "), reply.status
            assert _size(session) == before
    finally:
        server.stop()


def _size(session: psycopg.Connection[Any]) -> int:
    (size,) = session.execute("SELECT pg_relation_size('jobs')").fetchone() or (0,)
    session.rollback()
    return int(size)


@pytest.mark.parametrize("before", [1, MANY], ids=["held", "streamed"])
def test_a_name_the_database_cannot_store_is_a_502_of_its_request_alone(before):
    # A LATIN1 database: a name outside it fails as PostgreSQL converts the
    # COPY's row from the node's UTF8, a database error of that request.
    with pg.database_in("LATIN1") as latin1:
        server = ThreadServer(latin1)
        try:
            with server.client(timeout=HELD) as client:
                reply = client.request("CreateJobs", jobs=[*plain("ok", before), {"name": "名"}])
                assert reply.status.startswith("502 Query failed: "), reply.status
                assert "LATIN1" in reply.status, reply.status
                jobs = ok(client.request("CreateJobs", jobs=plain("after", 3))).json["jobIDs"]
                assert len(jobs) == 3
            with psycopg.connect(latin1) as session:
                assert session.execute("SELECT count(*) FROM jobs").fetchone() == (3,)
        finally:
            server.stop()
