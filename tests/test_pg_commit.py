"""A reply follows what PostgreSQL did, exactly, when the connection to it
fails in the middle of a batch (protocol.md 10 and 11).

A node's connection is cut by a relay (relay.py) at the COMMIT: after
PostgreSQL has it (it commits; the node never hears so) or before (it
never commits). Or the node's backend is terminated while a waiting
GetJob is served in the batch's own transaction. Each time the reply must
say what the database holds: `200` only for what committed, a 5xx other
than `504` only for what did not, `504 Outcome unknown` when the node
could not find out; and a job handed out in a batch of unknown outcome
comes back to the queue.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pg
import psycopg
import pytest
import trio

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.core.engine.engine import Engine
from jobserver.model.limits import Limit
from jobserver.storage import postgres, postgres_connection, postgres_listen
from relay import Relay
from wire import Client, encode

DEADLINE = 20.0
# The next COMMIT is cut: now and then the clock's tick sends one first.
CUT_TRIES = 5


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


@pytest.fixture
def proxy(url: str) -> Iterator[Relay]:
    relay = Relay.to(url)
    yield relay
    relay.close()


@pytest.fixture
def node(url: str, proxy: Relay) -> Iterator[ThreadServer]:
    # One writer: the relay cuts the first COMMIT it sees on any of the
    # node's connections, and with two the clock's tick could commit on one
    # and be cut while the request under test committed on the other.
    running = ThreadServer(proxy.url(url), writers=1)
    yield running
    running.stop()


def jobs(url: str) -> dict[int, tuple[str, str]]:
    """Every job in the queue's table: (name, state) by jobID."""
    with psycopg.connect(url, autocommit=True) as db:
        rows = db.execute("SELECT jobID, name, state FROM jobs").fetchall()
    return {int(job_id): (str(name), str(state)) for job_id, name, state in rows}


def waiting(node: ThreadServer, name: str, timeout_ms: int = 30_000) -> Client:
    """A connection whose GetJob waits on the node."""
    before = len(node.server.core.engine.waits)
    client = node.client(timeout=timeout_ms / 1000 + 10)
    client.send(encode("GetJob", {"name": name, "Connection": "wait", "timeout": timeout_ms}))
    until(lambda: len(node.server.core.engine.waits) > before, DEADLINE, "the GetJob to wait")
    # Its first try is queued in the writer: a request sent now is
    # answered after that try's transaction, so no cut a test arms next
    # can fall on it.
    with node.client(timeout=DEADLINE) as other:
        assert other.request("QueryJob", jobID=1).status in ("200 OK", "404 No job with this jobID")
    return client


async def _no_clock(engine: Engine) -> None:
    """An engine's clock that never rings."""
    await trio.sleep_forever()


def reachable(client: Client) -> bool:
    """Whether the node answers a request that reads PostgreSQL."""
    status = client.request("QueryJob", jobID=1).status
    return status in ("200 OK", "404 No job with this jobID")


def test_a_commit_whose_reply_is_lost_is_answered_200_when_postgres_committed(
    node, url, proxy
):
    with node.client(timeout=DEADLINE) as client:
        proxy.cut_at_commit(reaches=True)
        reply = client.request("CreateJobs", jobs=[{"name": "kept"}, {"name": "kept"}])
        assert proxy.was_cut.is_set()
        assert reply.status == "200 OK", reply
        assert set(reply.json["jobIDs"]) == set(jobs(url))
        # The node works on, on the connection it asked on.
        create(client, "after")
    assert sorted(name for name, _ in jobs(url).values()) == ["after", "kept", "kept"]


def test_a_commit_that_never_reached_postgres_is_a_503_and_wrote_nothing(node, url, proxy):
    with node.client(timeout=DEADLINE) as client:
        for _ in range(CUT_TRIES):
            job_id = create(client, "running")
            ok(client.request("GetJob", name="running"))
            proxy.cut_at_commit(reaches=False)
            reply = client.request("FinishJob", jobID=job_id)
            assert proxy.was_cut.is_set()
            if reply.status.startswith("503 "):
                break
            # The clock's tick committed first and was the one cut (seen
            # once under load): the finish went through; again.
            ok(reply)
        assert reply.status.startswith("503 "), reply
        # Not done: the job still runs, and the resend finishes it.
        assert jobs(url) == {job_id: ("running", "RUNNING")}
        ok(client.request("FinishJob", jobID=job_id))
    assert jobs(url) == {}


def test_a_finish_whose_reply_is_lost_is_answered_200_and_not_done_twice(node, url, proxy):
    with node.client(timeout=DEADLINE) as client:
        job_ids = [create(client, "work") for _ in range(3)]
        taken = ok(client.request("GetJobs", name="work", numResults=3)).json["jobs"]
        proxy.cut_at_commit(reaches=True)
        reply = client.request("FinishJobs", jobs=[{"jobID": j["jobID"]} for j in taken])
        assert proxy.was_cut.is_set()
        assert ok(reply).json["results"] == [
            {"jobID": job_id, "status": "200 OK"} for job_id in job_ids
        ]
    assert jobs(url) == {}


def test_a_commit_whose_outcome_cannot_be_learned_is_a_504_and_its_hand_outs_come_back(
    node, url, proxy, monkeypatch
):
    # PostgreSQL stays out of reach for longer than the node asks.
    monkeypatch.setattr(postgres_connection, "OUTCOME_SECONDS", 1.0)
    with waiting(node, "served") as worker, node.client(timeout=DEADLINE) as client:
        for _ in range(CUT_TRIES):
            proxy.cut_at_commit(reaches=True, stay_cut=True)
            # The create and the waiting GetJob it wakes share one transaction.
            reply = client.request("CreateJob", name="served")
            if not reply.status.startswith("503 "):
                break
            # The clock's tick committed first and was the one cut (seen
            # in CI): the create then found PostgreSQL gone and wrote
            # nothing. Let the node back in and cut again.
            proxy.restore()
            until(lambda: reachable(client), DEADLINE, "the node to reach PostgreSQL again")
        assert reply.status.startswith("504 Outcome unknown: "), reply
        # It did commit, the job handed out to the waiter: yet the waiter
        # never heard of it, so once PostgreSQL is back the node gives the
        # job back, and the waiter (still waiting) gets it.
        proxy.restore()
        handed = ok(worker.read_reply()).json
    assert jobs(url) == {handed["jobID"]: ("served", "RUNNING")}


def test_a_connection_lost_while_a_waiter_is_served_fails_the_whole_batch(url, monkeypatch):
    """The waiters a batch wakes are served in its own transaction: a
    connection lost there takes the batch with it, and the node must not
    answer the batch from a transaction it opened again in its place."""
    # One writer, as `node`: with two, the clock's tick could wait for the
    # same lock on the other, and the backend ended below be the tick's.
    # And no look at every waiter (the listener's each second, and its
    # second look after connecting): one queued while the CreateJob's batch
    # ran made the waiter's try its own, so that batch served no waiter and
    # committed (200), and the backend ended was the next batch's, waiting
    # for the lock with the waiter's try (seen once in a clean-clone CI run).
    monkeypatch.setattr(postgres_listen, "FALLBACK_SECONDS", 3600.0)
    monkeypatch.setattr(postgres_listen, "SETTLE_SECONDS", 3600.0)
    # Nor the clock's: each time it rings it tries every waiter, in a batch
    # of its own (the same 200 was seen so in another clean-clone CI run).
    monkeypatch.setattr(Engine, "_run_clock", _no_clock)
    running = ThreadServer(url, limits={"held": Limit(10)}, writers=1)
    try:
        with waiting(running, "held") as worker, running.client(timeout=DEADLINE) as client:
            with psycopg.connect(url) as locker, psycopg.connect(url, autocommit=True) as admin:
                # The waiter's hand-out counts the limit's use under its
                # lock, which this transaction holds: the batch stops there.
                locker.execute("SELECT slot FROM jobserver_locks WHERE slot = 0 FOR UPDATE")
                client.send(encode("CreateJob", {"name": "held"}))
                # The backend this transaction blocks: other tests' nodes
                # share the database (a schema each) and wait for locks too.
                backend = until(
                    lambda: admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = 'jobserver' "
                        "AND %s = ANY(pg_blocking_pids(pid))",
                        (locker.info.backend_pid,),
                    ).fetchone(),
                    DEADLINE, "the node's batch to wait for the lock",
                )
                # Past the node's pause between reconnections.
                time.sleep(postgres.RECONNECT_SECONDS)
                admin.execute("SELECT pg_terminate_backend(%s)", (backend[0],))
                locker.rollback()
                reply = client.read_reply()
            assert reply.status.startswith("503 "), reply
            assert jobs(url) == {}
            # Sent again, it is done once, and the waiter gets it.
            job_id = create(client, "held")
            assert ok(worker.read_reply()).json["jobID"] == job_id
    finally:
        running.stop()


def test_once_one_writer_has_connected_again_the_others_try_at_once(url, proxy, monkeypatch):
    """A writer whose attempt to connect failed waits RECONNECT_SECONDS
    before the next, so that a PostgreSQL out of reach is not hammered;
    but once another of the node's connections is made, PostgreSQL is
    back. A writer that had failed just before the outage ended refused
    its next batch with 503 while the node answered 200 on another writer
    (a Status so refused in a clean clone's run of test_nodes)."""
    # Longer than the test: only another connection can end the wait.
    monkeypatch.setattr(postgres, "RECONNECT_SECONDS", 600.0)
    store = postgres.PostgresStore(proxy.url(url), writers=2)
    first, second = store.writers()
    try:
        for writer in (first, second):
            writer.begin()
            writer.commit()
        proxy.cut()
        with pytest.raises(psycopg.Error):
            second.begin()
        proxy.restore()
        # Nobody has connected since: the wait holds.
        with pytest.raises(psycopg.OperationalError, match="connection to PostgreSQL is lost"):
            second.begin()
        # The first writer, which tried nothing while PostgreSQL was away,
        # connects at once; the second then tries too.
        first.begin()
        first.commit()
        second.begin()
        second.commit()
    finally:
        store.close()


def test_a_transaction_spoiled_by_an_error_is_never_answered_as_committed(url):
    """PostgreSQL answers COMMIT of a transaction an error spoiled with
    ROLLBACK, not with an error: the store must not take it for a commit."""
    store = postgres.PostgresStore(url)
    try:
        store.begin()
        with pytest.raises(psycopg.Error):
            store._execute("SELECT 1/0")
        with pytest.raises(psycopg.Error, match="rolled back instead of committed"):
            store.commit()
    finally:
        store.close()


@pytest.mark.parametrize(
    "names",
    [
        {"plain", "queue/a b"},
        {"it's", "back\\slash", "$jobserver$", "a$", "$$", "$1", "'; COMMIT; --", "caf\u00e9"},
    ],
)
def test_the_notice_sent_with_the_commit_arrives_as_it_was_written(url, names):
    """A COMMIT and the notice to other nodes go as one query, the notice
    quoted in it: every name arrives as written, whatever quotes, dollars
    or backslashes it holds, and only if the transaction commits."""
    store = postgres.PostgresStore(url)
    listener = psycopg.connect(url, autocommit=True)
    try:
        listener.execute(f'LISTEN "{store.channel}"')
        store.begin()
        store.announce(names, "2030-01-01 00:00:00.000", {7})
        store.commit()
        heard = next(listener.notifies(timeout=DEADLINE))
        notice = json.loads(heard.payload)
        assert (set(notice["ready"]), notice["due"], notice["ended"]) == (
            names, "2030-01-01 00:00:00.000", [7]
        )
        store.begin()
        store.announce({"spoiled"}, None, set())
        with pytest.raises(psycopg.Error):
            store._execute("SELECT 1/0")
        with pytest.raises(psycopg.Error):
            store.commit()
        store.begin()
        store.announce({"after"}, None, set())
        store.commit()
        assert json.loads(next(listener.notifies(timeout=DEADLINE)).payload)["ready"] == ["after"]
    finally:
        listener.close()
        store.close()


def test_the_writer_thread_waits_for_the_answer_not_the_event_loop(node, proxy):
    """While the node asks what became of a COMMIT, Ping is answered."""
    answered: list[float] = []

    def ping_meanwhile() -> None:
        with node.client(timeout=DEADLINE) as pinger:
            while not proxy.was_cut.is_set():
                time.sleep(0.01)
            started = time.monotonic()
            ok(pinger.request("Ping"))
            answered.append(time.monotonic() - started)

    pinger = threading.Thread(target=ping_meanwhile)
    pinger.start()
    with node.client(timeout=DEADLINE) as client:
        proxy.cut_at_commit(reaches=True, stay_cut=True)
        client.send(encode("CreateJob", {"name": "x"}))
        pinger.join(DEADLINE)
        proxy.restore()
        assert client.read_reply().status in ("200 OK",), "the node found out after all"
    assert answered and answered[0] < 2.0, answered


def test_an_ask_whose_answer_never_comes_is_cut_off_at_its_time(url):
    """What a node asks after a COMMIT cut off is bounded on its own side:
    a statement whose answer does not come (here PostgreSQL sleeps; a path
    that drops requests does the same) fails at the deadline."""
    db = postgres_connection.connect(url)
    try:
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError), postgres_connection.cut_off_after(db, 0.5):
            db.execute("SELECT pg_sleep(20)")
        assert time.monotonic() - started < 5
    finally:
        db.close()
    # Once the block has ended, nothing is cut.
    db = postgres_connection.connect(url)
    try:
        with postgres_connection.cut_off_after(db, 0.2):
            db.execute("SELECT 1")
        time.sleep(0.4)
        assert db.execute("SELECT 2").fetchone() == (2,)
    finally:
        db.close()
