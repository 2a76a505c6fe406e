"""A CreateJobs' new jobs sent to PostgreSQL as they are made, in a COPY
left open (storage/postgres_statements.py, STREAM_AFTER): a request refused
once rows of its are on their way spoils the transaction, and the writer
must run its batch again with a savepoint a request, so that the requests
beside it are done and it alone is refused. A real node on PostgreSQL."""

from __future__ import annotations

from typing import Any

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


@pytest.mark.parametrize(
    "refused",
    [{"name": "late", "priority": 7}, {"name": "late", "repeat": "NOT A RULE"}, {"nme": "x"}],
    ids=["priority", "repeat", "no-name"],
)
def test_a_request_refused_after_its_rows_were_sent_alone_is_undone(db, refused):
    # Three requests in one batch (the writer held behind a row lock while
    # they queue): the last one's elements are plain until its last, which
    # the long way refuses once hundreds of rows are on their way.
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
                last.send(encode("CreateJobs", {"jobs": [*plain("last"), refused]}))
                engine = server.server.core.engine
                until(lambda: _queued_requests(engine) == 3, HELD, "the three requests queued")
            ok(blocked.read_reply())
            assert len(ok(first.read_reply()).json["jobIDs"]) == MANY
            ok(middle.read_reply())
            assert last.read_reply().status.startswith("402 ")
        with psycopg.connect(str(db)) as session:
            counts = session.execute("SELECT substr(name, 1, 5), count(*) FROM jobs GROUP BY 1")
            assert dict(counts.fetchall()) == {"first": MANY, "held": 1, "middl": 1}
    finally:
        server.stop()
