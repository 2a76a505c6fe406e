"""SQLite's hand-out search keeps its statement per shape (sqlite_search.py)
for short lists only: a client's list of exact names is bounded by its
bytes alone, and each length it sends must not leave a statement behind,
while every length still finds its job."""

from __future__ import annotations

from pathlib import Path

from driver import NOW, create, job, open_store, transaction

from jobserver.storage import sqlite_search


def test_lists_of_every_length_find_their_job_and_keep_a_bounded_cache(
    tmp_path: Path,
) -> None:
    store = open_store("sqlite", tmp_path / "jobs.db")
    try:
        (job_id,) = create(store, job("target"))
        for count in range(1, 400):
            names = [f"n{index}" for index in range(count - 1)] + ["target"]
            with transaction(store):
                found = store.find_ready(now=NOW, priorities=[500], limit=1, names=names)
            assert [found_job.jobID for found_job in found] == [job_id], count
        assert len(sqlite_search.STATEMENTS) <= 2 * sqlite_search.KEPT_SHAPE
        assert all(count <= sqlite_search.KEPT_SHAPE for _, count in sqlite_search.STATEMENTS)
    finally:
        store.close()
