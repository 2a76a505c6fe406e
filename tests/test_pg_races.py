"""Two nodes' transactions interleaved where they meet a row lock, over two
real nodes on real PostgreSQL: each request ends as if the other had come
first. A session of the test's own holds the lock a unique job's name takes,
so that one node's transaction stays open, its locks held, at a known point.

A child created on one node while another node's finish of its parent waits
for the parent's row (protocol.md 8, parent and child jobs; docs/nodes.md):
the finish sees the child, whichever way it takes. Node B's CreateJob of a
unique child locks the parent, then waits for its name's lock; node A's
finish of the parent then waits for the parent's row. Released, B commits
the child first and A's finish goes on. A statement sees what its
snapshot, taken before a lock wait, saw: a finish that looked for children
in the statement that waited missed this one, deleted the parent and left
the child PAUSED for good.

A dependent added on one node to a job whose kept outcome another node is
forgetting (protocol.md 14.25): the outcome stays while an edge names it.

A unique CreateJob that waits for the oldest job of its name, which another
transaction ends while making a newer one: it finds the newer one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from test_pg_writers import HELD, waiting_on_lock

from harness import ThreadServer
from helpers import create, ok
from jobserver.storage import postgres_schema
from wire import Client, encode

pytestmark = pytest.mark.backends(only="postgres")


@pytest.fixture
def nodes(db: str) -> Iterator[tuple[ThreadServer, ThreadServer]]:
    a, b = ThreadServer(db), ThreadServer(db)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def name_locked(url: str, name: str) -> psycopg.Connection[Any]:
    """A session holding the lock a unique job named `name` takes."""
    session = psycopg.connect(url)
    slot = postgres_schema.lock_slot("name", name)
    session.execute("SELECT slot FROM jobserver_locks WHERE slot = %s FOR UPDATE", (slot,))
    return session


def finish(way: str, parent: int) -> bytes:
    """A finish of the parent: alone, or as a FinishJobs' element, plain (one
    statement for its plain runs) or with data (read the long way, `hold`)."""
    if way == "FinishJob":
        return encode(way, {"jobID": parent})
    element: dict[str, object] = {"jobID": parent}
    if way == "FinishJobs, with data":
        element["data"] = {"done": True}
    return encode("FinishJobs", {"jobs": json.dumps([element])})


def state(client: Client, job_id: int) -> str:
    return str(ok(client.request("QueryJob", jobID=job_id)).json["state"])


@pytest.mark.parametrize("way", ["FinishJob", "FinishJobs", "FinishJobs, with data"])
def test_a_finish_of_a_parent_sees_a_child_created_while_it_waited(
    db: str, nodes: tuple[ThreadServer, ThreadServer], way: str
) -> None:
    a, b = nodes
    with a.client(HELD) as client, Client(b.port, HELD) as creator:
        parent = create(client, "parent")
        assert ok(client.request("GetJob", name="parent")).json["jobID"] == parent
        session = name_locked(db, "kid")
        try:
            creator.send(
                encode("CreateJob", {"name": "kid", "parentJobID": parent, "unique": "true"})
            )
            waiting_on_lock(b, db, 1)
            client.send(finish(way, parent))
            waiting_on_lock(a, db, 1)
        finally:
            session.rollback()
            session.close()
        child = ok(creator.read_reply()).json["jobID"]
        ok(client.read_reply())
        raced = (state(client, parent), state(client, child))
        # The same with the child's CreateJob first, on one node.
        first = create(client, "first")
        assert ok(client.request("GetJob", name="first")).json["jobID"] == first
        first_child = create(client, "kid", parentJobID=first)
        client.send(finish(way, first))
        ok(client.read_reply())
        assert raced == (state(client, first), state(client, first_child))
        assert raced == ("PAUSED", "QUEUED")


def test_an_outcome_a_new_dependent_read_is_kept_for_it(
    db: str, nodes: tuple[ThreadServer, ThreadServer]
) -> None:
    # X ended with a dependent, Y, so its outcome is kept; W has not ended.
    # Node B's CreateJobs of Z (dependsOn X and W: X counted as ended) waits
    # for its second element's name; node A's DeleteJob of Y, X's last
    # dependent, then forgets X's outcome unless an edge still names it.
    # Read without a lock, A deleted it under B's uncommitted edge, and Z
    # waited for X for good once W finished.
    a, b = nodes
    with a.client(HELD) as client, Client(b.port, HELD) as creator:
        x = create(client, "x")
        y = create(client, "y", dependsOn=json.dumps([x]))
        w = create(client, "w")
        assert ok(client.request("GetJob", name="x")).json["jobID"] == x
        ok(client.request("FinishJob", jobID=x))
        session = name_locked(db, "kid")
        try:
            jobs = [{"name": "z", "dependsOn": [x, w]}, {"name": "kid", "unique": True}]
            creator.send(encode("CreateJobs", {"jobs": json.dumps(jobs)}))
            waiting_on_lock(b, db, 1)
            client.send(encode("DeleteJob", {"jobID": y}))
            waiting_on_lock(a, db, 1)
        finally:
            session.rollback()
            session.close()
        z = ok(creator.read_reply()).json["jobIDs"][0]
        ok(client.read_reply())
        assert state(client, z) == "BLOCKED"
        assert ok(client.request("GetJob", name="w")).json["jobID"] == w
        ok(client.request("FinishJob", jobID=w))
        assert state(client, z) == "QUEUED"


def test_a_unique_job_merges_into_the_one_another_transaction_left(
    db: str, nodes: tuple[ThreadServer, ThreadServer]
) -> None:
    # An application's transaction deletes the oldest job named "n" (so holds
    # its row) and creates another (jobserver_create_job, which takes no name
    # lock); a unique CreateJob of "n" waits for the row. As if it had come
    # after: it finds the new job, not nothing (a second "n" beside it).
    a, _ = nodes
    with a.client(HELD) as client:
        oldest = create(client, "n")
        with psycopg.connect(db) as session:
            session.execute("DELETE FROM jobs WHERE jobID = %s", (oldest,))
            row = session.execute("SELECT jobserver_create_job('n')").fetchone()
            assert row is not None
            newer = int(row[0])
            client.send(encode("CreateJob", {"name": "n", "unique": "true"}))
            waiting_on_lock(a, db, 1)
        assert ok(client.read_reply()).json["jobID"] == newer
        with psycopg.connect(db) as reader:
            named = reader.execute("SELECT jobID FROM jobs WHERE name = 'n'").fetchall()
        assert named == [(newer,)]
