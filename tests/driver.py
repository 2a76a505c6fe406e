"""What the driver tests (test_driver*.py) share: a store of each backend
on a real database, and jobs to put in it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jobserver.model.jobs import PLAIN, FlowOptions, NewJob, RetryPolicy
from jobserver.storage.interface import Storage
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.sqlite import Store

# Times as the core writes them; NOW is the moment the tests run at.
PAST = "2030-01-01 00:00:00"
NOW = "2030-01-01 00:00:10.000"
LATER = "2030-01-01 00:01:00"


def open_store(backend: str, db: Path | str) -> Storage:
    """A store on a real SQLite file or a real PostgreSQL schema."""
    if backend == "sqlite":
        return Store(str(db))
    return PostgresStore(str(db))


@contextmanager
def another_store(backend: str, db: Path | str) -> Iterator[Storage]:
    """A second store on the same database (another connection: a SQLite
    file opened again, another node), closed at the end."""
    other = open_store(backend, db)
    try:
        yield other
    finally:
        other.close()


@contextmanager
def transaction(store: Storage) -> Iterator[Storage]:
    """The writer's way: one transaction, committed at the end."""
    store.begin()
    try:
        yield store
    except BaseException:
        store.rollback()
        raise
    store.commit()


def job(
    name: str = "a",
    next_run: str = PAST,
    priority: int = 500,
    parent_id: int = 0,
    retry_after: str = "",
    policy: RetryPolicy | None = None,
    flow: FlowOptions = PLAIN,
    data: str = "{}",
) -> NewJob:
    return NewJob(
        name=name, next_run=next_run, priority=priority, parent_id=parent_id,
        retry_after=retry_after, policy=policy, flow=flow, data=data,
    )


def create(store: Storage, *jobs: NewJob, state: str = "QUEUED", ended: str = "") -> list[int]:
    """Jobs stored and committed; their jobIDs."""
    with transaction(store):
        return store.create(jobs or (job(),), created=PAST, state=state, ended=ended)
