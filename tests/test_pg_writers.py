"""A PostgreSQL node's writers (--writers; docs/nodes.md, ARCHITECTURE.md):
transactions run at once, each on a connection of its own, so that one
waiting on the database holds no other; a writer whose connection was
lost while idle begins its next batch on a new one; and the option's
bounds. Over a real server and real PostgreSQL."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from test_dependencies_cascade import rows

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.core.engine.context import Context
from jobserver.core.engine.waiters import Phase
from jobserver.core.engine.work import Call, Serve
from jobserver.core.rules import cascade
from jobserver.storage import postgres_listen
from jobserver.storage.postgres import PostgresStore
from wire import Client, encode

pytestmark = pytest.mark.backends(only="postgres")

# Generous: a shared machine. A request held behind a lock would take as
# long as the lock is held, which is longer.
PROMPT = 5.0
HELD = 30.0
OK, GONE = "200 OK", "404 No job with this jobID"


def backends(server: ThreadServer) -> list[int]:
    """The PIDs of the node's writers' connections."""
    assert server.server.store is not None
    return [writer._db.info.backend_pid for writer in server.server.store.writers()]  # type: ignore[attr-defined]


@contextmanager
def row_locked(url: str, job_id: int) -> Iterator[psycopg.Connection[Any]]:
    """Job `job_id`'s row locked by a session of its own until the end."""
    with psycopg.connect(url) as session:
        session.execute("SELECT 1 FROM jobs WHERE jobID = %s FOR UPDATE", (job_id,))
        yield session
        session.rollback()


def waiting_on_lock(server: ThreadServer, url: str, count: int) -> None:
    """Until `count` of the node's writers wait for a lock (its own: other
    tests' nodes share the database)."""
    pids = backends(server)
    with psycopg.connect(url, autocommit=True) as admin:
        until(
            lambda: admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) "
                "AND wait_event_type = 'Lock'", (pids,),
            ).fetchone()[0] >= count,
            HELD, f"{count} of the node's transactions to wait for the lock",
        )


@pytest.mark.parametrize("writers", [2, 3])
def test_transactions_waiting_on_the_database_leave_the_next_to_another_writer(db, writers):
    # writers - 1 transactions wait for a row another session holds (each a
    # QueryJob of it, which locks the row): a neighbour's CreateJob is still
    # answered at once. With one writer fewer it waited for the lock.
    server = ThreadServer(db, writers=writers)
    try:
        with server.client(timeout=HELD) as client:
            held = create(client, "held")
        waiters = [Client(server.port, HELD) for _ in range(writers - 1)]
        try:
            with row_locked(str(db), held):
                for count, waiter in enumerate(waiters, 1):
                    waiter.send(encode("QueryJob", {"jobID": held}))
                    # One batch each: the next is sent once this one waits.
                    waiting_on_lock(server, str(db), count)
                with server.client(timeout=HELD) as neighbour:
                    began = time.monotonic()
                    create(neighbour, "neighbour")
                    took = time.monotonic() - began
            for waiter in waiters:
                assert ok(waiter.read_reply()).json["jobID"] == held
        finally:
            for waiter in waiters:
                waiter.close()
        assert took < PROMPT, f"the neighbour's CreateJob took {took:.2f} s"
    finally:
        server.stop()


def test_one_writer_runs_one_transaction_at_a_time(db):
    # The test above can fail: with --writers 1 the neighbour waits for the
    # lock, answered only once it is released.
    server = ThreadServer(db, writers=1)
    try:
        with server.client(timeout=HELD) as client:
            held = create(client, "held")
        with Client(server.port, HELD) as waiter, server.client(timeout=HELD) as neighbour:
            with row_locked(str(db), held):
                waiter.send(encode("QueryJob", {"jobID": held}))
                waiting_on_lock(server, str(db), 1)
                neighbour.send(encode("CreateJob", {"name": "neighbour"}))
                neighbour.sock.settimeout(1.0)
                with pytest.raises(TimeoutError):
                    neighbour.read_reply()
                neighbour.sock.settimeout(HELD)
            assert ok(waiter.read_reply()).json["jobID"] == held
            ok(neighbour.read_reply())
    finally:
        server.stop()


def test_a_writer_whose_connection_was_lost_while_idle_begins_on_a_new_one(db):
    # Every writer's backend ended while idle (a PostgreSQL restart, a
    # terminated session): no request is answered 503, since nothing of a
    # batch has run when its BEGIN finds the connection gone. Before, each
    # writer's first batch after it failed.
    server = ThreadServer(db, writers=2)
    try:
        with server.client() as client:
            create(client, "before")
            with psycopg.connect(str(db), autocommit=True) as admin:
                for pid in backends(server):
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            replies = [client.request("CreateJob", name="after") for _ in range(4)]
        assert [reply.status for reply in replies] == ["200 OK"] * 4
    finally:
        server.stop()


def blocked(url: str) -> int:
    return rows(url, "state = 'BLOCKED'")


def test_a_cascade_left_for_later_goes_on_once_it_commits_with_waiters_served_in_it(
    db, monkeypatch
):
    # 1,500 dependents, past one transaction's 1,000: the rest is settled
    # by the clock, fired at the commit. Waiters for the dependents are
    # served in the same transaction, which fired the clock before the
    # commit; the tick then ran on the other writer, found nothing, and the
    # rest waited for the listener's look each FALLBACK_SECONDS (0.5 s
    # where it was 0.05 s; here two minutes, past the test's bound).
    monkeypatch.setattr(postgres_listen, "FALLBACK_SECONDS", 120.0)
    server = ThreadServer(db, writers=2)
    try:
        with server.client(timeout=HELD) as client:
            root = create(client, "root")
            ok(client.request(
                "CreateJobs", jobs=[{"name": "leaf", "dependsOn": [root]} for _ in range(1500)]
            ))
            ok(client.request("GetJob", name="root"))
            waiters = [Client(server.port, HELD) for _ in range(4)]
            try:
                for waiter in waiters:
                    waiter.send(encode("GetJob", {"name": "leaf", "Connection": "wait"}))
                until(lambda: len(server.server.core.engine.waits) == 4, HELD, "the waiters")
                ok(client.request("FinishJob", jobID=root))
                until(lambda: blocked(str(db)) == 0, 20.0, "the cascade to end")
                for waiter in waiters:
                    ok(waiter.read_reply())
            finally:
                for waiter in waiters:
                    waiter.close()
    finally:
        server.stop()


def test_each_writers_transaction_settles_at_most_its_bound(db):
    # Two writers' transactions at two moments, interleaved: each keeps its
    # own count. The count was the node's, by transaction time, so the
    # other writer's transaction reset it and the first one settled 1,200
    # of a bound of 1,000 (a review of f0ded0c's parent, on a live node).
    store = PostgresStore(str(db), writers=2)
    try:
        first, second = store.writers()
        earlier = Context(first, datetime.now(UTC))
        later = Context(second, earlier.now + timedelta(milliseconds=5))
        assert cascade.allowance(earlier) == cascade.MOVES_AT_ONCE
        cascade.spend(earlier, 600)
        cascade.spend(later, 600)
        assert cascade.allowance(earlier) == cascade.MOVES_AT_ONCE - 600
        assert cascade.allowance(later) == cascade.MOVES_AT_ONCE - 600
    finally:
        store.close()


def test_two_cascades_at_once_each_settle_within_the_bound(db, monkeypatch):
    # Through a live node: two FailJobs at once, each of a root with 600
    # dependents that each have one, 1,200 to settle each; no transaction
    # settles more than MOVES_AT_ONCE, and every one fails once.
    settled: Counter[tuple[int, str]] = Counter()
    spend = cascade.spend

    def counted(ctx: Context, count: int) -> None:
        settled[id(ctx.store), ctx.now_ms] += count
        spend(ctx, count)

    monkeypatch.setattr(cascade, "spend", counted)
    server = ThreadServer(db, writers=2)
    try:
        roots = []
        with server.client(timeout=HELD) as client:
            for tree in range(2):
                root = create(client, f"root{tree}")
                middles = ok(client.request(
                    "CreateJobs", jobs=[{"name": f"middle{tree}", "dependsOn": [root]}] * 600
                )).json["jobIDs"]
                ok(client.request(
                    "CreateJobs",
                    jobs=[{"name": f"leaf{tree}", "dependsOn": [middle]} for middle in middles],
                ))
                ok(client.request("GetJob", name=f"root{tree}"))
                roots.append(root)
        settled.clear()
        together = threading.Barrier(2)
        replies: list[str] = []

        def fail(root: int) -> None:
            with server.client(timeout=HELD) as client:
                together.wait()
                replies.append(client.request("FailJob", jobID=root, error="no").status)

        threads = [threading.Thread(target=fail, args=(root,)) for root in roots]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert replies == ["200 OK", "200 OK"]
        until(lambda: blocked(str(db)) == 0, HELD, "the cascades to end")
        with psycopg.connect(str(db)) as session:
            states = dict(session.execute("SELECT state, count(*) FROM jobs GROUP BY state"))
        assert states == {"FAILED": 2402}
        assert max(settled.values()) <= cascade.MOVES_AT_ONCE, sorted(settled.values())
    finally:
        server.stop()


def _finish_at_once(
    client: Client, jobs: list[dict[str, Any]], both: threading.Barrier, replies: list[Any]
) -> None:
    both.wait(PROMPT)
    replies.append(client.request("FinishJobs", jobs=jobs))


def test_finish_jobs_naming_the_same_jobs_in_other_orders_and_shapes_never_deadlock(db, caplog):
    # Two writers finish the same two jobs at once, each naming one by
    # number alone (a plain run, finished first in one statement) and the
    # other with data (the long way): every job a request names is locked
    # first, in key order. Locked in two steps, the plain run's then the
    # rest, 46 rounds of 100 deadlocked (each a second's wait and a batch
    # run again, a 503 after three).
    caplog.set_level(logging.WARNING, logger="jobserver")
    server = ThreadServer(db, writers=2)
    try:
        with (
            server.client(timeout=HELD) as setup,
            server.client(timeout=HELD) as one,
            server.client(timeout=HELD) as other,
        ):
            for _ in range(20):
                a, b = create(setup, "mirrored"), create(setup, "mirrored")
                ok(setup.request("GetJobs", name="mirrored", numResults=2))
                both = threading.Barrier(2)
                replies: list[Any] = []
                mirrored = [
                    (one, [{"jobID": b}, {"jobID": a, "data": {}}]),
                    (other, [{"jobID": a}, {"jobID": b, "data": {}}]),
                ]
                sent = [
                    threading.Thread(target=_finish_at_once, args=(*pair, both, replies))
                    for pair in mirrored
                ]
                for thread in sent:
                    thread.start()
                for thread in sent:
                    thread.join(HELD)
                # Each job finished once, by one of the two.
                statuses = sorted(r["status"] for got in replies for r in ok(got).json["results"])
                assert statuses == [OK, OK, GONE, GONE], statuses
    finally:
        server.stop()
    undone = [r.getMessage() for r in caplog.records if "undone by the database" in r.getMessage()]
    assert undone == []


def test_waiters_are_served_first_come_first_served_with_two_writers(db):
    # Three waiters, then three jobs one at a time: each goes to the one
    # that has waited longest, on a node just started, round after round.
    # With two writers a younger waiter's try, queued with the batch that
    # created the job or run beside an older one's in the other writer,
    # took it (8 runs of 15 of test_waiting's single round failed).
    for round_ in range(8):
        server = ThreadServer(db, writers=2)
        try:
            engine = server.server.core.engine
            name = f"fifo{round_}"
            waiters = []
            with server.client(timeout=HELD) as client:
                try:
                    for _ in range(3):
                        before = len(engine.waits)
                        waiter = Client(server.port, HELD)
                        waiters.append(waiter)
                        waiter.send(encode("GetJob", {"name": name, "Connection": "wait"}))
                        until(lambda b=before, e=engine: len(e.waits) > b, HELD, "a waiter")
                    for count, waiter in enumerate(waiters):
                        job_id = create(client, name)
                        waiter.sock.settimeout(PROMPT)
                        assert ok(waiter.read_reply()).json["jobID"] == job_id, (round_, count)
                        left = len(waiters) - count - 1
                        until(lambda n=left, e=engine: len(e.waits) == n, HELD, "the rest")
                finally:
                    for waiter in waiters:
                        waiter.close()
        finally:
            server.stop()


def test_writers_is_for_postgresql_and_bounded(tmp_path):
    def serve(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "jobserver", "serve", "--port", "0", *options],
            capture_output=True, text=True, timeout=60,
        )

    sqlite = serve("--db", str(tmp_path / "jobs.db"), "--writers", "2")
    assert sqlite.returncode == 2
    assert "--writers is for a PostgreSQL --db" in sqlite.stderr
    for wrong in ("0", "17", "two"):
        refused = serve("--writers", wrong)
        assert refused.returncode == 2
        assert "from 1 to 16" in refused.stderr, refused.stderr


def test_a_waiter_gone_before_its_try_begins_takes_no_job(db):
    # A waiting GetJob whose client half-closes is told at once that no job
    # came, while its try still waits for the writer. A CreateJob the client
    # sends after that answer joins the same batch, whose tries run after
    # its requests (first come, first served across writers): the try took
    # the new job for the waiter that had left, RUNNING until given back,
    # and a client's look beside the give-back, on the other writer, found it
    # so (a clean-clone CI run did); the node counts the hand-out.
    server = ThreadServer(db, writers=1)
    engine = server.server.core.engine
    try:
        with server.client(timeout=HELD) as client:
            held = create(client, "held")
            with clients(server, 3) as (blocked, piped, creator):
                with row_locked(str(db), held):
                    blocked.send(encode("QueryJob", {"jobID": held}))
                    waiting_on_lock(server, str(db), 1)
                    piped.send(encode("GetJob", {"name": "half", "Connection": "wait"}))
                    until(lambda: len(engine.waits) == 1, HELD, "the waiter")
                    piped.sock.shutdown(socket.SHUT_WR)
                    assert piped.read_reply().status == "404 No job found"
                    creator.send(encode("CreateJob", {"name": "half"}))
                    # The try and the CreateJob, both queued behind the lock.
                    until(lambda: _queued_tries(engine) == [[0]] and _queued_requests(engine) == 1,
                          HELD, "both queued")
                ok(blocked.read_reply())
                job_id = ok(creator.read_reply()).json["jobID"]
            # What the node did with it (a give-back leaves it counted).
            history = ok(client.request("History", name="half", minutes=5)).json["series"]
            assert (sum(history["created"]), sum(history["handedOut"])) == (1, 0)
            assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "QUEUED"
    finally:
        server.stop()


def _waiter(engine: Any, seq: int) -> Any:
    """The node's waiter that joined `seq`-th (0 the first)."""
    found = [w for group in engine.waits._by_selector.values() for w in group if w.seq == seq]
    assert len(found) == 1, found
    return found[0]


@contextmanager
def clients(server: ThreadServer, count: int) -> Iterator[list[Client]]:
    """`count` connections to the node, patient as a held request needs."""
    with ExitStack() as stack:
        yield [stack.enter_context(Client(server.port, HELD)) for _ in range(count)]


def _until_tried(engine: Any, count: int) -> None:
    """Until `count` waiters wait and the last to join has had its first try."""
    until(
        lambda: len(engine.waits) == count and _waiter(engine, count - 1).phase is Phase.IDLE,
        HELD, f"waiter {count} tried",
    )


def _queued_tries(engine: Any) -> list[list[int]]:
    """The waiters of each try queued for the writers, by when they joined."""
    return [[w.seq for w in work.waiters] for work in engine._pending if isinstance(work, Serve)]


def _queued_requests(engine: Any) -> int:
    """How many clients' requests are queued for the writers; the node's own
    work (its clock's ticks, its look for ended awaited jobs) may queue
    beside them at any time, so it is not counted."""
    return sum(isinstance(work, Call) and work.task is not None for work in engine._pending)


@pytest.mark.parametrize("writers", [1, 2])
def test_tries_queued_together_run_oldest_first(db, writers):
    # W waits for "x"; then, every writer held behind a row lock, Q asks for
    # "x" too: its first try is queued, and the node's look at every waiter
    # (each second on PostgreSQL) queues W's behind it. A CreateJob of "x"
    # joins that batch. Its tries ran in the order they were queued, and Q,
    # the younger, took the job.
    server = ThreadServer(db, writers=writers)
    engine = server.server.core.engine
    blocked = [Client(server.port, HELD) for _ in range(writers)]
    try:
        with clients(server, 4) as (client, w, q, creator):
            held = create(client, "held")
            w.send(encode("GetJob", {"name": "x", "Connection": "wait"}))
            _until_tried(engine, 1)
            with row_locked(str(db), held):
                for count, each in enumerate(blocked, 1):
                    each.send(encode("QueryJob", {"jobID": held}))
                    waiting_on_lock(server, str(db), count)
                q.send(encode("GetJob", {"name": "x", "Connection": "wait"}))
                until(lambda: _queued_tries(engine) == [[1]], HELD, "Q's try queued")
                until(lambda: _queued_tries(engine) == [[1], [0]], HELD, "W's behind it")
                creator.send(encode("CreateJob", {"name": "x"}))
                until(lambda: _queued_requests(engine) == 1, HELD, "the CreateJob with them")
            for each in blocked:
                ok(each.read_reply())
            job_id = ok(creator.read_reply()).json["jobID"]
            w.sock.settimeout(PROMPT)
            assert ok(w.read_reply()).json["jobID"] == job_id
    finally:
        for each in blocked:
            each.close()
        server.stop()


def test_a_try_takes_nothing_for_a_waiter_that_left_while_it_ran(db):
    # A ("l*") and B ("*") are tried in one group when a CreateJob of "lim"
    # makes them worth trying; A's look meets the full limit on "lim", whose
    # lock a session holds. Meanwhile B's client half-closes (answered at
    # once) and, on the other writer, finishes E, which makes D due. Once
    # the lock is free, B's turn in the try came after its answer: it took
    # D, RUNNING for nobody until given back.
    server = ThreadServer(db, writers=2)
    engine = server.server.core.engine
    try:
        with clients(server, 4) as (client, a, b, creator):
            ok(client.request("SetLimit", name="lim", max=1))
            create(client, "lim")
            ok(client.request("GetJob", name="lim"))
            e = create(client, "e")
            assert ok(client.request("GetJob", name="e")).json["jobID"] == e
            d = create(client, "d", dependsOn=json.dumps([e]))
            for count, (waiter, pattern) in enumerate([(a, "l*"), (b, "*")], 1):
                waiter.send(encode("GetJob", {"name": pattern, "Connection": "wait"}))
                _until_tried(engine, count)
            with psycopg.connect(str(db)) as session:
                session.execute("SELECT slot FROM jobserver_locks WHERE slot = 0 FOR UPDATE")
                creator.send(encode("CreateJob", {"name": "lim"}))
                waiting_on_lock(server, str(db), 1)
                b.sock.shutdown(socket.SHUT_WR)
                assert b.read_reply().status == "404 No job found"
                ok(client.request("FinishJob", jobID=e))
                assert ok(client.request("QueryJob", jobID=d)).json["state"] == "QUEUED"
                session.rollback()
            ok(creator.read_reply())
            history = ok(client.request("History", name="d", minutes=5)).json["series"]
            assert sum(history["handedOut"]) == 0
            assert ok(client.request("QueryJob", jobID=d)).json["state"] == "QUEUED"
    finally:
        server.stop()
