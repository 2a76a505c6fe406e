"""The storage driver's own suite, in the way of River's riverdrivertest:
every named operation of storage/interface.py, called directly, on every
backend (a real SQLite file, a real PostgreSQL schema), with the edge
cases the commands rely on. A new backend is complete when it passes this
module and test_driver_flow.py.

This module: writing jobs (creation, fenced state changes, amendments,
reports, deletion), reading them (by ID and name, the hand-out search and
its order, failed jobs), parents and children, and the clock's questions.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from driver import LATER, NOW, PAST, another_store, create, job, transaction

from jobserver.model.jobs import (
    ACTIVE,
    ENDED_CHILDREN,
    FinishedRun,
    FlowOptions,
    JobChanges,
    JobOutcome,
    OutcomesKept,
    RetryPolicy,
    State,
)
from jobserver.storage.interface import Storage
from jobserver.storage.searches import PassedOver

pytestmark = pytest.mark.backends()

ALL = tuple(State)


def ready(store: Storage, **asked: object) -> list[int]:
    """The jobIDs find_ready hands out, in its order: of every name, unless
    `asked` gives patterns or names."""
    query: dict[str, object] = {
        "now": NOW, "priorities": [1000, 500, 0], "limit": 100,
        "patterns": [] if "names" in asked else ["*"],
    }
    with transaction(store):
        return [j.jobID for j in store.find_ready(**{**query, **asked})]  # type: ignore[arg-type]


# Creating.


def test_create_returns_the_ids_in_order_and_stores_every_field(store: Storage) -> None:
    policy = RetryPolicy(max_attempts=3, backoff="exponential", delay=1.5, max_delay=60.0)
    flow = FlowOptions(cost=2, windows="Mon 09:00-17:00", zone="Europe/Paris")
    first, second, third = create(
        store,
        job("plain"),
        job("policy", priority=1000, retry_after="+1 MINUTE", policy=policy, data='{"a":1}'),
        job("flow", flow=flow, policy=policy),
    )
    assert first < second < third
    with transaction(store):
        plain, with_policy, with_flow = (store.get(i) for i in (first, second, third))
    assert plain is not None and with_policy is not None and with_flow is not None
    assert (plain.state, plain.name, plain.nextRun) == ("QUEUED", "plain", PAST)
    assert plain.created == PAST
    assert (plain.cost, plain.maxAttempts, plain.lastRun, plain.ended) == (1, 0, None, "")
    assert (with_policy.priority, with_policy.retryAfter, with_policy.data) == (
        1000, "+1 MINUTE", '{"a":1}'
    )
    assert (with_policy.maxAttempts, with_policy.retryBackoff) == (3, "exponential")
    assert (with_policy.retryDelay, with_policy.retryMaxDelay) == (1.5, 60.0)
    assert (with_flow.cost, with_flow.timeWindows, with_flow.timeZone) == (
        2, "Mon 09:00-17:00", "Europe/Paris"
    )
    assert with_flow.maxAttempts == 3


def test_create_in_a_state_with_an_end(store: Storage) -> None:
    (job_id,) = create(store, job(), state=State.FINISHED, ended=PAST)
    with transaction(store):
        found = store.get(job_id)
    assert found is not None and (found.state, found.ended) == ("FINISHED", PAST)


def test_get_of_a_missing_job_is_none(store: Storage) -> None:
    with transaction(store):
        assert store.get(12345) is None


def test_a_rolled_back_create_leaves_nothing(store: Storage) -> None:
    store.begin()
    (job_id,) = store.create([job()], created=PAST, state="QUEUED")
    store.rollback()
    with transaction(store):
        assert store.get(job_id) is None


# Fenced state changes.


def test_set_state_if_moves_only_jobs_in_an_expected_state(store: Storage) -> None:
    queued = create(store, job("a"), job("b"))
    (paused,) = create(store, job("c"), state=State.PAUSED)
    with transaction(store):
        moved = store.set_state_if(
            [*queued, paused], [State.QUEUED], State.RUNNING,
            JobChanges(lastRun=NOW, leaseID="L1", lastReport=NOW),
        )
        rows = {i: store.get(i) for i in (*queued, paused)}
    assert sorted(moved) == queued
    for i in queued:
        row = rows[i]
        assert row is not None
        assert (row.state, row.lastRun, row.leaseID, row.lastReport) == ("RUNNING", NOW, "L1", NOW)
    still = rows[paused]
    assert still is not None and (still.state, still.leaseID) == ("PAUSED", "")


def test_set_state_if_is_fenced_by_the_lease(store: Storage) -> None:
    job_id, other = create(store, job("a"), job("b"))
    with transaction(store):
        store.set_state_if([job_id], [State.QUEUED], State.RUNQUEUED, JobChanges(leaseID="mine"))
        store.set_state_if([other], [State.QUEUED], State.RUNQUEUED, JobChanges(leaseID="theirs"))
        assert store.set_state_if([job_id, other], ACTIVE, State.QUEUED, lease="mine") == [job_id]
        assert store.set_state_if([other], ACTIVE, State.QUEUED, lease="mine") == []
        back, kept = store.get(job_id), store.get(other)
    assert back is not None and back.state == "QUEUED"
    assert kept is not None and (kept.state, kept.leaseID) == ("RUNQUEUED", "theirs")


def test_set_state_if_in_place_and_every_column(store: Storage) -> None:
    (job_id,) = create(store, job())
    changes = JobChanges(
        name="renamed", nextRun=LATER, lastRun=None, repeat="FINISHED, +1 HOUR", data='{"x":2}',
        priority=0, retryAfter="+5 MINUTES", attempts=2, lastError="boom", leaseID="L",
        ended=NOW, replyKey="k", lastReport=NOW,
    )
    with transaction(store):
        assert store.set_state_if([job_id], [State.QUEUED], State.QUEUED, changes) == [job_id]
        row = store.get(job_id)
    assert row is not None
    assert {c: getattr(row, c) for c in changes.columns()} == changes.columns()
    assert row.state == "QUEUED"


def test_set_state_if_of_no_jobs_or_a_missing_one(store: Storage) -> None:
    with transaction(store):
        assert store.set_state_if([], ALL, State.QUEUED) == []
        assert store.set_state_if([999], ALL, State.QUEUED) == []


def test_a_state_must_be_one_of_the_model(store: Storage) -> None:
    (job_id,) = create(store, job())
    with transaction(store), pytest.raises(ValueError):
        store.set_state_if([job_id], [State.QUEUED], "DONE")


@pytest.mark.parametrize("held", [False, True])
def test_hand_out_plain_writes_what_set_state_if_writes(store: Storage, held: bool) -> None:
    plain, twin, running = create(store, job("a"), job("a"), job("a"))
    changes = JobChanges(
        lastRun=PAST, leaseID="L", lastReport=NOW, worker="1.2.3.4:5", node="n"
    )
    with transaction(store), store.holding_writes():
        store.set_state_if([running], [State.QUEUED], State.RUNNING)
        if held:
            store.hold([plain, twin, running])
        assert store.hand_out_plain(plain, "L", "1.2.3.4:5", "n", PAST, NOW) is True
        assert store.set_state_if([twin], [State.QUEUED], State.RUNNING, changes) == [twin]
        # Only a QUEUED job moves.
        assert store.hand_out_plain(running, "M", "w", "n", PAST, NOW) is False
        # Read back as the transaction left them (from the held copies, if held).
        inside = [store.get(plain), store.get(twin)]
    after = [store.get(plain), store.get(twin), store.get(running)]
    for rows in (inside, after[:2]):
        first, second = rows
        assert first is not None and second is not None
        assert replace(first, jobID=second.jobID) == second
        assert (first.state, first.leaseID, first.worker, first.lastReport) == (
            State.RUNNING, "L", "1.2.3.4:5", NOW
        )
    assert after[2] is not None and after[2].leaseID == ""


def test_amend_changes_columns_and_never_the_state(store: Storage) -> None:
    (job_id,) = create(store, job())
    (done,) = create(store, job("b"), state=State.FAILED)
    with transaction(store):
        changed = store.amend([job_id, done], JobChanges(data='{"new":1}', priority=1000))
        rows = [store.get(job_id), store.get(done)]
    assert sorted(changed) == [job_id, done]
    assert [(r.state, r.data, r.priority) for r in rows if r] == [
        ("QUEUED", '{"new":1}', 1000), ("FAILED", '{"new":1}', 1000)
    ]
    # A priority given later is handed out at that priority.
    assert ready(store, priorities=[1000]) == [job_id]


def test_note_report_touches_running_jobs_only(store: Storage) -> None:
    running, queued = create(store, job("a"), job("b"))
    with transaction(store):
        store.set_state_if([running], [State.QUEUED], State.RUNNING)
        assert store.note_report([running, queued], LATER) == [running]
        row, other = store.get(running), store.get(queued)
    assert row is not None and row.lastReport == LATER
    assert other is not None and other.lastReport == ""


def test_delete_is_fenced_by_state(store: Storage) -> None:
    queued, failed = create(store, job("a"), job("b"))
    with transaction(store):
        store.set_state_if([failed], [State.QUEUED], State.FAILED)
        assert store.delete([queued, failed], [State.FAILED]) == [failed]
        assert store.get(failed) is None and store.get(queued) is not None
        assert store.delete([queued, 999]) == [queued]
        assert store.delete([]) == []


def test_finish_plain_runs_deletes_only_runs_with_nothing_more_to_do(store: Storage) -> None:
    plain, leased, repeating, parent, cancelling, counted, queued, depended = create(
        store, job("a", data='{"x":1}'), job("a"), job("a"), job("a"), job("a"),
        job("a", data='{"retryAfterCount":1}'), job("a"), job("a"),
    )
    (child,) = create(store, job("a", parent_id=parent))
    (dependent,) = create(store, replace(job("a"), dependencies=1, blockers=0))
    (waiter,) = create(store, replace(job("w"), dependencies=1, blockers=1), state=State.BLOCKED)
    running = [plain, leased, repeating, child, parent, cancelling, counted, depended, dependent]
    with transaction(store):
        store.add_dependencies([(waiter, depended), (dependent, queued)])
        store.set_state_if(running, [State.QUEUED], State.RUNNING, JobChanges(leaseID="L"))
        store.amend([repeating], JobChanges(repeat="FINISHED, +1 HOUR"))
        store.amend([cancelling], JobChanges(cancelRequested=1))
        others = (repeating, child, parent, cancelling, counted, queued, depended, dependent)
        store.amend([leased], JobChanges(awaited=1, lastError="once"))
        runs = [(plain, None), (leased, "L"), (leased, "L"), (999, None), (plain, "notits")]
        finished = store.finish_plain_runs(
            [*runs, *((j, None) for j in others)], [plain, leased, 999, *others],
            OutcomesKept(NOW, LATER, LATER),
        )
    if store.dialect.returning:
        assert sorted(finished) == [FinishedRun(plain, "a", False), FinishedRun(leased, "a", True)]
        with transaction(store):
            # Their outcomes, kept by the same statement.
            assert store.job_outcome(plain, NOW) == JobOutcome(
                plain, "a", State.FINISHED, '{"x":1}', "", NOW, LATER
            )
            assert store.job_outcome(leased, NOW) == JobOutcome(
                leased, "a", State.FINISHED, "{}", "once", NOW, LATER
            )
            assert store.job_outcome(queued, NOW) is None
    else:
        # SQLite finishes none this way: the caller takes the long way.
        assert finished == []
    with transaction(store):
        assert [store.get(j) is None for j in (plain, leased)] == [bool(finished)] * 2
        assert all(store.get(j) is not None for j in others)
        assert store.finish_plain_runs([], [plain], OutcomesKept(NOW, LATER, LATER)) == []


def test_finish_plain_runs_keeps_only_awaited_outcomes_when_told_to(store: Storage) -> None:
    if not store.dialect.returning:
        pytest.skip("SQLite finishes every run the long way")
    plain, awaited = create(store, job("a"), job("b"))
    with transaction(store):
        store.set_state_if([plain, awaited], [State.QUEUED], State.RUNNING)
        store.amend([awaited], JobChanges(awaited=1))
        finished = store.finish_plain_runs(
            [(plain, None), (awaited, None)], [plain, awaited], OutcomesKept(NOW, None, LATER)
        )
        assert sorted(finished) == [FinishedRun(plain, "a", False), FinishedRun(awaited, "b", True)]
        assert store.job_outcome(plain, NOW) is None
        kept = store.job_outcome(awaited, NOW)
        assert kept is not None and (kept.state, kept.expires) == (State.FINISHED, LATER)


def test_finish_plain_runs_locks_every_job_named_first(store: Storage, db: Path | str) -> None:
    run, named, bystander = create(store, job("a"), job("a"), job("a"))
    with transaction(store):
        store.set_state_if([run], [State.QUEUED], State.RUNNING)
        finished = store.finish_plain_runs(
            [(run, None)], [run, named], OutcomesKept(NOW, LATER, LATER)
        )
        if not store.dialect.returning:
            # One writer to a file: nothing to lock, and nothing finished.
            assert finished == []
            return
        with another_store("postgres", db) as other, transaction(other):
            # Another node's hand-out passes over the request's other job,
            # locked; a job it did not name stays free.
            query = {"now": NOW, "priorities": [500], "limit": 10, "patterns": ["a"]}
            found = other.find_ready(**query)  # type: ignore[arg-type]
            assert [j.jobID for j in found] == [bystander]


def test_a_savepoint_undoes_only_its_own_writes(store: Storage) -> None:
    first, second = create(store, job("a"), job("b"))
    with transaction(store):
        before = store.total_changes
        store.set_state_if([first], [State.QUEUED], State.CANCELLED)
        assert store.total_changes > before
        store.savepoint("element")
        store.set_state_if([second], [State.QUEUED], State.CANCELLED)
        store.rollback_savepoint("element")
        assert store.in_transaction
        rows = [store.get(first), store.get(second)]
    assert [r.state for r in rows if r] == ["CANCELLED", "QUEUED"]
    assert not store.in_transaction


# The hand-out search (protocol.md 4.4).


def test_hand_out_order_is_priority_then_next_run_then_name_then_job_id(store: Storage) -> None:
    low_old, high_new, high_old_b, high_old, high_old_2 = create(
        store,
        job("a", "2030-01-01 00:00:01", priority=0),
        job("a", "2030-01-01 00:00:05", priority=1000),
        job("b", "2030-01-01 00:00:02", priority=1000),
        job("a", "2030-01-01 00:00:02", priority=1000),
        job("a", "2030-01-01 00:00:02", priority=1000),
    )
    assert ready(store) == [high_old, high_old_2, high_old_b, high_new, low_old]
    assert ready(store, limit=2) == [high_old, high_old_2]
    assert ready(store, priorities=[0]) == [low_old]
    assert ready(store, names=["b", "a"], limit=4) == [
        high_old, high_old_2, high_old_b, high_new
    ]


def test_hand_out_takes_due_ready_jobs_only(store: Storage) -> None:
    due, later = create(store, job("a"), job("a", LATER))
    leased, running = create(store, job("a"), job("a"))
    (paused,) = create(store, job("a"), state=State.PAUSED)
    with transaction(store):
        store.set_state_if([leased], [State.QUEUED], State.RUNQUEUED)
        store.set_state_if([running], [State.QUEUED], State.RUNNING)
    # A RUNQUEUED job whose lease ended (nextRun passed) is due again.
    assert ready(store) == [due, leased]
    assert paused not in ready(store, now=LATER) and later in ready(store, now=LATER)


def test_hand_out_by_pattern_names_and_what_was_passed_over(store: Storage) -> None:
    a1, b1, a2, odd = create(
        store, job("q/a"), job("q/b"), job("q/a"), job("q*[x]")
    )
    assert ready(store, patterns=["q/a"]) == [a1, a2]
    assert ready(store, patterns=["q/*"]) == [a1, a2, b1]
    held_a = PassedOver(names=frozenset({"q/a"}))
    assert ready(store, patterns=["q/[ab]"], passed=held_a) == [b1]
    assert ready(store, names=["q/a", "q/b"], passed=held_a) == [b1]
    assert ready(store, patterns=["q*"], passed=PassedOver(patterns=("q/?",))) == [odd]
    assert ready(store, patterns=["q*"], passed=PassedOver(patterns=("q/b", "q[*]*"))) == [a1, a2]
    # Several patterns: a job matching any, in hand-out order.
    assert ready(store, patterns=["q/b", "q[*]*"]) == [odd, b1]
    assert ready(store, patterns=["q/a", "q/[b]"]) == [a1, a2, b1]
    assert ready(store, patterns=["z*", "q/?", "q/a"]) == [a1, a2, b1]
    assert ready(store, names=["q/b", "q*[x]"]) == [odd, b1]
    odd_held = PassedOver(names=frozenset({"q*[x]"}))
    assert ready(store, names=["q*[x]"], passed=odd_held) == []
    # GLOB's own special characters, on every backend.
    assert ready(store, patterns=["q\\*?x]"]) == []
    assert ready(store, patterns=["q[*][[]x]"]) == [odd]


def test_a_search_goes_on_after_the_last_job_it_read(store: Storage) -> None:
    """From any job of the hand-out order, across priorities, names and
    nextRuns, by a pattern or by names: the jobs after it, in order."""
    create(
        store,
        job("r/b", priority=1000), job("r/a", priority=0), job("r/a", next_run=NOW),
        job("r/b"), job("r/a"), job("r/c", priority=1000, next_run=NOW), job("r/a"),
    )
    for asked in ({"patterns": ["r/*"]}, {"names": ["r/a", "r/b", "r/c"]}):
        order = ready(store, **asked)
        assert len(order) == 7
        for at, job_id in enumerate(order):
            found = store.get(job_id)
            assert found is not None
            after = (found.priority, found.nextRun, found.name, found.jobID)
            rest = ready(store, **asked, passed=PassedOver(after=after))
            assert rest == order[at + 1 :], (asked, at)


def test_hand_out_of_a_priority_never_used(store: Storage) -> None:
    create(store, job("a", priority=500))
    assert ready(store, priorities=[42]) == []


def test_find_by_name_skips_history(store: Storage) -> None:
    (kept,) = create(store, job("n"), state=State.FINISHED, ended=PAST)
    assert create(store, job("other"))
    with transaction(store):
        assert store.find_by_name("n") is None
    (child_done,) = create(store, job("n", parent_id=kept), state=State.FINISHED)
    first, _ = create(store, job("n"), job("n"))
    with transaction(store):
        found = store.find_by_name("n")
    # A finished child is its parent's, not history.
    assert found is not None and found.jobID == child_done < first


def test_failed_by_pattern_or_names_oldest_first(store: Storage) -> None:
    a, b, c = create(store, job("x/a"), job("x/b"), job("y/c"), state=State.FAILED)
    create(store, job("x/q"))
    with transaction(store):
        assert [j.jobID for j in store.failed(pattern="x/*", names=(), limit=10)] == [a, b]
        assert [j.jobID for j in store.failed(pattern="y/c", names=(), limit=10)] == [c]
        assert [j.jobID for j in store.failed(pattern=None, names=["y/c", "x/a"], limit=10)] == [
            a, c
        ]
        assert [j.jobID for j in store.failed(pattern="*", names=(), limit=1)] == [a]


def test_count_by_state(store: Storage) -> None:
    create(store, job(), job())
    create(store, job(), state=State.PAUSED)
    with transaction(store):
        assert store.count_by_state() == {"QUEUED": 2, "PAUSED": 1}


# Parents and children (protocol.md 8).


def test_children_in_states_oldest_first(store: Storage) -> None:
    (parent,) = create(store, job("p"))
    first, second = create(store, job("c", parent_id=parent), job("c", parent_id=parent))
    (done,) = create(store, job("c", parent_id=parent), state=State.FINISHED)
    (cancelled,) = create(store, job("c", parent_id=parent), state=State.CANCELLED)
    (alone,) = create(store, job("other"))
    with transaction(store):
        assert [c.jobID for c in store.children(parent, [State.QUEUED])] == [first, second]
        assert [c.jobID for c in store.children(parent, ALL)] == [first, second, done, cancelled]
        assert store.children(alone, ALL) == []
        assert store.has_children(parent)
        assert store.has_children(parent, [State.FINISHED])
        assert not store.has_children(parent, [State.RUNNING])
        assert not store.has_children(alone)
        assert store.delete_children(parent, ENDED_CHILDREN) == 2
        assert [c.jobID for c in store.children(parent, ALL)] == [first, second]


def test_children_of_a_parent_created_by_another_connection(
    store: Storage, backend: str, db: Path | str
) -> None:
    """What one connection knows of parents must not hide another's children
    (a SQLite file reopened, another node)."""
    (parent,) = create(store, job("p"))
    with another_store(backend, db) as other:
        create(other, job("c", parent_id=parent))
    with another_store(backend, db) as reopened, transaction(reopened):
        assert reopened.has_children(parent)


# The clock.


def test_next_due_and_first_deadline(store: Storage) -> None:
    with transaction(store):
        assert store.next_due(NOW) is None and store.first_deadline() is None
    create(store, job("a"), job("b", "2030-01-01 00:05:00"))
    (waiting,) = create(store, job("w"))
    with transaction(store):
        store.set_state_if(
            [waiting], [State.QUEUED], State.WAITING, JobChanges(nextRun=LATER, replyKey="k")
        )
        assert store.next_due(NOW) == LATER
        assert store.next_due(LATER) == "2030-01-01 00:05:00"
        assert store.first_deadline() == LATER


def test_a_commit_reads_the_next_due_time_as_its_transaction_left_it(store: Storage) -> None:
    """commit_reading_next_due: next_due before the COMMIT, in the same
    transaction (what it wrote counts), and the commit itself."""
    store.begin()
    assert store.commit_reading_next_due(NOW) is None
    store.begin()
    (later,) = store.create([job("a", "2030-01-01 00:05:00")], created=NOW, state=State.QUEUED)
    assert store.commit_reading_next_due(NOW) == "2030-01-01 00:05:00"
    store.begin()
    (sooner,) = store.create([job("b", LATER)], created=NOW, state=State.QUEUED)
    assert store.commit_reading_next_due(NOW) == LATER
    store.begin()
    store.delete([sooner])
    assert store.commit_reading_next_due(NOW) == "2030-01-01 00:05:00"
    with transaction(store):
        assert store.get(sooner) is None and store.get(later) is not None


def test_oldest_report_and_stale(store: Storage) -> None:
    old, new, unreported = create(store, job("a"), job("b"), job("c"))
    with transaction(store):
        assert store.oldest_report() is None
        store.set_state_if([old], [State.QUEUED], State.RUNNING, JobChanges(lastReport=PAST))
        store.set_state_if([new], [State.QUEUED], State.RUNNING, JobChanges(lastReport=NOW))
        store.set_state_if([unreported], [State.QUEUED], State.RUNNING)
        assert store.oldest_report() == PAST
        assert [j.jobID for j in store.stale(PAST, 10)] == [unreported, old]
        assert [j.jobID for j in store.stale(NOW, 10)] == [unreported, old, new]
        assert [j.jobID for j in store.stale(NOW, 1)] == [unreported]

