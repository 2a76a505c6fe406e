"""A job's row read again is its row as stored, whatever wrote it since.

The report that follows a hand-out reads the row the hand-out's search read
and its write changed; SQLite's writer answers it from the rows it keeps
(storage/sqlite_rows.py) instead of reading the file again. These tests
read a row (so that it is kept), change it in every way the named
operations do (a write by jobID, writes of many jobs, SQL of other modules
over other columns, held writes, deletes, savepoints and transactions
undone), and compare what the store answers with the row another
connection reads from the database.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from driver import NOW, another_store, create, job, open_store, transaction
from test_driver import ready

from helpers import until
from jobserver.model.jobs import Job, JobChanges, State
from jobserver.storage.interface import Storage

pytestmark = pytest.mark.backends()


def stored(backend: str, db: Path | str, job_id: int) -> Job | None:
    """The row as another connection reads it from the database."""
    with another_store(backend, db) as other, transaction(other):
        return other.get(job_id)


def handed_out(store: Storage) -> Job:
    """The first due job, found by the hand-out search and handed out as
    leases.hand_out writes it."""
    (found,) = store.find_ready(now=NOW, priorities=[500], limit=1, patterns=["*"])
    changes = JobChanges(lastRun=NOW[:19], leaseID="lease", worker="w:1", lastReport=NOW)
    assert store.set_state_if([found.jobID], [found.state], State.RUNNING, changes)
    return found


def test_a_report_reads_the_row_its_hand_out_left(
    store: Storage, backend: str, db: Path | str
) -> None:
    (job_id,) = create(store, job("a", data='{"n":1}'))
    with transaction(store):
        found = handed_out(store)
        report = store.get(job_id)
    assert found.state == State.QUEUED and found.leaseID == ""
    assert report is not None
    assert (report.state, report.leaseID, report.worker) == (State.RUNNING, "lease", "w:1")
    assert report == stored(backend, db, job_id)
    with transaction(store):
        assert store.get(job_id) == report


def test_a_fenced_write_that_changed_nothing_leaves_the_row(
    store: Storage, backend: str, db: Path | str
) -> None:
    (job_id,) = create(store, job())
    with transaction(store):
        handed_out(store)
        assert not store.set_state_if([job_id], [State.RUNNING], State.QUEUED, lease="other")
        assert not store.set_state_if([job_id], [State.QUEUED], State.FAILED)
        row = store.get(job_id)
    assert row is not None and row.state == State.RUNNING
    assert row == stored(backend, db, job_id)


def _amend_many(store: Storage, ids: list[int]) -> None:
    store.amend(ids, JobChanges(data='{"many":true}'))


def _depended_on(store: Storage, ids: list[int]) -> None:
    # Counted by SQL of its own: `dependents` goes up by one.
    store.add_dependencies([(ids[1], ids[0])])


def _held(store: Storage, ids: list[int]) -> None:
    with store.holding_writes():
        store.hold(ids)
        store.set_state_if([ids[0]], [State.RUNNING], State.QUEUED, JobChanges(attempts=3))


def _twice(store: Storage, ids: list[int]) -> None:
    store.amend([ids[0]], JobChanges(data='{"first":1}'))
    store.amend([ids[0]], JobChanges(priority=7))


@pytest.mark.parametrize("write", [_amend_many, _depended_on, _held, _twice])
def test_a_kept_row_is_read_as_any_later_write_left_it(
    store: Storage, backend: str, db: Path | str, write: Callable[[Storage, list[int]], None]
) -> None:
    ids = create(store, job("a"), job("b"))
    with transaction(store):
        handed_out(store)
        assert store.get(ids[0]) is not None
        write(store, ids)
        row = store.get(ids[0])
    assert row == stored(backend, db, ids[0])


def test_deleted_rows_are_gone_whichever_statement_deleted_them(store: Storage) -> None:
    (parent,) = create(store, job("p"))
    first, second = create(store, job("c", parent_id=parent), job("d", parent_id=parent))
    create(store, job("c", parent_id=parent))
    with transaction(store):
        assert store.get(first) is not None and store.get(second) is not None
        assert store.delete([first]) == [first]
        assert store.delete_children(parent, [State.QUEUED]) == 2
        assert store.get(first) is None and store.get(second) is None


def test_rows_undone_by_a_savepoint_or_a_rollback_read_as_before(
    store: Storage, backend: str, db: Path | str
) -> None:
    first, second = create(store, job("a"), job("b"))
    with transaction(store):
        store.savepoint("element")
        handed_out(store)
        assert store.get(first).state == State.RUNNING  # type: ignore[union-attr]
        store.rollback_savepoint("element")
        undone = store.get(first)
    assert undone is not None and undone.state == State.QUEUED
    assert undone == stored(backend, db, first)
    store.begin()
    store.amend([second], JobChanges(data='{"undone":1}'))
    assert store.get(second).data == '{"undone":1}'  # type: ignore[union-attr]
    store.rollback()
    with transaction(store):
        row = store.get(second)
    assert row is not None and row.data == "{}"
    assert row == stored(backend, db, second)


def test_a_row_another_connection_changed_is_read_as_it_left_it(
    store: Storage, backend: str, db: Path | str
) -> None:
    """An operator's `sqlite3 jobs.db "UPDATE ..."` (any connection but the
    writer's, whose triggers see only its own writes) is read by the next
    transaction, not the row kept from before it."""
    (job_id,) = create(store, job("a", data='{"n":1}'))
    with transaction(store):
        assert store.get(job_id) is not None
    with another_store(backend, db) as other, transaction(other):
        assert other.set_state_if([job_id], [State.QUEUED], State.PAUSED, JobChanges())
    with transaction(store):
        report = store.get(job_id)
    assert report is not None and report.state == State.PAUSED
    assert report == stored(backend, db, job_id)


def test_a_job_another_connection_added_is_found_and_seen_as_a_child(
    store: Storage, backend: str, db: Path | str
) -> None:
    """A job an operator's connection inserts, of a priority no job had and
    the child of a stored job, is handed out and seen as the child: SQLite's
    writer keeps the priorities and parents it knows of in memory, and
    learns of the parent at its next transaction, of the priority within a
    second."""
    (parent,) = create(store, job("parent"))
    with transaction(store):
        assert not store.has_children(parent)
    assert ready(store, priorities=[321]) == []
    with another_store(backend, db) as other:
        (child,) = create(other, job("kid", priority=321, parent_id=parent))
    with transaction(store):
        assert store.has_children(parent)
    # The priorities are read again within a second (a read of every job).
    until(lambda: ready(store, priorities=[321]) == [child], 10.0, "the job to be found")


def test_rows_with_large_data_are_read_again_not_kept(tmp_path: Path) -> None:
    """A job's data may be megabytes: a row is kept only if its data and
    last error are small, so reading many large jobs leaves no memory held,
    and each is still read as stored."""
    store = open_store("sqlite", tmp_path / "jobs.db")
    try:
        big = '{"x":"' + "d" * 65_536 + '"}'
        ids = create(store, *(job(f"big{index}", data=big) for index in range(300)))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            with transaction(store):
                for job_id in ids:
                    read = store.get(job_id)
                    assert read is not None and read.data == big
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # 300 rows of 64 KiB kept would be about 20 MB.
        assert held < 2_000_000, held
    finally:
        store.close()
