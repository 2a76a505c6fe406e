"""The table of a job's moves: the code's (core/rules/moves.py) against the
one protocol.md section 4.2 prints, pair by pair; a move outside the table
is refused before it writes anything, with the status line a client gets
when the client asked for it."""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import creation, leases, lifecycle, moves
from jobserver.core.rules.moves import GONE, MOVES, NEW, IllegalMove, Refused
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
    assert sorted(moves.legal_moves(source, target)) == documented


def test_a_move_outside_the_table_is_refused_before_it_writes(tmp_path):
    store = Store(str(tmp_path / "jobs.db"))
    ctx = Context(store, utcnow())
    store.begin()
    job_id = creation.create(ctx, NewJob(name="queued", next_run=ctx.now_ms, priority=500), None)
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


def _one_job(tmp_path, state: State) -> tuple[Store, Context, int]:
    """A store holding one job in `state`, in an open transaction."""
    store = Store(str(tmp_path / "jobs.db"))
    ctx = Context(store, utcnow())
    store.begin()
    job_id = creation.create(ctx, NewJob(name="job", next_run=ctx.now_ms, priority=500), None)
    store.set_state_if([job_id], [State.QUEUED], state)
    return store, ctx, job_id


@pytest.mark.parametrize(
    ("state", "status"),
    [
        (State.RUNNING, "405 Can't delete a RUNNING job"),
        (State.PAUSED, "405 Can't delete a parent jobs with children running"),
    ],
)
def test_a_refused_move_is_the_status_line_its_command_answers(tmp_path, state, status):
    store, ctx, job_id = _one_job(tmp_path, state)
    job = store.get(job_id)
    assert job is not None
    with pytest.raises(Refused) as refused:
        lifecycle.delete(ctx, job)
    assert isinstance(refused.value, CommandError)
    assert refused.value.status == status
    assert store.get(job_id) == job
    store.rollback()
    store.close()


def test_a_move_no_client_asks_for_is_a_bug_not_a_refusal(tmp_path):
    # Only the server hands a job out: from FAILED it is a bug (500).
    store, ctx, job_id = _one_job(tmp_path, State.FAILED)
    job = store.get(job_id)
    assert job is not None
    with pytest.raises(IllegalMove) as illegal:
        leases.hand_out(ctx, job)
    assert not isinstance(illegal.value, CommandError)
    store.rollback()
    store.close()


def test_every_refusal_names_a_state_the_move_cannot_leave():
    for name, move in MOVES.items():
        assert not set(move.refusals) & move.sources, name
        assert all(status.startswith("405 ") for status in move.refusals.values()), name


def test_cancel_in_a_state_it_cannot_leave_changes_nothing_and_is_no_refusal(tmp_path):
    store, ctx, job_id = _one_job(tmp_path, State.FINISHED)
    job = store.get(job_id)
    assert job is not None
    lifecycle.cancel(ctx, job)
    assert store.get(job_id) == job
    store.rollback()
    store.close()
