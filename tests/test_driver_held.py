"""The driver's many-job path (storage/held_writes.py): while writes are
held, every named operation must answer exactly as it does one statement
at a time, and the database must end up the same. Part of the driver's
own suite (test_driver.py says what that is), on every backend.

The property test runs random sequences of fenced writes, reads,
savepoints and plain statements twice on one store, once written one at a
time and once held, and compares every answer and the rows left.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from driver import NOW, PAST, create, job, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobserver.model.jobs import Job, JobChanges, RetryPolicy, State
from jobserver.storage import held_writes
from jobserver.storage.held_writes import Write
from jobserver.storage.interface import Storage
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.postgres_statements import STREAM_AFTER
from jobserver.storage.sql_statements import RESERVE_CHUNK

pytestmark = pytest.mark.backends()


def rows(store: Storage, ids: list[int]) -> list[Job | None]:
    with transaction(store):
        return [store.get(job_id) for job_id in ids]


def test_held_writes_reach_the_database_at_the_end(store: Storage) -> None:
    ids = create(store, *(job(f"j{i}") for i in range(5)))
    with transaction(store):
        with store.holding_writes():
            store.hold(ids)
            for job_id in ids:
                assert store.set_state_if([job_id], [State.QUEUED], State.RUNNING) == [job_id]
            # Answered from the held copy, as the database would.
            held = store.get(ids[0])
            assert held is not None and held.state == State.RUNNING
        assert store.count_by_state() == {"RUNNING": 5}
    assert [r.state for r in rows(store, ids) if r] == ["RUNNING"] * 5


def test_a_statement_sees_every_write_held_before_it(store: Storage) -> None:
    ids = create(store, job("a"), job("b"))
    with transaction(store), store.holding_writes():
        store.hold(ids)
        store.delete([ids[0]], [State.QUEUED])
        # A plain statement: the held delete goes first.
        assert store.count_by_state() == {"QUEUED": 1}
        assert store.get(ids[0]) is None


def test_held_writes_are_fenced_by_state_and_lease(store: Storage) -> None:
    first, second = create(store, job("a"), job("b"))
    with transaction(store):
        store.set_state_if([second], [State.QUEUED], State.RUNNING, JobChanges(leaseID="L"))
    with transaction(store), store.holding_writes():
        store.hold([first, second])
        assert store.set_state_if([first], [State.RUNNING], State.FINISHED) == []
        assert store.set_state_if([second], [State.RUNNING], State.QUEUED, lease="M") == []
        assert store.delete([first], [State.RUNNING]) == []
        assert store.delete([second], [State.RUNNING]) == [second]
        assert store.delete([second]) == []
    a, b = rows(store, [first, second])
    assert a is not None and a.state == State.QUEUED and b is None


def test_an_exception_drops_what_was_held(store: Storage) -> None:
    (job_id,) = create(store, job("a"))
    with transaction(store):
        before = store.total_changes
        with pytest.raises(RuntimeError), store.holding_writes():
            store.hold([job_id])
            store.set_state_if([job_id], [State.QUEUED], State.CANCELLED)
            raise RuntimeError("the command failed")
        assert store.total_changes == before
    (row,) = rows(store, [job_id])
    assert row is not None and row.state == State.QUEUED


def test_a_held_savepoint_undoes_its_own_writes_only(store: Storage) -> None:
    first, second = create(store, job("a"), job("b"))
    with transaction(store), store.holding_writes():
        store.hold([first, second])
        store.set_state_if([first], [State.QUEUED], State.CANCELLED)
        store.savepoint("element")
        store.set_state_if([second], [State.QUEUED], State.CANCELLED)
        store.rollback_savepoint("element")
        again = store.get(second)
        assert again is not None and again.state == State.QUEUED
        store.savepoint("element")
        store.amend([second], JobChanges(data='{"kept":1}'))
        store.release("element")
    a, b = rows(store, [first, second])
    assert a is not None and a.state == State.CANCELLED
    assert b is not None and b.state == State.QUEUED and b.data == '{"kept":1}'


def test_a_savepoint_reaches_the_database_when_a_statement_runs_inside(store: Storage) -> None:
    parent, other = create(store, job("p"), job("o"))
    (child,) = create(store, job("c", parent_id=parent), state=State.FINISHED)
    with transaction(store), store.holding_writes():
        store.hold([parent, other])
        store.set_state_if([other], [State.QUEUED], State.CANCELLED)
        store.savepoint("element")
        store.set_state_if([parent], [State.QUEUED], State.CANCELLED)
        # Not a held write: it runs inside the savepoint, sent first.
        assert store.delete_children(parent, [State.FINISHED]) == 1
        store.rollback_savepoint("element")
        assert store.children(parent, [State.FINISHED])
    p, o, c = rows(store, [parent, other, child])
    assert p is not None and p.state == State.QUEUED
    assert o is not None and o.state == State.CANCELLED
    assert c is not None


def test_hand_outs_found_by_the_search_are_held_and_sent_together(store: Storage) -> None:
    ids = create(store, *(job(f"j{i}") for i in range(4)))
    with transaction(store), store.holding_writes():
        found = store.find_ready(now=NOW, priorities=[500], limit=10, patterns=["*"])
        for row in found:
            changes = JobChanges(leaseID=f"lease{row.jobID}", lastRun=NOW)
            assert store.set_state_if([row.jobID], [State.QUEUED], State.RUNNING, changes)
        assert not store.has_children(found[0].jobID)
        assert store.children(found[0].jobID, [State.FINISHED]) == []
    for row in rows(store, ids):
        assert row is not None and row.state == State.RUNNING
        assert row.leaseID == f"lease{row.jobID}" and row.lastRun == NOW


def test_held_jobs_know_their_children(store: Storage) -> None:
    parent, lone = create(store, job("p"), job("l"))
    create(store, job("c", parent_id=parent))
    with transaction(store), store.holding_writes():
        store.hold([parent, lone, 999_999])
        assert store.has_children(parent) and not store.has_children(lone)
        assert store.get(999_999) is None


def test_jobs_created_while_held_keep_their_order_and_fields(store: Storage) -> None:
    (first,) = create(store, job("before"))
    with transaction(store):
        with store.holding_writes():
            store.reserve_ids(3)
            new = [job(f"n{i}", priority=i, data=f'{{"i":{i}}}') for i in range(3)]
            ids = [store.create([one], created=PAST, state=State.QUEUED)[0] for one in new]
        assert ids == sorted(ids) and ids[0] > first
        found = store.find_ready(now=NOW, priorities=[2, 1, 0], limit=10, patterns=["n*"])
        assert [j.jobID for j in found] == ids[::-1]
    stored = rows(store, ids)
    assert [(r.name, r.priority, r.data) for r in stored if r] == [
        (f"n{i}", i, f'{{"i":{i}}}') for i in range(3)
    ]


# Enough new jobs for PostgreSQL to send them as they are made, in a COPY
# left open (postgres_statements.STREAM_AFTER), in several sends of rows
# (psycopg's, of 32 KiB: each job's data is over 300 bytes).
STREAMED = 4 * STREAM_AFTER
PAD = "x" * 300


def new_jobs(store: Storage, prefix: str, count: int) -> list[int]:
    """`count` jobs made one call each, as a CreateJobs makes its elements."""
    return [
        store.create([job(f"{prefix}{i}", priority=i % 1000, data=f'{{"i":{i},"p":"{PAD}"}}')],
                     created=PAST, state=State.QUEUED)[0]
        for i in range(count)
    ]


def test_many_new_jobs_keep_order_and_fields_around_other_statements(store: Storage) -> None:
    # Statements between runs of new jobs (each ends an open COPY), a new
    # job of other columns among them (a policy: not the COPY's), and a
    # run too short for a COPY of its own at the end.
    with transaction(store):
        with store.holding_writes():
            store.reserve_ids(2 * STREAMED + STREAM_AFTER)
            ids = new_jobs(store, "a", STREAMED)
            assert store.count_by_state() == {"QUEUED": STREAMED}
            ids += new_jobs(store, "b", STREAMED)
            ids += store.create([job("policy", policy=RetryPolicy(3, "fixed", 5, 60))],
                                created=PAST, state=State.QUEUED)
            ids += new_jobs(store, "c", STREAM_AFTER - 1)
        assert store.count_by_state() == {"QUEUED": len(ids)}
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    names = [f"{p}{i}" for p, n in (("a", STREAMED), ("b", STREAMED)) for i in range(n)]
    names += ["policy", *(f"c{i}" for i in range(STREAM_AFTER - 1))]
    stored = [r for r in rows(store, ids) if r]
    assert [r.name for r in stored] == names
    assert [(r.priority, r.data) for r in stored[:3]] == [
        (i, f'{{"i":{i},"p":"{PAD}"}}') for i in range(3)
    ]
    policy = stored[len(names) - STREAM_AFTER]
    assert (policy.maxAttempts, policy.retryBackoff) == (3, "fixed")


def test_new_jobs_sent_ahead_are_undone_with_the_savepoint_around_them(
    backend: str, store: Storage
) -> None:
    # The command fails once its new jobs' rows are on their way: the
    # transaction must be counted as changed (the writer then runs the
    # batch again, a savepoint a request), and its savepoint undoes them.
    (kept,) = create(store, job("kept"))
    with transaction(store):
        store.savepoint()
        before = store.total_changes
        with pytest.raises(RuntimeError, match="refused"), store.holding_writes():
            store.reserve_ids(STREAMED)
            new_jobs(store, "gone", STREAMED)
            raise RuntimeError("refused")
        if backend == "postgres":
            assert store.total_changes != before
        store.rollback_savepoint()
        after = new_jobs(store, "after", 1)
    assert [r.name if r else None for r in rows(store, [kept, *after])] == ["kept", "after0"]
    with transaction(store):
        assert store.count_by_state() == {"QUEUED": 2}


def test_a_savepoint_kept_among_new_jobs_undoes_only_the_jobs_inside(store: Storage) -> None:
    # A savepoint opened while new jobs' rows are being sent: the jobs made
    # inside it must wait for it, not join the rows on their way, which its
    # undo could not reach.
    with transaction(store):
        with store.holding_writes():
            store.reserve_ids(STREAMED + 20)
            first = new_jobs(store, "in", STREAMED)
            store.savepoint("element")
            new_jobs(store, "undone", 10)
            store.rollback_savepoint("element")
            last = new_jobs(store, "last", 10)
        assert store.count_by_state() == {"QUEUED": STREAMED + 10}
    assert [r.name for r in rows(store, [first[0], last[-1]]) if r] == ["in0", "last9"]


def test_two_writes_to_one_job_keep_their_order(store: Storage) -> None:
    ids = create(store, job("a"), job("b"))
    with transaction(store), store.holding_writes():
        store.hold(ids)
        for job_id in ids:
            store.set_state_if([job_id], [State.QUEUED], State.RUNNING, JobChanges(leaseID="x"))
        store.set_state_if([ids[0]], [State.RUNNING], State.QUEUED, JobChanges(leaseID=""))
    a, b = rows(store, ids)
    assert a is not None and (a.state, a.leaseID) == (State.QUEUED, "")
    assert b is not None and (b.state, b.leaseID) == (State.RUNNING, "x")


def test_writes_group_into_few_statements() -> None:
    fence = " AND state IN ('RUNNING')"
    many = " AND (state || '') IN ('RUNNING')"
    same = [Write("DELETE FROM jobs", (), (), i, fence, (), many) for i in (1, 2)]
    ((statement, args),) = held_writes.batches(same, "%s", arrays=True)
    assert statement == f"DELETE FROM jobs WHERE jobID = ANY(%s::bigint[]){many}"
    assert args == [["{1,2}"]]
    ((statement, args),) = held_writes.batches(same, "?", arrays=False)
    assert args == [[1], [2]]
    leases = [Write("UPDATE jobs SET leaseID = %s", ("leaseID",), (f"L{i}",), i) for i in (1, 2)]
    ((statement, args),) = held_writes.batches(leases, "%s", arrays=True)
    assert "jsonb_array_elements" in statement and args == [['[[1,"L1"],[2,"L2"]]', "{1,2}"]]
    twice = [*same, Write("DELETE FROM jobs", (), (), 1, fence)]
    assert len(held_writes.batches(twice, "%s", arrays=True)) == 2
    # New jobs: one COPY of their rows on PostgreSQL; an upsert elsewhere
    # keeps its statement.
    new = [Write("INSERT", ("name", "jobID"), (f"n{i}", i), i, insert=True) for i in (1, 2)]
    ((statement, args),) = held_writes.batches(new, "%s", arrays=True)
    assert (statement, args) == ("COPY jobs (name, jobID) FROM STDIN", [[[("n1", 1), ("n2", 2)]]])
    ((statement, args),) = held_writes.batches(new, "?", arrays=False)
    assert args == [["n1", 1], ["n2", 2]]
    kept = [Write("INSERT", ("jobID",), (i,), i, insert=True, table="outcomes",
                  on_conflict=" ON CONFLICT DO NOTHING") for i in (1, 2)]
    ((statement, args),) = held_writes.batches(kept, "%s", arrays=True)
    assert "jsonb_array_elements" in statement


def test_many_rows_keep_every_value_byte_for_byte(store: Storage) -> None:
    # With COPY's own escapes among them (a tab, a line break, a carriage
    # return, a backslash, and `\\N`, its NULL), and JSON's.
    texts = [
        '{"q":"\\"\'}', "ünïcödé ✓", "a\tb\nc", "", "'; DROP TABLE jobs; --", "\\N", "x\\y\rz",
        '{"n":"\\u0000"}',
    ]
    with transaction(store), store.holding_writes():
        store.reserve_ids(len(texts))
        ids = [
            store.create([job(f"t{i}", data=t)], created=PAST, state=State.QUEUED)[0]
            for i, t in enumerate(texts)
        ]
    with transaction(store), store.holding_writes():
        found = store.find_ready(now=NOW, priorities=[500], limit=10, patterns=["t*"])
        for row in found:
            text = texts[ids.index(row.jobID)]
            store.set_state_if([row.jobID], [State.QUEUED], State.RUNNING, JobChanges(leaseID=text))
    for i, row in enumerate(rows(store, ids)):
        assert row is not None and (row.data, row.leaseID, row.state) == (
            texts[i],
            texts[i],
            "RUNNING",
        )


def test_many_rows_keep_every_number_exactly(store: Storage) -> None:
    # Rows of different values go as one JSON parameter (jsonb on
    # PostgreSQL, whose numbers are decimal): each float and integer must
    # come back as written.
    delays = [0.1, 1e-07, 1e16, 3600.0, 2.5e-320, 1.7976931348623157e308]
    big = [2**31 - 1, 2**30, 7, 0, 1, 12345]
    ids = create(store, *(job(f"n{i}") for i in range(len(delays))))
    with transaction(store), store.holding_writes():
        store.hold(ids)
        for job_id, delay, attempts in zip(ids, delays, big, strict=True):
            store.amend([job_id], JobChanges(retryDelay=delay, attempts=attempts))
    got = [(row.retryDelay, row.attempts) for row in rows(store, ids) if row is not None]
    assert got == list(zip(delays, big, strict=True))
    # New jobs' rows as well (COPY on PostgreSQL, its numbers as text).
    policies = [RetryPolicy(a, "", d, d) for a, d in zip(big, delays, strict=True)]
    with transaction(store), store.holding_writes():
        store.reserve_ids(len(policies))
        made = [
            store.create([job(f"p{i}", policy=p)], created=PAST, state=State.QUEUED)[0]
            for i, p in enumerate(policies)
        ]
    got = [(row.maxAttempts, row.retryDelay) for row in rows(store, made) if row is not None]
    assert got == list(zip(big, delays, strict=True))


# The property: held or not, the same answers and the same rows.

RUNS = itertools.count()
STATES = [State.QUEUED, State.RUNNING, State.FAILED]
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("move"),
            st.integers(0, 1),
            st.sampled_from(STATES[:2]),
            st.sampled_from(STATES),
            st.sampled_from([None, "L", "M"]),
        ),
        st.tuples(st.just("amend"), st.integers(0, 1), st.text("ab", max_size=3)),
        st.tuples(st.just("delete"), st.integers(0, 1), st.sampled_from([None, *STATES])),
        st.tuples(st.just("get"), st.integers(0, 1)),
        st.tuples(st.just("failed")),
        st.tuples(st.just("children"), st.integers(0, 1)),
        st.tuples(st.just("savepoint")),
        st.tuples(st.just("rollback")),
        st.tuples(st.just("release")),
    ),
    max_size=25,
)


def run(
    store: Storage, ids: list[int], names: list[str], ops: list[tuple[Any, ...]], held: bool
) -> list[Any]:
    """The operations' answers, with jobIDs as indexes into `ids`."""
    answers: list[Any] = []
    depth = 0
    with transaction(store), store.holding_writes() if held else nullcontext():
        if held:
            store.hold(ids)
        for op in ops:
            answers.append(_apply(store, ids, names, op, depth))
            if op[0] == "savepoint" and depth == 0:
                depth = 1
            elif op[0] in ("rollback", "release") and depth:
                depth = 0
        if depth:
            store.release("element")
    return answers


def _apply(
    store: Storage, ids: list[int], names: list[str], op: tuple[Any, ...], depth: int
) -> Any:
    kind = op[0]
    if kind == "move":
        _, i, source, target, lease = op
        moved = store.set_state_if(
            [ids[i]], [source], target, JobChanges(leaseID=lease or ""), lease=lease
        )
        return [ids.index(m) for m in moved]
    if kind == "amend":
        return [ids.index(m) for m in store.amend([ids[op[1]]], JobChanges(data=op[2]))]
    if kind == "delete":
        states = None if op[2] is None else [op[2]]
        return [ids.index(m) for m in store.delete([ids[op[1]]], states)]
    if kind == "get":
        row = store.get(ids[op[1]])
        return None if row is None else (row.state, row.data, row.leaseID)
    if kind == "failed":
        # A plain statement, which must see every write before it.
        failed = store.failed(pattern=None, names=names, limit=10)
        return [ids.index(j.jobID) for j in failed]
    if kind == "children":
        # A statement that may change jobs: the held copies are forgotten
        # and what follows goes to the database, inside the savepoint.
        return store.delete_children(ids[op[1]], [State.FINISHED])
    if kind == "savepoint":
        if depth == 0:
            store.savepoint("element")
        return None
    if depth:
        if kind == "rollback":
            store.rollback_savepoint("element")
        else:
            store.release("element")
    return None


def fields(row: Job | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {k: v for k, v in asdict(row).items() if k not in ("jobID", "name")}


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations)
def test_held_or_not_the_same_answers_and_rows(store: Storage, ops: list[Any]) -> None:
    outcomes = []
    for held in (False, True):
        names = [f"run{next(RUNS)}.{i}" for i in range(4)]
        ids = create(store, *(job(name) for name in names))
        with transaction(store):
            store.set_state_if(ids[2:], [State.QUEUED], State.RUNNING, JobChanges(leaseID="L"))
        answers = run(store, ids, names, ops, held)
        outcomes.append((answers, [fields(r) for r in rows(store, ids)]))
    assert outcomes[0] == outcomes[1]


def test_a_savepoint_with_nothing_held_yet_reaches_the_database_too(store: Storage) -> None:
    parent, other = create(store, job("p"), job("o"))
    with transaction(store), store.holding_writes():
        store.hold([parent, other])
        store.savepoint("element")
        # A statement that may change jobs, with no held write before it:
        # the savepoint goes first, and what follows is inside it.
        assert store.delete_children(parent, [State.FINISHED]) == 0
        store.set_state_if([other], [State.QUEUED], State.CANCELLED)
        store.rollback_savepoint("element")
    (row,) = rows(store, [other])
    assert row is not None and row.state == State.QUEUED


def test_savepoints_with_nothing_inside_and_nested_ones(store: Storage) -> None:
    first, second = create(store, job("a"), job("b"))
    with transaction(store):
        # Nothing runs inside the first two.
        store.savepoint("request")
        store.rollback_savepoint("request")
        store.savepoint("request")
        store.release("request")
        store.savepoint("request")
        store.set_state_if([first], [State.QUEUED], State.CANCELLED)
        store.savepoint("element")
        store.set_state_if([second], [State.QUEUED], State.CANCELLED)
        store.rollback_savepoint("element")
        store.release("request")
        store.savepoint("request")
        store.amend([second], JobChanges(data='{"undone":1}'))
        store.rollback_savepoint("request")
    a, b = rows(store, [first, second])
    assert a is not None and a.state == State.CANCELLED
    assert b is not None and (b.state, b.data) == (State.QUEUED, "{}")


def test_jobids_asked_for_in_advance_are_taken_a_chunk_at_a_time(store: Storage) -> None:
    # A CreateJobs of a million elements asks for a million: none are taken
    # before its first job is created, and no more than a chunk at once.
    (before,) = create(store, job("before"))
    with transaction(store), store.holding_writes():
        store.reserve_ids(1_000_000)
    (after,) = create(store, job("after"))
    assert after == before + 1
    with transaction(store), store.holding_writes():
        store.reserve_ids(1_000_000)
        made = [store.create([job(f"m{i}")], created=PAST, state=State.QUEUED)[0] for i in (0, 1)]
    (last,) = create(store, job("last"))
    assert made == [after + 1, after + 2]
    assert last - made[-1] <= RESERVE_CHUNK


@pytest.mark.parametrize(
    ("before", "after"), [(1, 0), (STREAMED, 0), (0, STREAMED)],
    ids=["held", "sent-ahead", "first-sent"],
)
def test_a_copy_that_fails_in_python_counts_as_a_failed_statement(
    backend: str, db: Path | str, before: int, after: int
) -> None:
    # A name no encoding holds (a lone surrogate, which UTF-8 refuses): the
    # COPY of new jobs fails in psycopg's encoding, and PostgreSQL aborts
    # the transaction: a change must be counted, or the writer, seeing a
    # request that changed nothing, commits its batch's other requests into
    # a spoiled transaction (found by a review: 300 of 1,741 answered 503).
    # The name is held to the end, or sent ahead in an open COPY (postgres_
    # statements.STREAM_AFTER) after rows that were, or as its first row.
    if backend != "postgres":
        pytest.skip("COPY is PostgreSQL's")
    store = PostgresStore(str(db))
    try:
        store.begin()
        changes = store.total_changes
        names = [*(f"a{i}" for i in range(before)), "a\ud800b", *(f"z{i}" for i in range(after))]
        with pytest.raises(psycopg.DataError, match="cannot hold"), store.holding_writes():
            store.reserve_ids(before + 1 + after)
            for name in names:
                padded = job(name, data=f'{{"p":"{PAD}"}}')
                store.create([padded], created=PAST, state=State.QUEUED)
        assert store.total_changes != changes
        store.rollback()
    finally:
        store.close()
