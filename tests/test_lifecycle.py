"""The table of a job's moves: the code's (core/rules/lifecycle.py) against the
one protocol.md section 4.2 prints, pair by pair; and a move outside the
table is refused before it writes anything."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

from jobserver.core.engine.context import Context
from jobserver.core.rules import lifecycle
from jobserver.core.rules.lifecycle import GONE, MOVES, NEW, IllegalMove
from jobserver.model.jobs import NewJob, State
from jobserver.model.times import utcnow
from jobserver.storage.sqlite import Store

PROTOCOL = Path(__file__).parent.parent / "protocol.md"
STATES = [s.value for s in State]


def documented_moves() -> dict[str, set[tuple[str, str]]]:
    """The moves table of protocol.md 4.2: move -> its (from, to) pairs."""
    text = PROTOCOL.read_text()
    section = text[text.index("### 4.2 States") : text.index("### 4.3")]
    rows = re.findall(r"^\| ([a-z ]+) \| ([^|]+) \| ([^|]+) \| [^|]+ \|$", section, re.M)
    moves: dict[str, set[tuple[str, str]]] = {}
    for name, sources_text, targets_text in rows:
        if name.strip() == "move":
            continue
        sources = _states(sources_text)
        if targets_text.strip() == "the same":
            moves[name.strip()] = {(s, s) for s in sources}
        else:
            moves[name.strip()] = set(product(sources, _states(targets_text)))
    return moves


def _states(text: str) -> list[str]:
    text = text.strip()
    return STATES if text == "any state" else [part.strip() for part in text.split(",")]


DOCUMENTED = documented_moves()


def test_the_table_names_every_move_the_code_has():
    assert sorted(DOCUMENTED) == sorted(MOVES)


@pytest.mark.parametrize(
    ("source", "target"), list(product([NEW, *STATES], [*STATES, GONE]))
)
def test_each_pair_of_states_is_legal_exactly_as_documented(source, target):
    documented = sorted(name for name, pairs in DOCUMENTED.items() if (source, target) in pairs)
    assert sorted(lifecycle.legal_moves(source, target)) == documented


def test_a_move_outside_the_table_is_refused_before_it_writes(tmp_path):
    store = Store(str(tmp_path / "jobs.db"))
    ctx = Context(store, utcnow())
    store.begin()
    job_id = lifecycle.create(ctx, NewJob(name="queued", next_run=ctx.now_ms, priority=500), None)
    job = store.get(job_id)
    assert job is not None and job.state == State.QUEUED
    # A QUEUED job was never handed out: it can be neither finished nor failed.
    with pytest.raises(IllegalMove, match=r"finish: job .* from QUEUED to deleted"):
        lifecycle.finish(ctx, job, None)
    with pytest.raises(IllegalMove):
        lifecycle.fail_attempt(ctx, job, "no")
    with pytest.raises(IllegalMove):
        lifecycle.wait_for_reply(ctx, job, "key", ctx.now_ms, "{}")
    assert store.get(job_id) == job
    store.rollback()
    store.close()
