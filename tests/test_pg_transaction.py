"""What a PostgreSQL batch sends, and in how many round trips, besides its
statements: the begin's statement, prepared on the connection
(postgres_commit.PREPARE); a released savepoint's RELEASE, kept back until
something needs it (postgres_statements); the next due time, read in the
COMMIT's query (commit_reading_next_due). Each is checked against what
PostgreSQL holds, on a real server."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pg
import psycopg
import pytest
import trio
from driver import job

from jobserver.core.commands import create as commands
from jobserver.core.engine.clock import SystemClock
from jobserver.core.engine.engine import Engine
from jobserver.core.rules.selection import JobQuery
from jobserver.model.jobs import JobChanges, State
from jobserver.model.limits import Limit, Rate
from jobserver.storage import postgres, postgres_commit, postgres_statements
from jobserver.wire.framing import Request
from relay import Relay


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


def test_each_begin_reads_on_a_statement_prepared_once_per_connection(url):
    """A batch's begin executes a statement prepared on its connection
    (postgres_commit.PREPARE): prepared once, again after psycopg
    deallocated it, and on the connection that replaces one PostgreSQL
    ended. What it reads is read
    afresh at each begin: the transaction's own ID, and the limits and
    paused patterns another node stored meanwhile, rate and all."""
    store = postgres.PostgresStore(url, writers=1)
    other = postgres.PostgresStore(url, writers=1)
    admin = psycopg.connect(url, autocommit=True)

    def prepared() -> int:
        (count,) = store._one(
            "SELECT count(*) FROM pg_prepared_statements WHERE name = %s",
            (postgres_commit.BEGIN_STATEMENT,),
        )
        return int(count)

    try:
        seen, backends = [], set()
        for _ in range(3):
            store.begin()
            seen.append(store._xid)
            backends.add(store._backend)
            assert prepared() == 1
            (xid,) = store._one("SELECT pg_current_xact_id()::text")
            assert store._xid == xid
            store.commit()
        assert len(set(seen)) == 3 and len(backends) == 1
        assert store.limits == {} and store.paused == frozenset()
        other.begin()
        other.set_limit("mail/*", Limit(max=2, rate=Rate(5, 60_000), per_key=True))
        other.pause("video/*")
        other.commit()
        store.begin()
        assert store.limits == {"mail/*": Limit(max=2, rate=Rate(5, 60_000), per_key=True)}
        assert store.paused == frozenset({"video/*"})
        store.commit()
        # psycopg answers a ROLLBACK, or a ROLLBACK TO SAVEPOINT, by
        # deallocating every prepared statement once it has prepared one
        # of its own (run six times): the next begin prepares again, on the
        # same connection.
        for _ in range(6):
            store._one("SELECT 1")
        with pytest.raises(psycopg.Error):
            store._execute("SELECT 1/0")
        store.rollback()
        store.begin()
        assert prepared() == 1 and store._backend in backends
        for _ in range(6):
            store._one("SELECT 2")
        store.savepoint()
        with pytest.raises(psycopg.Error):
            store._execute("SELECT 1/0")
        store.rollback_savepoint()
        store.commit()
        store.begin()
        assert prepared() == 1 and store._backend in backends
        store.commit()
        # Rolled back with nothing deallocated, it finds the statement there.
        store.begin()
        store.rollback()
        store.begin()
        assert prepared() == 1 and store._backend in backends
        store.commit()
        admin.execute("SELECT pg_terminate_backend(%s)", (store._backend,))
        store.begin()
        assert store._backend not in backends
        assert prepared() == 1
        assert store.paused == frozenset({"video/*"})
        store.commit()
    finally:
        admin.close()
        other.close()
        store.close()


def names(store: postgres.PostgresStore) -> list[str]:
    rows = store._execute("SELECT name FROM jobs ORDER BY jobID").fetchall()
    return [str(row[0]) for row in rows]


def insert(store: postgres.PostgresStore, name: str) -> None:
    store._execute(
        "INSERT INTO jobs (created, state, name, nextRun) VALUES ('', 'QUEUED', %s, '')", (name,)
    )


def savepoints_open(store: postgres.PostgresStore) -> int:
    """How many savepoints named "request" are open on the server: each
    ROLLBACK TO one and RELEASE of it, on the raw connection, until
    PostgreSQL says there is none (the transaction is then spoiled)."""
    db, count = store._db, 0
    while True:
        try:
            db.execute('RELEASE SAVEPOINT "request"')
        except psycopg.errors.InvalidSavepointSpecification:
            return count
        count += 1


def test_a_released_savepoints_release_waits_for_what_needs_it(url):
    """A RELEASE is not sent when a savepoint is released: it goes in one
    query with the next SAVEPOINT, alone before any other statement, and
    not at all before COMMIT, which keeps what every savepoint held.
    Undoing a later savepoint undoes only its own."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        store.begin()
        for name in ("first", "second", "third"):
            store.savepoint()
            insert(store, name)
            store.release()
        store.savepoint()
        insert(store, "undone")
        store.rollback_savepoint()
        store.commit()
        store.begin()
        assert names(store) == ["first", "second", "third"]
        store.commit()

        # Kept back, one RELEASE at a time: at most one savepoint is left
        # open however many were released, and the next statement sends it.
        store.begin()
        for name in ("fourth", "fifth"):
            store.savepoint()
            insert(store, name)
            store.release()
        assert savepoints_open(store) == 1
        store.rollback()
        store.begin()
        store.savepoint()
        insert(store, "sixth")
        store.release()
        store._one("SELECT 1")
        assert savepoints_open(store) == 0
        store.rollback()
        # A rollback drops a RELEASE kept back: the next batch starts clean.
        store.begin()
        store.savepoint()
        insert(store, "seventh")
        store.release()
        store.rollback()
        store.begin()
        store.savepoint()
        insert(store, "eighth")
        store.release()
        store.commit()
        store.begin()
        assert names(store) == ["first", "second", "third", "eighth"]
        store.commit()
    finally:
        store.close()


DEADLINE = 20.0
FUTURE = "2030-01-01 00:05:00"
NOW = "2030-01-01 00:00:10.000"


def test_the_next_due_time_read_with_the_commit_in_each_shape_of_it(url):
    """commit_reading_next_due reads in the COMMIT's own query whatever
    else goes with it (a notice; idempotency keys, in a pipeline), and as a
    statement of its own after a ROLLBACK TO SAVEPOINT (which may have
    deallocated its prepared statement): the same time each way, and the
    transaction committed."""
    store = postgres.PostgresStore(url, writers=1)
    # Another session on the database: the node tells it of its commits.
    listener = psycopg.connect(url, autocommit=True)
    try:
        listener.execute(f'LISTEN "{store.channel}"')
        store.begin()
        (first,) = store.create([job("a", FUTURE)], created=NOW, state=State.QUEUED)
        store.announce({"a"}, FUTURE, set())
        assert store.commit_reading_next_due(NOW) == FUTURE
        heard = next(listener.notifies(timeout=DEADLINE))
        assert json.loads(heard.payload)["ready"] == ["a"]
        store.begin()
        store.create([job("b", FUTURE)], created=NOW, state=State.QUEUED)
        store.keep_idempotent("key", "request", "reply", "2030-01-02 00:00:00.000")
        assert store.commit_reading_next_due(NOW) == FUTURE
        store.begin()
        store.savepoint()
        with pytest.raises(psycopg.Error):
            store._execute("SELECT 1/0")
        store.rollback_savepoint()
        store.delete([first])
        assert store.commit_reading_next_due(FUTURE) is None
        store.begin()
        assert store.get(first) is None
        assert store.idempotent("key", NOW) is not None
        store.commit()
    finally:
        listener.close()
        store.close()


def test_a_commit_whose_answer_is_lost_gives_its_read_as_unknown(url):
    """A COMMIT that reached PostgreSQL and whose answer was lost: the node
    asks, learns it committed, and returns `after` for the time it read
    (not known: a time already passed, at which the clock looks at once)."""
    relay = Relay.to(url)
    store = postgres.PostgresStore(relay.url(url), writers=1)
    try:
        store.begin()
        (made,) = store.create([job("a", FUTURE)], created=NOW, state=State.QUEUED)
        relay.cut_at_commit(reaches=True)
        assert store.commit_reading_next_due(NOW) == NOW
        assert relay.was_cut.is_set()
        store.begin()
        assert store.get(made) is not None
        store.commit()
    finally:
        store.close()
        relay.close()


SAVEPOINT = b'SAVEPOINT "request"\x00'


def savepoints_sent_alone(sent: bytes) -> int:
    """How many of the queries in `sent` (PostgreSQL's frontend messages)
    were a SAVEPOINT on its own: one not after `; ` (a query of several
    statements) nor in a RELEASE or a ROLLBACK TO."""
    count, at = 0, sent.find(SAVEPOINT)
    while at != -1:
        count += sent[at - 1:at] != b" "
        at = sent.find(SAVEPOINT, at + 1)
    return count


def test_a_begin_opens_the_first_savepoint_in_its_own_query(url):
    """begin(savepoint=True) opens the transaction and the savepoint that
    savepoint() opens, in the begin's one query: undoing the savepoint
    undoes what came after the begin, and the transaction goes on."""
    relay = Relay.to(url)
    store = postgres.PostgresStore(relay.url(url), writers=1)
    try:
        store.begin()
        insert(store, "kept")
        store.commit()
        store.begin(savepoint=True)
        assert savepoints_sent_alone(bytes(relay.sent)) == 0
        insert(store, "undone")
        store.rollback_savepoint()
        insert(store, "after")
        store.commit()
        store.begin()
        assert names(store) == ["kept", "after"]
        store.commit()
    finally:
        store.close()
        relay.close()
    sent = bytes(relay.sent)
    assert sent.count(postgres_commit.BEGIN + postgres_commit.SAVEPOINT + b"\x00") == 1
    assert savepoints_sent_alone(sent) == 0


async def test_a_batch_of_tries_alone_opens_its_first_savepoint_with_its_begin():
    """A waiting GetJob's tries run in a batch of their own, each in a
    savepoint: the first one's goes with the begin, a round trip fewer
    (a wake across nodes is such a batch on the waiter's node). What the
    tries find is unchanged: nothing on an empty queue, the job once made."""
    with pg.fresh_schema() as url:
        relay = Relay.to(url)
        store = postgres.PostgresStore(relay.url(url), writers=1)
        # What the tries sent, after the schema's making.
        start = len(relay.sent)
        engine = Engine(store, SystemClock())
        engine.start()
        try:
            with trio.fail_after(10):
                assert await engine.wait(JobQuery(("ready",), (), None, 1), 0) is None
                made = await engine.call(
                    lambda ctx: commands.create_job(ctx, Request("CreateJob", {"name": "ready"}))
                )
                taken = await engine.wait(JobQuery(("ready",), (), None, 1), 5)
            made_id = json.loads(made.body)["jobID"]
            assert taken is not None and [t.job.jobID for t in taken] == [made_id]
        finally:
            with trio.fail_after(10):
                await engine.stop()
            store.close()
            relay.close()
    sent = bytes(relay.sent[start:])
    # The first begin asks too whether another node is on the database.
    assert sent.count(postgres_commit.SAVEPOINT + b"\x00") == 2
    # The try that found the job handed it out in its COMMIT's query.
    assert re.search(rb"UPDATE jobs SET state = 'RUNNING'[^\x00]*; COMMIT\x00", sent)
    assert updates_sent_alone(sent) == 0


def updates_sent_alone(sent: bytes) -> int:
    """How many of the queries in `sent` began with an UPDATE of jobs and
    held nothing else."""
    return len(re.findall(rb"[QP][\x00-\xff]{4}\x00?UPDATE jobs [^;\x00]*\x00", sent))


def queued(store: postgres.PostgresStore, state: State = State.QUEUED) -> int:
    """A job in `state`, made and committed."""
    store.begin()
    (made,) = store.create([job("held")], created=NOW, state=state)
    store.commit()
    return made


def hand_out_held(store: postgres.PostgresStore, made: int, worker: str = "w") -> None:
    """`made` held and handed out, the command's writes held to its end."""
    with store.holding_writes():
        store.hold([made])
        assert store.hand_out_plain(made, "0123456789abcdef", worker, "n", NOW, NOW)


def amend_held(store: postgres.PostgresStore, made: int, changes: JobChanges) -> None:
    """`made` held and amended, the command's writes held to its end."""
    with store.holding_writes():
        store.hold([made])
        assert store.amend([made], changes) == [made]


def state_of(url: str, made: int) -> str:
    with psycopg.connect(url) as other:
        row = other.execute("SELECT state FROM jobs WHERE jobID = %s", (made,)).fetchone()
    assert row is not None
    return str(row[0])


def test_a_commands_last_held_writes_go_with_the_commit(url):
    """A command's hand-out writes, held to its end, are sent in the
    COMMIT's query (a round trip fewer), or alone before any statement
    that could read them; a ROLLBACK, or a ROLLBACK TO the savepoint they
    were made in, undoes them. What each reads is what the database holds."""
    relay = Relay.to(url)
    store = postgres.PostgresStore(relay.url(url), writers=1)
    try:
        made = queued(store)
        store.begin()
        start = len(relay.sent)
        hand_out_held(store, made)
        assert b"UPDATE jobs" not in relay.sent[start:]
        store.commit()
        assert state_of(url, made) == "RUNNING"
        assert re.search(rb"UPDATE jobs [^\x00]*; COMMIT\x00", relay.sent[start:])
        assert updates_sent_alone(bytes(relay.sent[start:])) == 0

        # A statement after them reads them.
        made = queued(store)
        store.begin()
        hand_out_held(store, made)
        (state,) = store._one("SELECT state FROM jobs WHERE jobID = %s", (made,))
        assert state == "RUNNING" and updates_sent_alone(bytes(relay.sent[start:])) == 1
        store.rollback()
        assert state_of(url, made) == "QUEUED"

        # Undone, by a ROLLBACK or a ROLLBACK TO SAVEPOINT, they stay undone.
        store.begin()
        hand_out_held(store, made)
        store.rollback()
        store.begin()
        store.savepoint()
        hand_out_held(store, made)
        store.rollback_savepoint()
        store.commit()
        assert state_of(url, made) == "QUEUED"

        # Kept back past the savepoint's RELEASE, they go with the next one.
        store.begin()
        store.savepoint()
        hand_out_held(store, made)
        store.release()
        store.savepoint()
        assert updates_sent_alone(bytes(relay.sent[start:])) == 1
        store.rollback_savepoint()
        store.commit()
        assert state_of(url, made) == "RUNNING"
    finally:
        store.close()
        relay.close()


def test_held_writes_of_many_jobs_go_at_once_with_their_parameters(url):
    """Writes of more than one job (a GetJobs' hand-out) are sent as the
    command ends, as one statement with parameters that psycopg prepares
    (planned again in every query of text, a hundred jobs' UPDATE cost a
    drain PostgreSQL's CPU)."""
    relay = Relay.to(url)
    store = postgres.PostgresStore(relay.url(url), writers=1)
    try:
        first, second = queued(store), queued(store)
        store.begin()
        start = len(relay.sent)
        with store.holding_writes():
            store.hold([first, second])
            for made in (first, second):
                assert store.hand_out_plain(made, f"{made:016x}", "w", "n", NOW, NOW)
        assert b"UPDATE jobs" in relay.sent[start:]
        assert b"'RUNNING'" not in relay.sent[start:]
        store.commit()
        assert [state_of(url, first), state_of(url, second)] == ["RUNNING", "RUNNING"]
    finally:
        store.close()
        relay.close()


def test_a_held_write_that_cannot_be_text_fails_its_own_command(url):
    """A value psycopg cannot quote (a NUL, which no PostgreSQL text holds)
    is sent as it is, at the command's end, and fails there: the command is
    refused, not the COMMIT of the batch around it."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        made = queued(store)
        store.begin()
        store.savepoint()
        with pytest.raises(psycopg.DataError):
            hand_out_held(store, made, worker="a\x00b")
        store.rollback_savepoint()
        hand_out_held(store, made)
        store.commit()
        assert state_of(url, made) == "RUNNING"
    finally:
        store.close()


def test_kept_back_values_are_stored_as_they_were_sent(url):
    """A value kept back is quoted as psycopg quotes a literal for the
    session (UTF8, standard_conforming_strings on: postgres_connection):
    workers' names outside ASCII, with quotes and a backslash, kept back,
    then sent with the COMMIT and before a SAVEPOINT, are stored as sent."""
    names = ["café 'x' \\ €", "naïve \"y\" 🎉"]
    store = postgres.PostgresStore(url, writers=1)
    try:
        made, second = queued(store), queued(store)
        store.begin()
        hand_out_held(store, made, worker=names[0])
        assert store._unsent
        store.commit()
        store.begin()
        store.savepoint()
        hand_out_held(store, second, worker=names[1])
        assert store._unsent
        store.release()
        store.savepoint()
        store.commit()
    finally:
        store.close()
    with psycopg.connect(url) as other:
        rows = other.execute(
            "SELECT worker FROM jobs WHERE jobID = ANY(%s) ORDER BY jobID", ([made, second],)
        ).fetchall()
    assert [row[0] for row in rows] == names


def hand_out_fails_alone(url: str, worker: str, refused: type[psycopg.Error]) -> None:
    """On `url`, a hand-out to `worker` fails its own command with
    `refused`, and the next command's hand-out commits."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        made = queued(store)
        store.begin()
        store.savepoint()
        with pytest.raises(refused):
            hand_out_held(store, made, worker=worker)
        store.rollback_savepoint()
        hand_out_held(store, made, worker="plain")
        store.commit()
    finally:
        store.close()
    assert state_of(url, made) == "RUNNING"


def test_a_text_its_database_cannot_store_fails_its_own_command():
    """Across encodings PostgreSQL refuses a character it cannot convert
    only as the statement runs: "€" from the node's UTF8 sessions to a
    LATIN1 database. Such a text is never kept back: the command that
    wrote it fails, not the COMMIT of the batch around it."""
    with pg.database_in("LATIN1") as latin1:
        hand_out_fails_alone(latin1, "€", psycopg.errors.UntranslatableCharacter)


def test_what_is_kept_back_is_what_each_column_of_jobs_takes(url):
    """postgres_statements.TAKES names every column of jobs but those of
    double precision, each with what its type takes."""
    store = postgres.PostgresStore(url, writers=1)
    store.close()
    with psycopg.connect(url) as db:
        columns = db.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'jobs'"
        ).fetchall()
    takes = postgres_statements.TAKES
    # By type and nullability: what the column takes, and what it refuses.
    expected = {
        ("text", "NO"): (["x", ""], [None, 1, True, 2.0, b"x"]),
        ("text", "YES"): (["x", None], [1, True, 2.0, b"x"]),
        ("integer", "NO"): ([-(2**31), 2**31 - 1], [2**31, -(2**31) - 1, True, None, 2.0, "1"]),
        ("bigint", "NO"): ([-(2**63), 2**63 - 1], [2**63, True, None, 2.0, "1"]),
    }
    for column, kind, nullable in columns:
        if kind == "double precision":
            assert column not in takes
            continue
        fits, refused = expected[kind, nullable]
        assert all(takes[column](value) for value in fits), column
        assert not any(takes[column](value) for value in refused), column
    assert set(takes) <= {column for column, _, _ in columns}


@pytest.mark.parametrize(
    "changes, stored",
    [
        (JobChanges(priority=2.5), ("priority", 2)),
        (JobChanges(retryDelay=-0.0), ("retryDelay::text", "-0")),
    ],
)
def test_a_float_is_stored_as_its_parameter_is(url, changes, stored):
    """A float is sent as a parameter at the command's end, never kept back
    as a numeric literal: stored as PostgreSQL converts the parameter (2.5
    rounded to even, -0.0 with its sign)."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        made = queued(store)
        store.begin()
        amend_held(store, made, changes)
        assert not store._unsent
        store.commit()
    finally:
        store.close()
    column, value = stored
    with psycopg.connect(url) as other:
        assert other.execute(f"SELECT {column} FROM jobs").fetchone() == (value,)


@pytest.mark.parametrize(
    "changes, refused",
    [
        (JobChanges(lastError=None), psycopg.errors.NotNullViolation),
        (JobChanges(awaited=True), psycopg.errors.DatatypeMismatch),
        (JobChanges(priority=1e10), psycopg.errors.NumericValueOutOfRange),
        (JobChanges(priority=2**31), psycopg.errors.NumericValueOutOfRange),
    ],
)
def test_a_value_its_column_refuses_fails_its_own_command(url, changes, refused):
    """A NULL in a column that takes none (every text column but lastRun),
    a bool in an integer column, a number past an INTEGER's range: each is
    sent as a parameter at the command's end, and fails there, not at the
    COMMIT of the batch around it."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        made = queued(store)
        store.begin()
        store.savepoint()
        with pytest.raises(refused):
            amend_held(store, made, changes)
        store.rollback_savepoint()
        hand_out_held(store, made)
        store.commit()
    finally:
        store.close()
    assert state_of(url, made) == "RUNNING"


def test_a_savepoint_left_open_by_held_writes_is_not_kept_back(url):
    """Held writes that end with a savepoint of theirs still open are sent
    at once: kept back, undoing that savepoint would have dropped the
    writes made before it too."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        made = queued(store)
        store.begin()
        with store.holding_writes():
            store.hold([made])
            assert store.hand_out_plain(made, "0123456789abcdef", "w", "n", NOW, NOW)
            store.savepoint("inner")
            assert store.amend([made], JobChanges(priority=7)) == [made]
        store.rollback_savepoint("inner")
        store.commit()
    finally:
        store.close()
    with psycopg.connect(url) as other:
        row = other.execute("SELECT state, priority FROM jobs").fetchone()
    assert row == ("RUNNING", 500)


def test_one_jobs_lock_and_children_check_keep_one_plan(url):
    """A command that holds one job (a FinishJob, a RetryJob) locks it and
    looks for its children in statements PostgreSQL plans once: asked for
    as `= ANY` of a one-element array they were planned again at every
    execution, a generic plan of an array being costed above one element's
    custom plan (74 µs a bind; docs/benchmarks.md)."""
    store = postgres.PostgresStore(url, writers=1)
    try:
        # A queue with statistics, as a node keeps them: on an empty table
        # without them PostgreSQL took the generic plan of either form.
        store.begin()
        store.create([job("held")] * 2000, created=NOW, state=State.QUEUED)
        store.commit()
        store._execute("ANALYZE jobs")
        for _ in range(12):
            made = queued(store)
            store.begin()
            with store.holding_writes():
                store.hold([made])
            store.commit()
        plans = {
            str(statement): (int(generic), int(custom))
            for statement, generic, custom in store._execute(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            ).fetchall()
        }
    finally:
        store.close()
    lock = [p for s, p in plans.items() if "FROM jobs WHERE jobID" in s and "FOR UPDATE" in s]
    children = [p for s, p in plans.items() if "DISTINCT parentJobID" in s]
    # psycopg prepares a statement at its fifth run; PostgreSQL plans it
    # custom five times more, then keeps the generic plan.
    assert lock and children, plans
    for generic, custom in lock + children:
        assert generic >= 1 and custom <= 5, plans
