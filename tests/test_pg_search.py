"""GetJob's search on PostgreSQL: whether each job it finds has children
comes with the job, asked in the search's own statement, and a search
goes on after what it passed over."""

from __future__ import annotations

from collections.abc import Iterator

import pg
import pytest
from driver import NOW, PAST, create, job, transaction

from jobserver.model.jobs import State
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.searches import PassedOver


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


def test_each_job_found_says_whether_it_has_children(url: str) -> None:
    store = PostgresStore(url)
    try:
        parent, alone = create(store, job("p"), job("q"))
        create(store, job("child", parent_id=parent), state=State.WAITING)
        with transaction(store), store.holding_writes():
            found = store.find_ready(now=NOW, priorities=[500], limit=10, patterns=["p", "q"])
            assert {j.jobID for j in found} == {parent, alone}
            # Answered from what the search said: the child, deleted by
            # another connection meanwhile, is still counted.
            pg.execute(url, "DELETE FROM jobs WHERE name = 'child'")
            assert store.has_children(parent) is True
            assert store.has_children(alone) is False
    finally:
        store.close()


def test_a_search_goes_on_after_the_job_it_passed_over(url: str) -> None:
    store = PostgresStore(url)
    try:
        ids = create(store, *(job(f"n{i}", next_run=PAST) for i in range(5)))
        with transaction(store):
            first = store.find_ready(now=NOW, priorities=[500], limit=2, patterns=["n*"])
        assert [j.jobID for j in first] == ids[:2]
        last = first[-1]
        after = PassedOver(after=(500, last.nextRun, last.name, last.jobID))
        with transaction(store):
            rest = store.find_ready(
                now=NOW, priorities=[1000, 500, 0], limit=10, patterns=["n*"], passed=after
            )
        assert [j.jobID for j in rest] == ids[2:]
    finally:
        store.close()
