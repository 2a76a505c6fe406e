"""What CRON repeats cost the writer (issue 34, item 2).

cronsim finds a rule's next moment by walking the calendar: `0 0 * 2
MON#5` (a Monday the 29th of February) next fires in 2044, a walk of about
a millisecond, three on a loaded machine. Searched per job in the writer,
one CreateJobs of 5,000 such jobs held everyone's writes 3 to 7 seconds,
and GetJobs and FinishJobs of 1,000 leased ones 0.6 to 1.3 seconds each. A
next run is now remembered per (rule, zone) for the span it holds (for
the minute, for a `*` minute or hour in a zone with daylight saving), and
found in a thread before the writer for the rules a request carries:
these check that one rule costs one search however many jobs carry it,
that jobs of many rules handed out and finished in later minutes search
no more, and that the remembered answer is always the one a search gives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import ServerProcess, ThreadServer
from jobserver.model import cron, times, windows
from wire import Client

DECADES_AWAY = "CRON 0 0 * 2 MON#5"
MANY = 5_000
# GetJobs and FinishJobs take at most this many jobs.
BATCH = 1_000
# One CreateJobs of MANY jobs held a neighbour's CreateJob 3 s on the
# machine this was written on (7 s in the issue, 4.5 s in this test); now a
# quarter second quiet, and up to 1.0 and 2.8 s seen in CI runs here with
# the whole suite beside it (the writer's 5,000 inserts under load).
NEIGHBOUR_BOUND = 3.0
# A search in the thread before the writer, and one in the writer if the
# minute turns between them.
MOST_SEARCHES = 2
# Jobs of BATCH distinct decade-away rules, finished in a new minute, held a
# neighbour's CreateJob 1.9 s (4.5 s in this test); now no search at all,
# and the wait is the writer's 1,000 finishes: 0.45 s seen on a loaded
# machine, so twice that, still well short of a search per rule.
QUICK_NEIGHBOUR = 1.0


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The rules cronsim is asked to walk, one entry per search, as the
    server in this process asks."""
    seen: list[str] = []
    search = cron.runs_after

    def counted(rule: str, zone_name: str, after: datetime) -> Iterator[datetime]:
        seen.append(rule)
        return search(rule, zone_name, after)

    monkeypatch.setattr(cron, "runs_after", counted)
    yield seen


def test_many_jobs_of_one_rule_cost_one_search(server: ThreadServer, searches: list[str]) -> None:
    with server.client(timeout=120) as client:
        jobs = [{"name": f"leap/{i}", "repeat": DECADES_AWAY} for i in range(MANY)]
        assert client.request("CreateJobs", jobs=jobs).code == 200
        assert len(searches) <= MOST_SEARCHES
        # Leased and due now: handing each out ends its lease at the
        # rule's next run, if that comes first, and finishing each queues
        # it for that run.
        due = {"repeat": DECADES_AWAY, "firstRun": "2000-01-01 00:00:00", "retryAfter": "+1 HOUR"}
        jobs = [{"name": "due", **due} for _ in range(BATCH)]
        assert client.request("CreateJobs", jobs=jobs).code == 200
        searches.clear()
        reply = client.request("GetJobs", name="due", numResults=BATCH)
        assert reply.code == 200 and len(reply.json["jobs"]) == BATCH
        assert len(searches) <= 1
        finished = [{"jobID": job["jobID"]} for job in reply.json["jobs"]]
        reply = client.request("FinishJobs", jobs=finished)
        assert reply.code == 200, reply.status
        assert len(searches) <= 2


@contextmanager
def neighbour(client: Client) -> Iterator[list[float]]:
    """A neighbour creating a job again and again while the block runs,
    answered once before it starts; the waits it saw."""
    waits: list[float] = []
    sent = threading.Event()
    done = threading.Event()

    def create() -> None:
        while not done.is_set():
            began = time.monotonic()
            assert client.request("CreateJob", name="neighbour").code == 200
            waits.append(time.monotonic() - began)
            sent.set()
            done.wait(0.02)

    worker = threading.Thread(target=create)
    worker.start()
    try:
        assert sent.wait(30), "the neighbour was never answered"
        yield waits
    finally:
        done.set()
        worker.join(120)


def test_a_neighbours_create_waits_no_search_per_job(start_server: Any) -> None:
    server: ServerProcess = start_server()
    with server.client(timeout=120) as client, server.client(timeout=120) as other:
        jobs = [{"name": f"leap/{i}", "repeat": DECADES_AWAY} for i in range(MANY)]
        with neighbour(other) as waits:
            assert client.request("CreateJobs", jobs=jobs).code == 200
    assert max(waits) < NEIGHBOUR_BOUND, f"the neighbour waited {max(waits):.2f}s"


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> list[timedelta]:
    """How far the clock of the server in this process is ahead of the
    machine's: set its element to move the server on in time."""
    ahead = [timedelta(0)]
    machine = times.utcnow
    monkeypatch.setattr(times, "utcnow", lambda: machine() + ahead[0])
    return ahead


def test_jobs_of_distinct_rules_search_no_more_in_later_minutes(
    server: ThreadServer, searches: list[str], later: list[timedelta]
) -> None:
    """Remembered per minute, each rule was searched again in the writer
    when its jobs were handed out or finished in a later minute: 1,000
    distinct decade-away rules held the writer 1.9 s a request."""
    rules = [f"CRON {minute} {hour} * 2 MON#5" for hour in range(24) for minute in range(60)]
    due = {"firstRun": "2000-01-01 00:00:00", "retryAfter": "+1 HOUR"}
    jobs = [{"name": "far", "repeat": rule, **due} for rule in rules[:BATCH]]
    with server.client(timeout=120) as client, server.client(timeout=120) as other:
        assert client.request("CreateJobs", jobs=jobs).code == 200
        searches.clear()
        later[0] = timedelta(minutes=2)
        reply = client.request("GetJobs", name="far", numResults=BATCH)
        assert reply.code == 200 and len(reply.json["jobs"]) == BATCH
        assert len(searches) == 0
        later[0] = timedelta(minutes=4)
        finished = [{"jobID": job["jobID"]} for job in reply.json["jobs"]]
        with neighbour(other) as waits:
            reply = client.request("FinishJobs", jobs=finished)
        assert reply.code == 200, reply.status
        assert len(searches) == 0
    assert max(waits) < QUICK_NEIGHBOUR, f"the neighbour waited {max(waits):.2f}s"


# The remembered answer is the searched one.

_PLAUSIBLE = st.tuples(
    st.sampled_from(["0", "30", "*", "*/15", "5,35", "0-10", "59"]),
    st.sampled_from(["*", "0", "2", "9", "1-3", "*/6", "23"]),
    st.sampled_from(["*", "1", "15", "29", "31", "1-7", "L", "LW", "15W"]),
    st.sampled_from(["*", "2", "3", "10", "11", "FEB", "3,10", "*/3"]),
    st.sampled_from(["*", "MON", "SUN", "MON-FRI", "MON#5", "5L", "0", "7"]),
).map(lambda fields: "CRON " + " ".join(fields))
_ZONES = st.sampled_from([
    "", "UTC", "Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata",
    "America/St_Johns", "Pacific/Chatham", "Europe/Amsterdam", "Africa/Monrovia",
])
# Clocks changing in these zones (in UTC), where the rules' DST handling
# shows; Amsterdam and Monrovia kept offsets of seconds before 1937 and
# 1972, where a minute of UTC is not one of the wall clock.
_CHANGES = [
    datetime(2027, 3, 28, 1, tzinfo=UTC), datetime(2027, 10, 31, 1, tzinfo=UTC),
    datetime(2027, 3, 14, 7, tzinfo=UTC), datetime(2027, 11, 7, 6, tzinfo=UTC),
    datetime(2027, 4, 3, 15, tzinfo=UTC), datetime(2027, 10, 2, 15, 30, tzinfo=UTC),
    datetime(1937, 7, 1, tzinfo=UTC), datetime(1972, 1, 7, tzinfo=UTC),
]
_MOMENTS = st.one_of(
    st.datetimes(datetime(1900, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC)),
    st.builds(
        lambda change, seconds: change + timedelta(seconds=seconds),
        st.sampled_from(_CHANGES),
        st.floats(-4 * 3600, 4 * 3600),
    ),
)


def _cronsim_loops(zone: str, moment: datetime) -> bool:
    """Whether a search from `moment` may never end in cronsim 2.8: in St.
    John's, whose clocks went back at 00:01 from 2007 to 2010, a rule of a
    Sunday in November with a `*` hour (`30 * 31 11 SUN`) loops there for
    good, from any moment of those years (found when this test ran for
    minutes). No search of the server's starts before its own now."""
    return zone == "America/St_Johns" and 2006 <= moment.year <= 2011


@settings(max_examples=300, deadline=None)
@given(_PLAUSIBLE, _ZONES, _MOMENTS, st.integers(0, 59_999_999))
def test_a_remembered_next_run_is_the_one_a_search_gives(
    rule: str, zone: str, moment: datetime, earlier: int
) -> None:
    assume(not _cronsim_loops(zone, moment))
    try:
        stored = cron.normalise(rule)
    except cron.MalformedCron:
        return
    # Another moment of the same minute asks first, and is remembered.
    minute = moment.replace(second=0, microsecond=0)
    first = minute + timedelta(microseconds=earlier)
    for after in (first, moment):
        assert cron.next_run(stored, zone, after) == cron.search_next_run(stored, zone, after)


@settings(max_examples=300, deadline=None)
@given(_PLAUSIBLE, _ZONES, _MOMENTS, st.floats(0, 1), st.booleans(), st.floats(-4 * 3600, 4 * 3600))
def test_a_next_run_remembered_for_its_span_is_the_one_a_search_gives(
    rule: str, zone: str, moment: datetime, part: float, near_change: bool, seconds: float
) -> None:
    """A run remembered after one moment answers for later ones, up to it
    (for rules whose moments do not depend on where a search starts):
    asked at any of them, it is what a fresh search gives, across changes
    of the zone's offset too."""
    assume(not _cronsim_loops(zone, moment))
    try:
        stored = cron.normalise(rule)
    except cron.MalformedCron:
        return
    found = cron.next_run(stored, zone, moment)
    assert found == cron.search_next_run(stored, zone, moment)
    if found is None:
        return
    after = moment + (found - moment) * part
    change = _offset_change_after(zone, after) if near_change else None
    if change is not None:
        after = change + timedelta(seconds=seconds)
    after = min(max(after, moment), found - timedelta(microseconds=1))
    assert cron.next_run(stored, zone, after) == cron.search_next_run(stored, zone, after)


def _offset_change_after(zone_name: str, moment: datetime) -> datetime | None:
    """The first change of the zone's offset within a year after `moment`,
    to the second."""
    zone = windows.parse_zone(zone_name or "UTC")
    offset = moment.astimezone(zone).utcoffset()
    before = moment
    for days in range(1, 367):
        after = moment + timedelta(days=days)
        if after.astimezone(zone).utcoffset() != offset:
            break
        before = after
    else:
        return None
    while after - before > timedelta(seconds=1):
        middle = before + (after - before) / 2
        if middle.astimezone(zone).utcoffset() == offset:
            before = middle
        else:
            after = middle
    return after


def test_a_request_carries_at_most_so_many_distinct_rules(server: ThreadServer) -> None:
    """More distinct rules than are remembered at once were searched again
    in the writer (7,000 held a neighbour 5 s): a request may carry
    MOST_RULES_A_REQUEST distinct rule-and-zone pairs, however many jobs."""
    most = cron.MOST_RULES_A_REQUEST
    rules = [f"CRON {minute} {hour} * * *" for hour in range(24) for minute in range(60)]
    refused = f"402 Too many CRON rules ({most} distinct rules and time zones a request at most)"
    with server.client(timeout=120) as client:
        over = [{"name": f"r/{i}", "repeat": rule} for i, rule in enumerate(rules[: most + 1])]
        assert client.request("CreateJobs", jobs=over).status == refused
        # The same rule in another zone is another pair.
        zoned = [*over[:most], {"name": "r/z", "repeat": rules[0], "timeZone": "Europe/Paris"}]
        assert client.request("CreateJobs", jobs=zoned).status == refused
        nothing = client.request("CancelQueuedJobs", name="r/*", dryRun="true").json
        assert nothing["matched"] == 0
        # At the bound, and many jobs of one rule, are served.
        assert client.request("CreateJobs", jobs=over[:most]).code == 200
        same = [{"name": f"s/{i}", "repeat": rules[0]} for i in range(most + 1)]
        assert client.request("CreateJobs", jobs=same).code == 200
