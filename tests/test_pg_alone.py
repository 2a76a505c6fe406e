"""A node alone on its database sends no notices, and one with company does
(storage/postgres_alone.py; docs/nodes.md): any other session makes it
send them again, within a look, and a node that joins hears of what ends
elsewhere. Over real nodes on a database of the test's own (the other
tests' databases keep a session of the test process open, which is
company)."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.storage.postgres_alone import LOOK_SECONDS, SETTLE_SECONDS
from wire import Client, encode

pytestmark = pytest.mark.backends(only="postgres")

# Generous: a shared machine.
PATIENCE = 20.0


@pytest.fixture
def own_database() -> Iterator[str]:
    """The URL of a database made for the test, with no session open on it."""
    server = os.environ["JOBSERVER_TEST_POSTGRES"]
    name = f"jobserver_alone_{secrets.token_hex(4)}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield urlunsplit(urlsplit(server)._replace(path=f"/{name}"))
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def tells(server: ThreadServer) -> bool:
    """Whether the node's next commit would send its notice."""
    store = server.server.store
    assert store is not None
    return bool(store._company.must_tell(time.monotonic()))  # type: ignore[attr-defined]


def creating_until(client: Client, done: Any, what: str) -> None:
    """CreateJobs (each a transaction, whose BEGIN may look) until `done()`."""

    def step() -> bool:
        create(client, "step")
        return bool(done())

    until(step, PATIENCE, what)


def test_a_node_alone_sends_no_notice_until_another_session_comes(own_database: str) -> None:
    server = ThreadServer(own_database)
    try:
        with server.client(PATIENCE) as client:
            creating_until(client, lambda: not tells(server), "the node to find itself alone")
            with psycopg.connect(own_database, autocommit=True) as listener:
                listener.execute('LISTEN "jobserver.public"')
                # At its next look (within LOOK_SECONDS), a commit that makes
                # a job due tells this session.
                heard: list[psycopg.Notify] = []

                def told() -> bool:
                    create(client, "told")
                    heard.extend(listener.notifies(timeout=0.1, stop_after=1))
                    return bool(heard)

                until(told, PATIENCE, "a notice once another session is on the database")
                assert json.loads(heard[0].payload)["ready"] == ["told"]
            # Alone again once it has gone.
            creating_until(client, lambda: not tells(server), "the node to be alone again")
    finally:
        server.stop()


def test_a_node_that_joins_hears_of_an_awaited_job_another_node_ended(own_database: str) -> None:
    # Node A was alone; B joins. Once past B's own second look at everything
    # (SETTLE_SECONDS), only A's notice can wake B's AwaitJob, which would
    # otherwise wait for its whole timeout.
    a = ThreadServer(own_database)
    try:
        with a.client(PATIENCE) as client:
            creating_until(client, lambda: not tells(a), "node A to find itself alone")
            job = create(client, "awaited")
            assert ok(client.request("GetJob", name="awaited")).json["jobID"] == job
            b = ThreadServer(own_database)
            joined = time.monotonic()
            try:
                creating_until(client, lambda: tells(a), "node A to see node B")
                until(
                    lambda: time.monotonic() > joined + SETTLE_SECONDS + LOOK_SECONDS,
                    PATIENCE, "node B's listener to settle",
                )
                with Client(b.port, PATIENCE) as awaiter:
                    awaiter.send(encode("AwaitJob", {"jobID": job, "timeout": 60_000}))
                    until(
                        lambda: awaited(own_database, job), PATIENCE, "the AwaitJob to wait"
                    )
                    ok(client.request("FinishJob", jobID=job))
                    reply = ok(awaiter.read_reply())
                assert reply.json["state"] == "FINISHED"
            finally:
                b.stop()
    finally:
        a.stop()


def awaited(url: str, job: int) -> bool:
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute("SELECT awaited FROM jobs WHERE jobID = %s", (job,)).fetchone()
    return bool(row and row[0])
