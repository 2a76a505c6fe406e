"""The storage's operations for dependencies (storage/dependency_types.py),
called straight on every backend, as the driver suite calls the others: a
new backend is complete when it passes these too."""

from __future__ import annotations

from dataclasses import replace

import pytest
from driver import PAST, create, job, transaction

from jobserver.model.jobs import State
from jobserver.storage.dependency_types import Outcome
from jobserver.storage.interface import Storage

pytestmark = pytest.mark.backends()


def blocked(store: Storage, count: int, name: str = "b") -> list[int]:
    """Jobs BLOCKED on `count` dependencies each, none stored yet."""
    waiting = replace(job(name), dependencies=count, blockers=count, on_dependency_failure="run")
    with transaction(store):
        return store.create([waiting, waiting], created=PAST, state=State.BLOCKED)


def test_edges_count_dependents_and_outcomes_release_them(store: Storage) -> None:
    deps = create(store, job("d"), job("d"))
    waiting = blocked(store, 2)
    with transaction(store):
        store.add_dependencies([(w, d) for w in waiting for d in deps])
        found = store.depended_on([*deps, 10**9])
    assert sorted(found) == deps and all(found[d].dependents == 2 for d in deps)
    with transaction(store):
        kept = store.keep_outcomes([Outcome(deps[0], "FINISHED", '{"r":1}')], True)
        assert kept == [deps[0]]
        # Kept once: a second end of the same job is not news.
        assert store.keep_outcomes([Outcome(deps[0], "FAILED", "{}")], True) == []
        assert store.blocked_dependents([deps[0]], 1) == [waiting[0]]
        assert store.blocked_dependents([deps[0]], 5) == waiting
        # Behind: their count (2) is not yet what the outcomes say (1).
        assert store.behind(0, 5) == [(waiting[0], True), (waiting[1], True)]
        released = store.settle(waiting)
        assert store.behind(0, 5) == [(waiting[0], False), (waiting[1], False)]
        # Counted again, the same answer.
        assert [left for _, left, _ in store.settle(waiting)] == [1, 1]
    assert [(j.jobID, left, f) for j, left, f in released] == [
        (waiting[0], 1, None), (waiting[1], 1, None)
    ]
    assert all(j.state == State.BLOCKED and j.onDependencyFailure == "run" for j, _, _ in released)
    with transaction(store):
        store.keep_outcomes([Outcome(deps[1], "FAILED", "{}")], True)
        assert store.edges_from([deps[1]]) == [(waiting[0], deps[1]), (waiting[1], deps[1])]
        released = store.settle(store.blocked_dependents([deps[1]], 5))
        assert [left for _, left, _ in released] == [0, 0]
        assert [f for _, _, f in released] == [Outcome(deps[1], "FAILED", "{}")] * 2
        shown = store.dependency_outcomes(waiting[0], 1 << 20)
        counts = store.dependency_counts(waiting[0])
    assert [(o.job_id, o.state, o.data) for o in shown] == [
        (deps[0], "FINISHED", '{"r":1}'), (deps[1], "FAILED", "{}")
    ]
    assert counts == {"FINISHED": 1, "FAILED": 1}


def test_an_outcome_nobody_depends_on_is_not_kept(store: Storage) -> None:
    (alone,) = create(store, job("alone"))
    with transaction(store):
        assert store.keep_outcomes([Outcome(alone, "FINISHED", "{}")], True) == []
        # At a create, the outcome of a job that ended before is kept.
        assert store.keep_outcomes([Outcome(alone, "FINISHED", "{}")], False) == [alone]
        assert store.outcomes_of([alone, 10**9]) == {alone: Outcome(alone, "FINISHED", "{}")}


def test_data_past_the_budget_is_left_out_in_jobID_order(store: Storage) -> None:
    deps = create(store, job("d"), job("d"), job("d"))
    (waiting, _) = blocked(store, 3)
    with transaction(store):
        store.add_dependencies([(waiting, d) for d in deps])
        data = '{"x":"' + "é" * 10 + '"}'
        store.keep_outcomes([Outcome(d, "FINISHED", data) for d in deps[:2]], True)
        # Counted in bytes: each data is 28 bytes of UTF-8 (18 characters,
        # two of which would fit).
        shown = store.dependency_outcomes(waiting, 40)
    assert [(o.job_id, o.state, bool(o.data), o.omitted) for o in shown] == [
        (deps[0], "FINISHED", True, False),
        (deps[1], "FINISHED", False, True),
        (deps[2], "", False, False),
    ]


def test_a_dependent_gone_takes_its_edges_and_the_outcomes_no_edge_names(store: Storage) -> None:
    deps = create(store, job("d"), job("d"))
    waiting = blocked(store, 2)
    with transaction(store):
        store.add_dependencies([(w, d) for w in waiting for d in deps])
        store.keep_outcomes([Outcome(d, "FINISHED", "{}") for d in deps], True)
        store.forget_dependencies([waiting[0]])
        assert sorted(store.outcomes_of(deps)) == deps
        store.forget_dependencies([waiting[1]])
        assert store.outcomes_of(deps) == {}
        assert store.edges_from(deps) == []
