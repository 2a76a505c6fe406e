"""A repeating job never runs twice for the same base moment.

Rules that do not move forward from their base are refused when a client
sends them (CreateJob, CreateJobs, UpdateJob); a rule that still gives a
time not later than its base when it is used (one stored before rules were
checked) fails its job instead of queueing it again at once.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conformance_helpers import force, get_job, utcnow
from helpers import create, ok
from jobserver.core import repeat, sqlite_functions

FAST = settings(max_examples=400, deadline=None)

NOT_FORWARD = "402 Malformed repeat: does not move forward from "

STALLED = [
    "SCHEDULED, +0 SECONDS",
    "SCHEDULED, -1 HOUR",
    "FINISHED, START OF DAY",
    # On a Monday it stays on the same moment.
    "FINISHED, WEEKDAY 1",
    "STARTED, +1 HOUR, -60 MINUTES",
    "SCHEDULED, START OF MONTH, +27 DAYS",
    # From March 1st of a common year, a month on and 28 days back.
    "FINISHED, +1 MONTH, -28 DAYS",
    # From any time past the half hour: back to the same hour's 29th minute.
    "FINISHED, +30 MINUTES, START OF HOUR, +29 MINUTES",
    # A common year from March of a leap year.
    "SCHEDULED, +1 YEAR, -365 DAYS",
    # Six years from March 2096 hold no leap day: 2100 is not a leap year.
    "STARTED, +6 YEARS, -999 DAYS, -999 DAYS, -192 DAYS",
]

FORWARD = [
    "HOURLY",
    "DAILY",
    "WEEKLY",
    "FINISHED, +1 HOUR",
    "SCHEDULED, +1 SECOND",
    "SCHEDULED, +1 DAY, START OF DAY, +4 HOURS",
    "FINISHED, +1 DAY, WEEKDAY 1",
    "FINISHED, +1 DAY, WEEKDAY 1, START OF DAY, +6 HOURS",
    "STARTED, +1 MONTH",
    "SCHEDULED, +1 HOUR, START OF HOUR",
    "FINISHED, START OF MONTH, +1 MONTH",
    "FINISHED, +1 YEAR, START OF YEAR",
    "SCHEDULED, +1 MONTH, -27 DAYS",
    "FINISHED, -1 HOUR, +2 HOURS",
]


# The check itself.


@pytest.mark.parametrize("text", STALLED)
def test_rules_that_do_not_move_forward_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(repeat.MalformedRepeat) as refused:
        repeat.check_moves_forward(repeat.parse_repeat(text))
    assert refused.value.reason.startswith("does not move forward from ")


@pytest.mark.parametrize("text", FORWARD)
def test_rules_that_move_forward_are_accepted(text: str) -> None:
    repeat.check_moves_forward(repeat.parse_repeat(text))


def test_the_reason_names_a_base_and_what_the_rule_gives_there() -> None:
    with pytest.raises(repeat.MalformedRepeat) as refused:
        repeat.check_moves_forward(repeat.parse_repeat("SCHEDULED, -1 HOUR"))
    assert refused.value.reason == (
        "does not move forward from 2024-01-01 00:00:00 (gives 2023-12-31 23:00:00)"
    )


def test_a_rule_beyond_sqlites_range_is_refused() -> None:
    text = "FINISHED, " + ", ".join(["+999 YEARS"] * 8)
    with pytest.raises(repeat.MalformedRepeat) as refused:
        repeat.check_moves_forward(repeat.parse_repeat(text))
    assert refused.value.reason.startswith("out of range from ")


def test_samples_cover_every_weekday_month_ends_and_the_ends_of_the_day() -> None:
    bases = [datetime.fromisoformat(b) for b in repeat.sample_bases(("+1 HOURS",))]
    assert {b.weekday() for b in bases} == set(range(7))
    days = {b.date() for b in bases}
    for day in ("2024-02-28", "2024-02-29", "2023-02-28", "2024-04-30", "2024-12-31"):
        assert datetime.fromisoformat(day).date() in days
    assert {b.strftime("%H:%M:%S") for b in bases} >= {"00:00:00", "12:00:00", "23:59:59"}


# Properties, against SQLite's own arithmetic.



@st.composite
def modifiers(draw: st.DrawFn) -> str:
    """A modifier, with numbers that often nearly cancel another's."""
    kind = draw(st.sampled_from(["offset", "offset", "offset", "start", "weekday"]))
    if kind == "start":
        return "START OF " + draw(st.sampled_from(["HOUR", "DAY", "MONTH", "YEAR"]))
    if kind == "weekday":
        return f"WEEKDAY {draw(st.integers(0, 6))}"
    unit = draw(st.sampled_from(["SECONDS", "MINUTES", "HOURS", "DAYS", "MONTHS", "YEARS"]))
    limit = 99_999_999 if unit == "SECONDS" else 999
    interesting = [0, 1, 2, 6, 7, 12, 23, 24, 27, 28, 29, 30, 31, 59, 60, 364, 365, 366]
    if unit == "SECONDS":
        interesting += [59, 1799, 1800, 3599, 3600, 86399, 86400, 2_505_600]
    number = draw(st.sampled_from(interesting) | st.integers(0, limit))
    return f"{draw(st.sampled_from('+-'))}{number} {unit}"


rules = st.builds(
    lambda base, parts: ", ".join([base, *parts]),
    st.sampled_from(["SCHEDULED", "STARTED", "FINISHED"]),
    st.lists(modifiers(), min_size=1, max_size=4),
)

# Whole seconds in SQLite's range, 0000-01-01 to 9999-12-31, often at the
# edges of a day, an hour or a month.
_FIRST, _LAST = datetime(1, 1, 1), datetime(9999, 12, 31, 23, 59, 59)
bases = st.one_of(
    st.datetimes(min_value=_FIRST, max_value=_LAST).map(lambda m: m.replace(microsecond=0)),
    st.builds(
        lambda day, second: day + timedelta(seconds=second),
        st.dates(min_value=_FIRST.date(), max_value=_LAST.date()).map(
            lambda d: datetime(d.year, d.month, d.day)
        ),
        st.sampled_from([0, 1, 59, 60, 1799, 1800, 3599, 3600, 43200, 86340, 86399]),
    ),
).map(lambda m: f"{m.year:04d}-{m:%m-%d %H:%M:%S}")


@FAST
@given(rule=rules, base=bases)
@example(rule="FINISHED, +30 MINUTES, START OF HOUR, +29 MINUTES", base="2026-05-05 10:29:30")
@example(rule="STARTED, +100 HOURS, START OF MONTH, +23 DAYS, +6 MINUTES",
         base="2000-08-27 01:00:00")
def test_an_accepted_rule_moves_forward_from_any_base(rule: str, base: str) -> None:
    parsed = repeat.parse_repeat(rule)
    try:
        repeat.check_moves_forward(parsed)
    except repeat.MalformedRepeat:
        return
    computed = sqlite_functions.datetime_after(base, parsed.modifiers)
    # None: past the year 9999 from this base, answered 502 by the server.
    assert computed is None or computed > base, (rule, base, computed)


@FAST
@given(rule=rules, base=bases)
def test_the_check_computes_as_the_store_does(rule: str, base: str) -> None:
    modifiers = repeat.parse_repeat(rule).modifiers
    computed = sqlite_functions.datetime_after(base, modifiers)
    found = repeat.first_not_later(modifiers, [base])
    if computed is not None and computed > base:
        assert found is None
    else:
        assert found == (base, computed)


# Over the wire: refused where a client sends a rule.


@pytest.mark.parametrize("text", STALLED[:4])
def test_create_job_refuses_a_rule_that_does_not_move_forward(client, text):
    reply = client.request("CreateJob", name="loop", repeat=text)
    assert reply.status.startswith(NOT_FORWARD), reply.status
    assert client.request("GetJob", name="loop").status == "404 No job found"


@pytest.mark.parametrize("text", STALLED[:4])
def test_create_jobs_refuses_it_and_creates_nothing(client, text):
    reply = client.request(
        "CreateJobs", jobs=[{"name": "fine"}, {"name": "loop", "repeat": text}]
    )
    assert reply.status.startswith(NOT_FORWARD), reply.status
    assert client.request("GetJob", name="*").status == "404 No job found"


@pytest.mark.parametrize("text", STALLED[:4])
def test_update_job_refuses_it_and_changes_nothing(client, text):
    job_id = create(client, "job", repeat="HOURLY", data={"a": 1})
    reply = client.request("UpdateJob", jobID=job_id, data={"b": 2}, repeat=text)
    assert reply.status.startswith(NOT_FORWARD), reply.status
    job = ok(client.request("QueryJob", jobID=job_id)).json
    assert (job["repeat"], job["data"]) == ("HOURLY", {"a": 1})


def test_a_syntax_error_keeps_the_bare_status_line(client):
    reply = client.request("CreateJob", name="x", repeat="FINISHED, +1 FORTNIGHT")
    assert reply.status == "402 Malformed repeat"


def _offsets(count: int) -> str:
    return "FINISHED, " + ", ".join(["+1 SECONDS"] * count)


def test_a_rule_longer_than_the_check_takes_is_a_clients_mistake(client):
    # Thirty modifiers were answered "502 Query failed: parser stack
    # overflow" (the check's SQL nests one call per modifier): a server
    # error, which a client may send again.
    for count in (9, 30):
        reply = client.request("CreateJob", name="long", repeat=_offsets(count))
        assert reply.status == "402 Malformed repeat: more than 8 modifiers", reply.status
    assert client.request("GetJob", name="long").status == "404 No job found"
    create(client, "long", repeat=_offsets(8))


@pytest.mark.parametrize("text", FORWARD)
def test_rules_that_move_forward_still_create_and_repeat(client, text):
    job_id = create(client, "fine", repeat=text)
    get_job(client, "fine")
    ok(client.request("FinishJob", jobID=job_id))
    job = ok(client.request("QueryJob", jobID=job_id)).json
    assert job["state"] == "QUEUED"
    assert job["nextRun"] > job["created"]


# Over the wire: a stored rule that stalls fails its job instead of looping.


def _stored_rule(server, job_id: int, text: str) -> None:
    """A rule as an older server would have stored it, unchecked."""
    force(server.db, "UPDATE jobs SET repeat = ? WHERE jobID = ?", (text, job_id))


def _failed(client, job_id: int) -> str:
    """The job's lastError; it must be FAILED and in the dead set."""
    listed = ok(client.request("FailedJobs")).json["jobs"]
    errors = {job["jobID"]: job["lastError"] for job in listed}
    assert job_id in errors, listed
    return errors[job_id]


@pytest.mark.parametrize("report", ["FinishJob", "RetryJob"])
def test_a_stored_rule_that_stalls_fails_the_job_when_it_is_reported(server, client, report):
    job_id = create(client, "legacy", repeat="HOURLY")
    get_job(client, "legacy")
    _stored_rule(server, job_id, "FINISHED, +0 SECONDS")
    reply = client.request(report, jobID=job_id, data={"done": True})
    assert reply.status == "200 OK"
    error = _failed(client, job_id)
    assert error.startswith("repeat rule did not move forward from "), error
    # Not queued again: no second run for the same moment.
    assert client.request("GetJob", name="legacy").status == "404 No job found"
    rows = ok(client.request("Query", query=f"SELECT data FROM jobs WHERE jobID = {job_id};"))
    assert rows.body.decode().splitlines()[1] == '{"done":true}'


def test_a_stored_scheduled_rule_that_stalls_names_its_base(server, client):
    job_id = create(client, "legacy", repeat="HOURLY", firstRun="2020-01-02 03:04:05")
    get_job(client, "legacy")
    _stored_rule(server, job_id, "SCHEDULED, -1 HOUR")
    ok(client.request("FinishJob", jobID=job_id))
    assert _failed(client, job_id) == (
        "repeat rule did not move forward from 2020-01-02 03:04:05 (gave 2020-01-02 02:04:05)"
    )


def test_a_leased_job_whose_stored_rule_stalls_is_failed_not_handed_out(server, client):
    job_id = create(client, "leased", repeat="HOURLY", retryAfter="+5 MINUTES")
    _stored_rule(server, job_id, "STARTED, START OF DAY")
    assert client.request("GetJob", name="leased").status == "404 No job found"
    assert _failed(client, job_id).startswith("repeat rule did not move forward from ")


def test_touch_job_of_a_job_whose_stored_rule_stalls_fails_it(server, client):
    job_id = create(client, "leased", repeat="HOURLY", retryAfter="+5 MINUTES")
    lease = ok(client.request("GetJob", name="leased")).headers["leaseID"]
    _stored_rule(server, job_id, "FINISHED, -1 SECOND")
    reply = client.request("TouchJob", jobID=job_id, leaseID=lease)
    assert reply.status.startswith(NOT_FORWARD), reply.status
    assert reply.status.endswith("; the job failed")
    assert _failed(client, job_id).startswith("repeat rule did not move forward from ")
    # Its worker's report is then refused: the job is no longer running.
    assert client.request("FinishJob", jobID=job_id).status.startswith("405 ")


def test_a_job_with_a_retry_policy_is_failed_too_not_retried(server, client):
    job_id = create(client, "policy", repeat="HOURLY", maxAttempts=5)
    get_job(client, "policy")
    _stored_rule(server, job_id, "FINISHED, START OF HOUR")
    ok(client.request("FinishJob", jobID=job_id))
    job = ok(client.request("QueryJob", jobID=job_id)).json
    assert job["state"] == "FAILED"
    assert job["lastError"].startswith("repeat rule did not move forward from ")


def test_the_check_does_not_mistake_another_spelling_of_the_base(server, client):
    # A leased SCHEDULED job counts from the originalNextRun in its data,
    # which a client may have written in ISO form.
    job_id = create(client, "iso", repeat="SCHEDULED, +1 HOUR", retryAfter="+5 MINUTES")
    get_job(client, "iso")
    base = (utcnow() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    force(server.db, "UPDATE jobs SET data = ? WHERE jobID = ?",
          (f'{{"originalNextRun":"{base}"}}', job_id))
    ok(client.request("FinishJob", jobID=job_id))
    job = ok(client.request("QueryJob", jobID=job_id)).json
    assert job["state"] == "QUEUED"
    expected = datetime.fromisoformat(base) + timedelta(hours=1)
    assert job["nextRun"] == expected.strftime("%Y-%m-%d %H:%M:%S")


# The check costs milliseconds; it must not cost them in the writer thread,
# which every other request waits for.


@pytest.mark.parametrize(
    "method, params",
    [
        ("CreateJob", {"name": "warm", "repeat": "STARTED, +1 MONTH, WEEKDAY 3, +5 HOURS"}),
        ("CreateJobs", {"jobs": [{"name": "warm", "repeat": "SCHEDULED, +2 MONTHS, WEEKDAY 4"}]}),
    ],
)
def test_a_new_rule_is_checked_before_the_writer_sees_it(server, client, method, params):
    repeat._problem.cache_clear()
    reply = client.request(method, **params)
    assert reply.code == 200, reply.status
    info = repeat._problem.cache_info()
    # Computed once, in the checking thread; the writer found it done.
    assert (info.misses, info.hits) == (1, 1)
