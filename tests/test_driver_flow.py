"""The storage driver's own suite, continued (test_driver.py says what it
is): replies, concurrency limits and their usage, paused patterns,
retention, the readers on connections of their own, and, on PostgreSQL,
what two nodes' transactions must not do to each other."""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pg
import pytest
from driver import LATER, NOW, PAST, another_store, create, job, transaction

from jobserver import storage
from jobserver.model.jobs import FlowOptions, JobChanges, State
from jobserver.model.limits import Limit, Rate
from jobserver.storage import sql
from jobserver.storage.interface import Storage
from jobserver.storage.postgres import PostgresStore

pytestmark = pytest.mark.backends()


# Replies (protocol.md 14.12).


def test_waiting_on_finds_the_waiting_job_of_a_key(store: Storage) -> None:
    waiting, other = create(store, job("w"), job("x"))
    with transaction(store):
        assert store.waiting_on("k") is None
        store.set_state_if(
            [waiting], [State.QUEUED], State.WAITING, JobChanges(replyKey="k", nextRun=LATER)
        )
        store.amend([other], JobChanges(replyKey="k"))
        found = store.waiting_on("k")
    assert found is not None and found.jobID == waiting


def test_kept_replies_expire_are_claimed_and_replaced(store: Storage) -> None:
    with transaction(store):
        assert store.reply("k", NOW) is None
        store.keep_reply("k", '{"r":1}', PAST, LATER, 0)
        store.keep_reply("old", "{}", PAST, PAST, 0)
        assert store.early_replies(NOW) == 1
        assert store.reply("k", NOW) == ('{"r":1}', 0)
        store.claim_reply("k", 7)
        assert store.reply("k", NOW) == ('{"r":1}', 7)
        assert store.early_replies(NOW) == 0
        store.keep_reply("k", '{"r":2}', NOW, LATER, 0)
        assert store.reply("k", NOW) == ('{"r":2}', 0)
        # An expired reply is gone once asked for.
        assert store.reply("old", NOW) is None
        assert store.prune_replies(LATER, 10) == 1
        assert store.reply("k", PAST) is None


def test_prune_replies_in_batches_oldest_first(store: Storage) -> None:
    with transaction(store):
        for n, expires in enumerate(("2030-01-01 00:00:03", PAST, "2030-01-01 00:00:02")):
            store.keep_reply(f"k{n}", "{}", PAST, expires, 0)
        assert store.prune_replies(NOW, 2) == 2
        assert store.reply("k0", PAST) is not None
        assert store.prune_replies(NOW, 2) == 1
        assert store.prune_replies(NOW, 2) == 0


# Idempotency keys (protocol.md 14.22).


def test_idempotency_keys_are_kept_until_they_expire_and_replaced_after(store: Storage) -> None:
    with transaction(store):
        assert store.idempotent("k", NOW) is None
        store.keep_idempotent("k", "f1", '{"jobID":1}', LATER)
        store.keep_idempotent("old", "f2", '{"jobID":2}', PAST)
        assert store.idempotent("k", NOW) == ("f1", '{"jobID":1}')
        # Expired: as if never kept, and kept anew over it.
        assert store.idempotent("old", NOW) is None
        store.keep_idempotent("old", "f3", '{"jobIDs":[3]}', LATER)
        assert store.idempotent("old", NOW) == ("f3", '{"jobIDs":[3]}')
        assert store.idempotent("k", LATER) is None


def test_prune_idempotency_in_batches_oldest_first(store: Storage) -> None:
    with transaction(store):
        for n, expires in enumerate(("2030-01-01 00:00:03", PAST, "2030-01-01 00:00:02", LATER)):
            store.keep_idempotent(f"k{n}", "f", "{}", expires)
        assert store.prune_idempotency(NOW, 2) == 2
        assert store.idempotent("k0", PAST) is not None
        assert store.prune_idempotency(NOW, 2) == 1
        assert store.prune_idempotency(NOW, 2) == 0
        assert store.idempotent("k3", NOW) is not None


def test_overdue_waiting_jobs_earliest_first(store: Storage) -> None:
    late, early, future = create(store, job("a"), job("b"), job("c"))
    deadlines = {late: "2030-01-01 00:00:05", early: "2030-01-01 00:00:01", future: LATER}
    with transaction(store):
        for job_id, deadline in deadlines.items():
            store.set_state_if(
                [job_id], [State.QUEUED], State.WAITING,
                JobChanges(replyKey=f"k{job_id}", nextRun=deadline),
            )
        assert [j.jobID for j in store.overdue(NOW, 10)] == [early, late]
        assert [j.jobID for j in store.overdue(NOW, 1)] == [early]


# Concurrency limits and their usage (protocol.md 14.7, 14.8).


def test_limits_are_stored_removed_and_survive_a_reopening(
    store: Storage, backend: str, db: Path | str
) -> None:
    with transaction(store):
        store.set_limit("a/*", Limit(3))
        store.set_limit("b", Limit(1))
        store.set_limit("b", Limit(2, Rate(5, 60_000), per_key=True, fair=True))
    assert store.limits == {"a/*": Limit(3), "b": Limit(2, Rate(5, 60_000), True, True)}
    with transaction(store):
        store.set_limit("a/*", Limit())
    assert store.limits == {"b": Limit(2, Rate(5, 60_000), True, True)}
    with another_store(backend, db) as reopened:
        assert reopened.limits == {"b": Limit(2, Rate(5, 60_000), True, True)}


def test_a_rollback_restores_limits_and_pauses(store: Storage) -> None:
    with transaction(store):
        store.set_limit("kept", Limit(1))
        store.pause("kept")
    store.begin()
    store.set_limit("new", Limit(1))
    store.set_limit("kept", Limit())
    store.pause("new")
    assert store.resume("kept")
    store.rollback()
    assert (store.limits, store.paused) == ({"kept": Limit(1)}, frozenset({"kept"}))
    with transaction(store):
        store.savepoint()
        store.pause("undone")
        store.rollback_savepoint()
    assert store.paused == frozenset({"kept"})


def test_usage_counts_running_and_unexpired_leases_by_cost(store: Storage) -> None:
    running, leased, expired, queued, other = create(
        store,
        job("a/1", flow=FlowOptions(cost=3)),
        job("a/2", flow=FlowOptions(cost=2)),
        job("a/3", flow=FlowOptions(cost=5)),
        job("a/4"),
        job("b/1"),
    )
    with transaction(store):
        store.set_state_if([running, other], [State.QUEUED], State.RUNNING)
        store.set_state_if([leased], [State.QUEUED], State.RUNQUEUED, JobChanges(nextRun=LATER))
        store.set_state_if([expired], [State.QUEUED], State.RUNQUEUED, JobChanges(nextRun=PAST))
        store.hold_limits()
        assert store.usage("a/*", NOW) == 5
        assert store.usage("a/1", NOW) == 3
        assert store.usage("a/[12]", LATER) == 3
        assert store.usage("*", NOW) == 6
        assert store.usage("c", NOW) == 0
    assert queued


# Paused patterns (protocol.md 14.9).


def test_pause_and_resume(store: Storage, backend: str, db: Path | str) -> None:
    with transaction(store):
        store.pause("a/*")
        store.pause("a/*")
        store.pause("b")
    assert store.paused == frozenset({"a/*", "b"})
    with transaction(store):
        assert store.resume("b")
        assert not store.resume("b")
    with another_store(backend, db) as reopened:
        assert reopened.paused == frozenset({"a/*"})


# Retention (protocol.md 14.10).


def test_prune_takes_standalone_ended_jobs_of_a_state_oldest_first(store: Storage) -> None:
    oldest, newer, recent = (
        create(store, job("f"), state=State.FINISHED, ended=ended)[0]
        for ended in ("2030-01-01 00:00:01", "2030-01-01 00:00:02", LATER)
    )
    (failed,) = create(store, job("x"), state=State.FAILED, ended=PAST)
    (parent,) = create(store, job("p"))
    (child,) = create(store, job("c", parent_id=parent), state=State.FINISHED, ended=PAST)
    (queued,) = create(store, job("q"), state=State.QUEUED, ended=PAST)
    with transaction(store):
        assert store.prune(State.FINISHED, NOW, 1) == 1
        assert store.get(oldest) is None and store.get(newer) is not None
        assert store.prune(State.FINISHED, NOW, 10) == 1
        assert store.prune(State.FINISHED, NOW, 10) == 0
        assert store.prune(State.QUEUED, NOW, 10) == 0
        assert store.get(recent) is not None and store.get(child) is not None
        assert store.get(queued) is not None
        assert store.prune(State.FAILED, NOW, 10) == 1
        assert store.get(failed) is None
        store.reclaim_space(True)


def test_prune_pending_reads_on_its_own_connection(store: Storage) -> None:
    assert not store.prune_pending({"FINISHED": NOW}, NOW)
    create(store, job("f"), state=State.FINISHED, ended=PAST)
    assert store.prune_pending({"FINISHED": NOW}, NOW)
    assert not store.prune_pending({"FAILED": NOW}, NOW)
    with transaction(store):
        store.keep_reply("k", "{}", PAST, PAST, 0)
    assert store.prune_pending({}, NOW)


# Readers on connections of their own.


def test_find_matching_running_by_name_and_queue_stats(store: Storage) -> None:
    a1, a2, b1 = create(store, job("q/a"), job("q/a", LATER), job("r/b"))
    with transaction(store):
        store.set_state_if([a1], [State.QUEUED], State.RUNNING)
        store.pause("r/*")
    assert [j.jobID for j in store.find_matching("q/*", 10)] == [a2, a1]
    assert [j.jobID for j in store.find_matching("r/b", 10)] == [b1]
    assert store.running_by_name(NOW) == [("q/a", "", 1)]
    counts, oldest, held = store.queue_stats(NOW)
    assert counts == {("q", "RUNNING"): 1, ("q", "QUEUED"): 1, ("r", "QUEUED"): 1}
    assert (oldest, held) == ({}, {"r": 1})


def test_running_by_name_and_key_and_the_busiest_key_of_each_rate_window(
    store: Storage,
) -> None:
    ids = create(
        store,
        job("m/x", flow=FlowOptions(cost=2, key="k1")),
        job("m/x", flow=FlowOptions(key="k2")),
        job("m/x", flow=FlowOptions(key="k2")),
    )
    with transaction(store):
        store.set_state_if(ids, [State.QUEUED], State.RUNNING)
        for at in ("2030-01-01 00:00:01", "2030-01-01 00:00:05", "2030-01-01 00:00:06"):
            store.note_handout("m/*", "k1", at, PAST)
        store.note_handout("m/*", "k2", "2030-01-01 00:00:07", PAST)
        store.note_handout("all", "", "2030-01-01 00:00:02", PAST)
        store.note_handout("zz", "", "2030-01-01 00:00:02", PAST)
    assert sorted(store.running_by_name(NOW)) == [("m/x", "k1", 2), ("m/x", "k2", 2)]
    # A window holds the hand-outs after its start; of its busiest key.
    assert store.handouts_in_windows({"m/*": "2030-01-01 00:00:01", "all": PAST}) == {
        "m/*": 2, "all": 1
    }
    assert store.handouts_in_windows({"all": "2030-01-01 00:00:02", "none": PAST}) == {}
    # More rates than one statement reads: "zz" is read by the second.
    many = {f"p{n}": PAST for n in range(sql.WINDOWS_PER_STATEMENT)}
    assert store.handouts_in_windows({**many, "zz": PAST, "all": PAST}) == {"all": 1, "zz": 1}


# Two nodes on one PostgreSQL schema.


@pytest.fixture
def two_nodes() -> Iterator[tuple[PostgresStore, PostgresStore]]:
    with pg.fresh_schema() as url:
        first, second = PostgresStore(url), PostgresStore(url)
        try:
            yield first, second
        finally:
            first.close()
            second.close()


def test_a_hand_out_skips_the_jobs_another_node_locked(
    two_nodes: tuple[PostgresStore, PostgresStore],
) -> None:
    first, second = two_nodes
    ids = create(first, *(job("a") for _ in range(4)))
    query = {"now": NOW, "priorities": [500], "limit": 2, "patterns": ["a"]}
    first.begin()
    try:
        taken = [j.jobID for j in first.find_ready(**query)]  # type: ignore[arg-type]
        with transaction(second):
            others = [j.jobID for j in second.find_ready(**query)]  # type: ignore[arg-type]
    finally:
        first.rollback()
    assert taken == ids[:2] and others == ids[2:]


def test_a_fenced_move_after_another_nodes_move_changes_nothing(
    two_nodes: tuple[PostgresStore, PostgresStore],
) -> None:
    """Both read a FAILED job; the first requeues it; the second's move,
    which waited for the first's lock, finds it no longer FAILED."""
    first, second = two_nodes
    (job_id,) = create(first, job("a"), state=State.FAILED)
    first.begin()
    assert first.set_state_if([job_id], [State.FAILED], State.QUEUED) == [job_id]
    moved: list[list[int]] = []
    second.begin()
    waiter = threading.Thread(
        target=lambda: moved.append(
            second.set_state_if([job_id], [State.FAILED], State.CANCELLED)
        )
    )
    waiter.start()
    first.commit()
    waiter.join(10)
    second.commit()
    assert moved == [[]]
    with transaction(first):
        row = first.get(job_id)
    assert row is not None and row.state == "QUEUED"


def test_limits_set_on_one_node_hold_on_another_from_its_next_transaction(
    two_nodes: tuple[PostgresStore, PostgresStore],
) -> None:
    first, second = two_nodes
    with transaction(first):
        first.set_limit("a", Limit(2))
        first.pause("b")
    with transaction(second):
        assert (second.limits, second.paused) == ({"a": Limit(2)}, frozenset({"b"}))


def test_only_one_node_prunes_at_a_time(
    two_nodes: tuple[PostgresStore, PostgresStore],
) -> None:
    first, second = two_nodes
    create(first, job("f"), job("g"), state=State.FINISHED, ended=PAST)
    first.begin()
    try:
        assert first.prune(State.FINISHED, NOW, 1) == 1
        with transaction(second):
            assert second.prune(State.FINISHED, NOW, 10) == 0
    finally:
        first.commit()
    with transaction(second):
        assert second.prune(State.FINISHED, NOW, 10) == 1


# The driver's shape.

STORAGE = Path(storage.__file__).parent
# The stored formats: their text is what files and databases hold.
SCHEMAS = (
    "sqlite_schema.py", "postgres_schema.py", "postgres_migrations.py", "postgres_functions.py",
)


def test_storage_imports_nothing_of_the_core() -> None:
    for module in STORAGE.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = (
                [node.module or ""] if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            )
            assert not [n for n in names if n.startswith("jobserver.core")], module.name


def test_no_state_is_written_as_sql_text_outside_the_schemas() -> None:
    """State lists in SQL come from model/jobs.py's State (storage/sql.py)."""
    quoted = re.compile("'(" + "|".join(State) + ")'")
    for module in STORAGE.glob("*.py"):
        if module.name not in SCHEMAS:
            assert not quoted.search(module.read_text()), module.name


def test_a_column_outside_job_changes_cannot_be_written() -> None:
    with pytest.raises(TypeError):
        JobChanges(**{"state": "QUEUED"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        JobChanges(**{"jobID": 1})  # type: ignore[arg-type]



# Each pair: what the first node takes, then what the second must wait for.
ONE_AT_A_TIME = {
    "limits' usage": (lambda s: s.hold_limits(), lambda s: s.hold_limits()),
    "a unique name": (lambda s: s.find_by_name("n"), lambda s: s.find_by_name("n")),
    # DeliverReply against AwaitReply: a reply's key and a waiting job's
    # are one lock.
    "a reply key": (lambda s: s.reply("k", NOW), lambda s: s.waiting_on("k")),
}


@pytest.mark.parametrize("decision", ONE_AT_A_TIME)
def test_decisions_that_read_before_they_write_are_taken_one_node_at_a_time(
    two_nodes: tuple[PostgresStore, PostgresStore], decision: str
) -> None:
    first, second = two_nodes
    first_takes, second_takes = ONE_AT_A_TIME[decision]
    done = threading.Event()

    def second_node() -> None:
        with transaction(second):
            second_takes(second)
            done.set()

    first.begin()
    first_takes(first)
    waiter = threading.Thread(target=second_node)
    waiter.start()
    assert not done.wait(0.5)
    first.commit()
    waiter.join(10)
    assert done.is_set()
