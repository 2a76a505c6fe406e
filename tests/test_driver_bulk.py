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
        assert store.count_in_state(state, match) >= len(ids)
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
        assert store.count_in_state("FAILED", NameMatch(pattern="n/*")) == 30
        assert store.count_in_state("QUEUED", NameMatch(queue="n")) == 5
        assert store.count_in_state("RUNNING", NameMatch(queue="n")) == 0
