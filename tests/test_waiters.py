"""The wait queue's book, without a database: the waiter's states (MOVES),
and the order rules they keep (first come, first served)."""

from __future__ import annotations

import sys
from itertools import chain

import pytest

from jobserver.core.engine.waiters import MATCH_AT_ONCE, MOVES, IllegalWaiterMove, Phase, WaitQueue
from jobserver.core.rules.selection import JobQuery
from jobserver.model.globmatch import glob_match, matcher


def query(name: str) -> JobQuery:
    return JobQuery((name,), (), None, 1)


def test_every_state_has_its_moves_and_the_final_ones_have_none() -> None:
    assert set(MOVES) == set(Phase)
    assert MOVES[Phase.SERVED] == MOVES[Phase.GONE] == frozenset()
    # Every state can be reached (IDLE again after a try that found nothing).
    assert set().union(*MOVES.values()) == set(Phase)


async def test_an_illegal_move_raises() -> None:
    waiter = WaitQueue().join(query("a"))
    with pytest.raises(IllegalWaiterMove, match="IDLE to SERVED"):
        waiter.move(Phase.SERVED)
    assert waiter.phase is Phase.IDLE


async def test_a_younger_waiter_is_held_behind_an_older_ones_try() -> None:
    waits = WaitQueue()
    older, younger = waits.join(query("a")), waits.join(query("a"))
    assert waits.to_try([older]) == [([older], False)]
    # A job became ready while the older waiter's try ran: it may have
    # looked too early, so it is poked, and the younger one waits for it.
    assert waits.to_try(waits.ready({"a"})) == []
    assert (older.phase, younger.phase) == (Phase.POKED, Phase.HELD)
    assert older.held == [younger]
    served = waits.served([older], [None])
    # Nothing found: the older one is tried again, the younger one with it.
    assert served.again == [younger, older]
    assert (older.phase, younger.phase) == (Phase.IDLE, Phase.HELD)
    assert waits.to_try(served.again) == [([older, younger], False)]
    assert older.phase is younger.phase is Phase.TRYING


async def test_a_waiter_that_leaves_during_its_try_gives_its_jobs_back() -> None:
    waits = WaitQueue()
    waiter = waits.join(query("a"))
    waits.to_try([waiter])
    waits.leave(waiter)
    assert waiter.phase is Phase.LEAVING and len(waits) == 0
    jobs: list = [object()]
    served = waits.served([waiter], [jobs])
    assert served.unwanted == [jobs] and waiter.jobs is None
    assert waiter.phase is Phase.GONE


async def test_closing_answers_idle_waiters_and_those_not_yet_sent() -> None:
    waits = WaitQueue()
    idle = waits.join(query("idle"))
    trying = waits.join(query("trying"))
    waits.to_try([trying])
    waits.close()
    assert idle.woken.is_set() and not trying.woken.is_set()
    waits.served([trying], [None])
    assert trying.woken.is_set() and trying.phase is Phase.IDLE


@pytest.mark.parametrize("names", [1, 7, 300])
async def test_the_oldest_waiters_are_those_that_joined_first_whatever_they_wait_for(
    names: int,
) -> None:
    """Status lists them (core/commands/waiting.py): the groups of each
    name are merged, and waiters that left are not among them."""
    waits = WaitQueue()
    joined = [waits.join(query(f"name{(n * 7919) % names}")) for n in range(600)]
    for waiter in joined[::3]:
        waits.leave(waiter)
    staying = [w for w in joined if w.phase is Phase.IDLE]
    assert waits.oldest(100) == staying[:100]
    assert waits.oldest(1000) == staying
    counts = waits.by_selector(5)
    assert [count for _, count in counts] == sorted(
        (sum(1 for w in staying if w.selector == s) for s in {w.selector for w in staying}),
        reverse=True,
    )[:5]


def test_the_count_of_waiters_may_be_read_from_another_thread_while_they_change() -> None:
    """The writer's thread asks how many wait (to serve those it woke) while
    the event loop lets waiters join and leave: summing over the groups
    there raised "dictionary changed size during iteration" and failed a
    whole transaction (seen once in the chaos test)."""
    import threading

    waits = WaitQueue()
    done = threading.Event()
    errors: list[BaseException] = []

    def count() -> None:
        while not done.is_set():
            try:
                assert len(waits) >= 0
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                return

    # Many groups to count, and threads switched as often as can be, so
    # that a count over the groups would meet a change.
    standing = [waits.join(query(f"s{i}")) for i in range(2_000)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=count)
    reader.start()
    try:
        for i in range(20_000):
            # A name of its own each: the dict of groups grows and shrinks.
            waiter = waits.join(query(f"n{i}"))
            waits.leave(waiter)
    finally:
        done.set()
        reader.join(10)
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(waits) == len(standing)


async def test_the_count_follows_joins_and_leaves() -> None:
    waits = WaitQueue()
    a, b, c = waits.join(query("a")), waits.join(query("a")), waits.join(query("b"))
    assert len(waits) == 3
    waits.leave(a)
    assert len(waits) == 2
    waits.leave(b)
    waits.leave(c)
    assert len(waits) == 0


async def test_matching_bounded_by_its_time_still_finds_every_waiter_of_the_names() -> None:
    """A commit's names against waiters of slow patterns (40 to 300 µs a
    name, as test_security_waiting's), as many pairs as are matched at
    once: past MATCH_SECONDS none are found as the commit is delivered,
    and the matcher's slices find each waiter whose pattern a name
    matches, once, and no other."""
    waits = WaitQueue()
    patterns = ["*" + "[xa]" * 16 + "x" * 150 + f"z{i:04d}*" for i in range(12)]
    patterns += [f"m{i}/*" for i in range(4)]
    waiters = {p: waits.join(JobQuery((p,), (), None, 1), matcher=matcher(p)) for p in patterns}
    names = {f"{i:05d}" + "x" * 250 for i in range(250)}
    names |= {"x" * 246 + "z0003", "x" * 246 + "z0011", "m1/", "m3/x", "m9/x", "0m2/"}
    assert len(names) * len(patterns) == MATCH_AT_ONCE
    expected = [w for p, w in waiters.items() if any(glob_match(p, name) for name in names)]
    assert len(expected) == 4
    assert waits.ready(names) == []
    left = await waits.unmatched()
    assert left == names
    slices = list(waits.matching_slices(left))
    assert len(slices) > 1
    found = list(chain(*slices))
    assert sorted(found, key=lambda w: w.seq) == expected
