"""The storage driver's search for bulk actions (in_state, protocol.md
14.19), called directly on every backend: by GLOB pattern, by a list of
names, by queue (whose name may hold GLOB's own characters), in one state
only, oldest first, examining a bounded number of jobs and saying when
more could match."""

from __future__ import annotations

import pytest
from driver import create, job, transaction

from jobserver.storage.interface import Storage
from jobserver.storage.searches import NameMatch

pytestmark = pytest.mark.backends()

NAMES = ("q", "q/a", "q/b/c", "qq/a", "q*", "q*/a", "qx", "é/1", "é")


def found(
    store: Storage, match: NameMatch, state: str = "FAILED", limit: int = 100, examine: int = 100
) -> list[str]:
    with transaction(store):
        search = store.in_state(state, match, limit, examine)
        assert search.complete and search.matched >= len(search.job_ids)
        names = {}
        for job_id in search.job_ids:
            stored = store.get(job_id)
            assert stored is not None and stored.state == state
            names[job_id] = stored.name
    assert search.job_ids == sorted(search.job_ids)
    return [names[i] for i in search.job_ids]


def test_matches_by_pattern_names_and_queue(store: Storage) -> None:
    create(store, *(job(name) for name in NAMES), state="FAILED")
    create(store, job("q/queued"))
    assert found(store, NameMatch(pattern="q/*")) == ["q/a", "q/b/c"]
    assert found(store, NameMatch(names=("qx", "q*", "none"))) == ["q*", "qx"]
    assert found(store, NameMatch(queue="q")) == ["q", "q/a", "q/b/c"]
    assert found(store, NameMatch(queue="q*")) == ["q*", "q*/a"]
    assert found(store, NameMatch(queue="é")) == ["é/1", "é"]
    assert found(store, NameMatch(queue="q"), state="QUEUED") == ["q/queued"]
    assert found(store, NameMatch(pattern="*"), limit=2) == ["q", "q/a"]
    # A pattern without a wildcard is one exact name.
    assert found(store, NameMatch(pattern="q")) == ["q"]


def test_counts_past_the_limit(store: Storage) -> None:
    create(store, *(job(f"n/{i}") for i in range(30)), state="FAILED")
    create(store, *(job(f"n/{i}") for i in range(5)))
    with transaction(store):
        search = store.in_state("FAILED", NameMatch(pattern="n/*"), 10, 100)
        assert (len(search.job_ids), search.matched, search.complete) == (10, 30, True)
        assert store.in_state("QUEUED", NameMatch(queue="n"), 10, 100).matched == 5
def test_examines_at_most_so_many_and_says_whether_that_was_all(store: Storage) -> None:
    create(store, *(job(f"n/{i}") for i in range(5)), state="FAILED")
    with transaction(store):
        every = store.in_state("FAILED", NameMatch(pattern="n/*"), 10, 5)
        assert (every.matched, every.examined, every.complete) == (5, 5, True)
        short = store.in_state("FAILED", NameMatch(pattern="n/*"), 2, 4)
        assert (len(short.job_ids), short.matched, short.examined) == (2, 4, 4)
        assert not short.complete and set(short.job_ids) < set(every.job_ids)
        # None found among those examined: not "none", more could match.
        none = store.in_state("FAILED", NameMatch(pattern="*9"), 10, 4)
        assert (none.job_ids, none.matched, none.examined, none.complete) == ([], 0, 4, False)


def test_a_queued_search_examines_runqueued_jobs_and_takes_none(store: Storage) -> None:
    """QUEUED jobs are read through the index of the jobs waiting to run,
    which holds those a worker holds under a lease too."""
    create(store, job("r/1"), job("r/2"), state="RUNQUEUED")
    (queued,) = create(store, job("r/3"))
    with transaction(store):
        every = (NameMatch(queue="r"), NameMatch(pattern="r/*"), NameMatch(names=("r/1", "r/3")))
        for match in every:
            search = store.in_state("QUEUED", match, 10, 3)
            assert (search.job_ids, search.matched, search.complete) == ([queued], 1, True)
        short = store.in_state("QUEUED", NameMatch(pattern="r/*"), 10, 2)
        assert short.examined == 2 and not short.complete


def test_ready_by_queue_counts_the_jobs_waiting_to_run_of_each_queue(store: Storage) -> None:
    """The history's depth sample: QUEUED and RUNQUEUED jobs by queue (a name
    up to its first /), whatever their nextRun; no other state."""
    later = job("later", next_run="2999-01-01 00:00:00")
    create(store, job("q/a"), job("q/b"), job("q"), job("é/1"), later)
    create(store, job("q/runqueued"), state="RUNQUEUED")
    create(store, job("q/failed"), job("r/failed"), state="FAILED")
    create(store, job("q/running"), state="RUNNING")
    assert store.ready_by_queue() == {"q": 4, "é": 1, "later": 1}
