"""What CRON repeats cost the writer (issue 34, item 2).

cronsim finds a rule's next moment by walking the calendar: `0 0 * 2
MON#5` (a Monday the 29th of February) next fires in 2044, a walk of about
a millisecond, three on a loaded machine. Searched per job in the writer,
one CreateJobs of 5,000 such jobs held everyone's writes 3 to 7 seconds,
and GetJobs and FinishJobs of 1,000 leased ones 0.6 to 1.3 seconds each. A
next run is now remembered per (rule, zone, minute), and found in a thread
before the writer for the rules a request carries: these check that one
rule costs one search however many jobs carry it, and that the remembered
answer is always the one a search gives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ServerProcess, ThreadServer
from jobserver.model import cron
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


def test_a_neighbours_create_waits_no_search_per_job(start_server: Any) -> None:
    server: ServerProcess = start_server()
    waits: list[float] = []
    sent = threading.Event()
    done = threading.Event()

    def neighbour(client: Client) -> None:
        while not done.is_set():
            began = time.monotonic()
            assert client.request("CreateJob", name="neighbour").code == 200
            waits.append(time.monotonic() - began)
            sent.set()
            done.wait(0.02)

    with server.client(timeout=120) as client, server.client(timeout=120) as other:
        jobs = [{"name": f"leap/{i}", "repeat": DECADES_AWAY} for i in range(MANY)]
        worker = threading.Thread(target=neighbour, args=(other,))
        worker.start()
        try:
            assert sent.wait(30), "the neighbour was never answered"
            assert client.request("CreateJobs", jobs=jobs).code == 200
        finally:
            done.set()
            worker.join(120)
    assert max(waits) < NEIGHBOUR_BOUND, f"the neighbour waited {max(waits):.2f}s"


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


@settings(max_examples=300, deadline=None)
@given(_PLAUSIBLE, _ZONES, _MOMENTS, st.integers(0, 59_999_999))
def test_a_remembered_next_run_is_the_one_a_search_gives(
    rule: str, zone: str, moment: datetime, earlier: int
) -> None:
    try:
        stored = cron.normalise(rule)
    except cron.MalformedCron:
        return
    # Another moment of the same minute asks first, and is remembered.
    minute = moment.replace(second=0, microsecond=0)
    first = minute + timedelta(microseconds=earlier)
    for after in (first, moment):
        assert cron.next_run(stored, zone, after) == cron.search_next_run(stored, zone, after)


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
