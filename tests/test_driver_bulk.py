"""The storage driver's searches for bulk actions (in_state and
count_in_state, protocol.md 14.19), called directly on every backend:
by GLOB pattern, by a list of names, by queue (whose name may hold GLOB's
own characters), in one state only, oldest first and bounded."""

from __future__ import annotations

import pytest
from driver import create, job, transaction

from jobserver.storage.interface import NameMatch, Storage

pytestmark = pytest.mark.backends()

NAMES = ("q", "q/a", "q/b/c", "qq/a", "q*", "q*/a", "qx", "é/1", "é")


def found(store: Storage, match: NameMatch, state: str = "FAILED", limit: int = 100) -> list[str]:
    with transaction(store):
        ids = store.in_state(state, match, limit)
        assert store.count_in_state(state, match, 10**6) >= len(ids)
        names = {}
        for job_id in ids:
            stored = store.get(job_id)
            assert stored is not None and stored.state == state
            names[job_id] = stored.name
    assert ids == sorted(ids)
    return [names[i] for i in ids]


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


def test_counts_past_the_limit(store: Storage) -> None:
    create(store, *(job(f"n/{i}") for i in range(30)), state="FAILED")
    create(store, *(job(f"n/{i}") for i in range(5)))
    with transaction(store):
        assert len(store.in_state("FAILED", NameMatch(pattern="n/*"), 10)) == 10
        assert store.count_in_state("FAILED", NameMatch(pattern="n/*"), 100) == 30
        assert store.count_in_state("QUEUED", NameMatch(queue="n"), 100) == 5
        assert store.count_in_state("RUNNING", NameMatch(queue="n"), 100) == 0
        # The count reads no further than asked: a selection of millions
        # must not hold the writer to be counted.
        assert store.count_in_state("FAILED", NameMatch(pattern="n/*"), 12) == 12


def test_ready_by_queue_counts_the_jobs_waiting_to_run_of_each_queue(store: Storage) -> None:
    """The history's depth sample: QUEUED and RUNQUEUED jobs by queue (a name
    up to its first /), whatever their nextRun; no other state."""
    later = job("later", next_run="2999-01-01 00:00:00")
    create(store, job("q/a"), job("q/b"), job("q"), job("é/1"), later)
    create(store, job("q/runqueued"), state="RUNQUEUED")
    create(store, job("q/failed"), job("r/failed"), state="FAILED")
    create(store, job("q/running"), state="RUNNING")
    assert store.ready_by_queue() == {"q": 4, "é": 1, "later": 1}
