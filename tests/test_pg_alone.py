"""A node alone on its database sends no notices, and one with company does
(storage/postgres_alone.py; docs/nodes.md): any other session, of any role,
makes it send them again within a look, and a node that joins hears of what
ends elsewhere, even from a node that has not seen it yet. Over real nodes
on a database of the test's own (the other tests' databases keep a session
of the test process open, which is company)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pg
import psycopg
import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.storage import postgres_alone, postgres_listen, postgres_query
from jobserver.storage.postgres_alone import Company
from wire import Client, encode

pytestmark = pytest.mark.backends(only="postgres")

# Generous: a shared machine.
PATIENCE = 20.0
SERVER = pg.BASE_URL


def url_of(database: str, user: str = "") -> str:
    parts = urlsplit(SERVER)
    netloc = parts.netloc if not user else f"{user}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc, path=f"/{database}"))


@pytest.fixture
def own_database() -> Iterator[str]:
    """The name of a database made for the test, with no session open on
    it, and of a login role made with it that owns it."""
    pg.database_url()  # skips, or fails in CI, where PostgreSQL does not answer
    name = f"jobserver_alone_{secrets.token_hex(4)}"
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{name}" LOGIN')
        admin.execute(f'CREATE DATABASE "{name}" OWNER "{name}"')
        try:
            yield name
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            admin.execute(f'DROP ROLE "{name}"')
            # The Query role the node made (roles are the whole server's).
            query_role = postgres_query.role_name(name, "public")
            admin.execute(f'DROP ROLE IF EXISTS "{query_role}"')


def company(server: ThreadServer) -> Company:
    store = server.server.store
    assert store is not None
    return store._company  # type: ignore[attr-defined, no-any-return]


def alone(server: ThreadServer) -> bool:
    """Whether the node's next commit would send no notice."""
    return not company(server).must_tell(time.monotonic())


def creating_until(client: Client, done: Callable[[], bool], what: str) -> None:
    """CreateJobs (each a transaction, whose BEGIN may look) until `done()`."""

    def step() -> bool:
        create(client, "step")
        return done()

    until(step, PATIENCE, what)


@pytest.mark.parametrize("node_role", ["the listener's", "one that cannot see its kind"])
def test_a_node_alone_sends_no_notice_until_another_session_comes(
    own_database: str, node_role: str
) -> None:
    # The node as the database's owner, a role that may only log in, sees a
    # superuser's session without its kind (NULL): it counts all the same.
    owner = own_database if node_role != "the listener's" else ""
    server = ThreadServer(url_of(own_database, owner))
    try:
        with server.client(PATIENCE) as client:
            creating_until(client, lambda: alone(server), "the node to find itself alone")
            sent = company(server).notices
            # A create after which the node is still alone sent no notice.
            # Until ten have: a background process, as autovacuum's, or the
            # node's own short reads (the depth's every 15 s) count as
            # company while they last, and a look that saw one decides a
            # second of creates (a CI run's twenty, on a loaded machine).
            unheard = 0

            def unheard_create() -> bool:
                nonlocal unheard
                before = company(server).notices
                create(client, "unheard")
                if alone(server):
                    assert company(server).notices == before
                    unheard += 1
                return unheard >= 10

            until(unheard_create, PATIENCE, "ten creates that found the node alone")
            with psycopg.connect(url_of(own_database), autocommit=True) as listener:
                listener.execute('LISTEN "jobserver.public"')
                heard: list[psycopg.Notify] = []

                def told() -> bool:
                    create(client, "told")
                    heard.extend(listener.notifies(timeout=0.1, stop_after=1))
                    return bool(heard)

                until(told, PATIENCE, "a notice once another session is on the database")
                assert json.loads(heard[0].payload)["ready"] == ["told"]
                assert company(server).notices > sent
            creating_until(client, lambda: alone(server), "the node to be alone again")
    finally:
        server.stop()


def test_a_node_whose_connections_were_ended_is_alone_again_on_new_ones(
    own_database: str,
) -> None:
    # Its new writer and listener connections are its own, not company.
    server = ThreadServer(url_of(own_database))
    try:
        with server.client(PATIENCE) as client:
            creating_until(client, lambda: alone(server), "the node to find itself alone")
            with psycopg.connect(SERVER, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (own_database,),
                )
            ended = time.monotonic()

            def alone_after_a_create() -> bool:
                # The first batch after the end may be refused (503).
                client.request("CreateJob", name="again")
                looked_at = company(server)._last[1]
                return looked_at > ended and alone(server)

            until(alone_after_a_create, PATIENCE, "the node to be alone on new connections")
    finally:
        server.stop()


def test_a_node_that_joins_hears_of_what_a_node_that_has_not_seen_it_ended(
    own_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Node A looked, found itself alone, and will not look again for a long
    # while; B joins and awaits a job, which A then finishes without a
    # notice. Only B's second look at everything (SETTLE_SECONDS after its
    # listener started) can wake the AwaitJob, which would otherwise wait
    # for its whole timeout.
    monkeypatch.setattr(postgres_listen, "SETTLE_SECONDS", 5.0)
    url = url_of(own_database)
    a = ThreadServer(url)
    try:
        with a.client(PATIENCE) as client:
            creating_until(client, lambda: alone(a), "node A to find itself alone")
            # A's look, fresh, now holds for ten minutes.
            monkeypatch.setattr(postgres_alone, "LOOK_SECONDS", 600.0)
            job = create(client, "awaited")
            assert ok(client.request("GetJob", name="awaited")).json["jobID"] == job
            sent = company(a).notices
            b = ThreadServer(url)
            try:
                # B's listener listens (and its first look at everything is
                # over) before the job ends.
                until(lambda: listening(url) == 2, PATIENCE, "both nodes to listen")
                with Client(b.port, PATIENCE) as awaiter:
                    awaiter.send(encode("AwaitJob", {"jobID": job, "timeout": 60_000}))
                    until(lambda: awaited(url, job), PATIENCE, "the AwaitJob to wait")
                    ok(client.request("FinishJob", jobID=job))
                    assert company(a).notices == sent, "A told B: the window was not tested"
                    reply = ok(awaiter.read_reply())
                assert reply.json["state"] == "FINISHED"
            finally:
                b.stop()
    finally:
        a.stop()


def listening(url: str) -> int:
    """How many sessions listen on the channel."""
    return int(
        pg.value(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            """AND query = 'LISTEN "jobserver.public"'""",
        )
    )


def awaited(url: str, job: int) -> bool:
    return bool(pg.value(url, "SELECT awaited FROM jobs WHERE jobID = %s", (job,)))
