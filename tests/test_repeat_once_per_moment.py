"""A repeating job never runs twice for one computed moment.

Every rule that parses is accepted, as Bedrock does, even one whose next
moment is not later than its base (`FINISHED, START OF DAY`,
`SCHEDULED, -1 HOUR`): such a job is due again at once. A rule that gives
the very moment the job's run was due would run it again for that moment:
the job fails instead, with the reason as its lastError.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance_helpers import force, get_job, utcnow
from helpers import create, ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import schedule
from jobserver.model import times
from jobserver.model.jobs import Job, State

# The check is the core's; the stores keep the times and data it reads.
pytestmark = pytest.mark.backends

AGAIN = "the moment this run was due: it would run again for the same moment"

# Rules Bedrock accepts whose result can be at or before their base.
NOT_LATER = [
    "SCHEDULED, +0 SECONDS",
    "SCHEDULED, -1 HOUR",
    "FINISHED, START OF DAY",
    "FINISHED, WEEKDAY 1",
    "STARTED, +1 HOUR, -60 MINUTES",
    "SCHEDULED, START OF DAY, +5 MINUTES, START OF HOUR",
    "SCHEDULED, START OF DAY, +30 MINUTES, START OF HOUR, +5 MINUTES",
    "FINISHED, +1 MONTH, -28 DAYS",
    # Past the year 9999 from any base: computed only when it is used.
    "FINISHED, " + ", ".join(["+999 YEARS"] * 11),
    # More modifiers than Bedrock's own rules ever use.
    "FINISHED, " + ", ".join(["+1 SECONDS"] * 30),
]


def _yesterday_noon() -> str:
    return (utcnow() - timedelta(days=1)).strftime("%Y-%m-%d") + " 12:00:00"


def _day_start(moment: str) -> str:
    return moment[:10] + " 00:00:00"


def _job(client, job_id: int) -> dict:
    return ok(client.request("QueryJob", jobID=job_id)).json


def _last_error(client, job_id: int) -> str:
    """The job's lastError; it must be FAILED and in the dead set."""
    listed = ok(client.request("FailedJobs")).json["jobs"]
    errors = {job["jobID"]: job["lastError"] for job in listed}
    assert job_id in errors, listed
    return errors[job_id]


# Accepted where a client sends a rule.


def test_every_rule_bedrock_accepts_is_accepted_by_create_update_and_create_jobs(client):
    for text in NOT_LATER:
        job_id = create(client, "any", repeat=text, firstRun=_yesterday_noon())
        assert _job(client, job_id)["repeat"] == text
        ok(client.request("CreateJobs", jobs=[{"name": "many", "repeat": text}]))
        reply = client.request("UpdateJob", jobID=job_id, data={}, repeat="HOURLY")
        ok(reply)
        if "+999 YEARS" not in text:
            ok(client.request("UpdateJob", jobID=job_id, data={}, repeat=text))
    assert client.request("CreateJob", name="x", repeat="FINISHED, +1 FORTNIGHT").status == (
        "402 Malformed repeat"
    )


def test_update_job_may_give_the_moment_the_job_already_has(client):
    # Not a run: the job still runs once for that moment.
    first = _yesterday_noon()
    job_id = create(client, "job", firstRun=first)
    ok(client.request("UpdateJob", jobID=job_id, data={}, repeat="SCHEDULED, +0 SECONDS"))
    job = _job(client, job_id)
    assert (job["state"], job["nextRun"]) == ("QUEUED", first)


# At run time.


@pytest.mark.parametrize("report", ["FinishJob", "RetryJob"])
def test_bedrocks_start_of_hour_rule_runs_once_for_the_moment_it_gives(client, report):
    rule = "SCHEDULED, START OF DAY, +5 MINUTES, START OF HOUR"
    job_id = create(client, "job", repeat=rule, firstRun=_yesterday_noon())
    get_job(client, "job")
    ok(client.request("RetryJob", jobID=job_id))
    midnight = _day_start(_yesterday_noon())
    job = _job(client, job_id)
    assert (job["state"], job["nextRun"]) == ("QUEUED", midnight)
    # Due at once, as in Bedrock; run for that moment, it gives it again.
    get_job(client, "job")
    reply = client.request(report, jobID=job_id, data={"done": True})
    assert reply.status == "200 OK"
    assert _last_error(client, job_id) == f"repeat rule gave {midnight} from {midnight}, {AGAIN}"
    assert _job(client, job_id)["data"] == {"done": True}
    assert client.request("GetJob", name="job").status == "404 No job found"


# Rules of offsets alone that give a moment not later than their base:
# after every run the job would be due again at once (it was handed out
# again and again, for an earlier moment each time).
LOOPING = ["SCHEDULED, -1 HOUR", "STARTED, -5 MINUTES", "FINISHED, -1 HOUR",
           "STARTED, +0 SECONDS", "FINISHED, +1 HOUR, -60 MINUTES"]


@pytest.mark.parametrize("rule", LOOPING)
@pytest.mark.parametrize("report", ["FinishJob", "RetryJob"])
def test_a_rule_that_would_make_the_job_due_at_once_after_every_run_ends_it(
    client, rule, report
):
    job_id = create(client, "back", repeat=rule, firstRun=_yesterday_noon())
    get_job(client, "back")
    assert client.request(report, jobID=job_id, data={"done": True}).status == "200 OK"
    error = _last_error(client, job_id)
    assert error.startswith(f"repeat rule {rule!r} gave "), error
    assert error.endswith("not later than the run it follows: the job would be due again "
                          "at once after every run"), error
    assert _job(client, job_id)["data"] == {"done": True}
    assert client.request("GetJob", name="back").status == "404 No job found"


def test_a_leased_job_of_such_a_rule_is_failed_when_handed_out(client):
    # Its lease would end at the rule's next moment, already past.
    job_id = create(client, "leased", repeat="STARTED, -5 MINUTES", retryAfter="+5 MINUTES")
    assert client.request("GetJob", name="leased").status == "404 No job found"
    assert _last_error(client, job_id).startswith("repeat rule 'STARTED, -5 MINUTES' gave ")


def test_a_rule_that_catches_up_runs_once_for_each_missed_moment(client):
    # Far behind, each next moment is due at once, but later than the last.
    job_id = create(client, "late", repeat="SCHEDULED, +1 DAY", firstRun="2020-01-01 10:00:00")
    for day in (2, 3):
        get_job(client, "late")
        ok(client.request("FinishJob", jobID=job_id))
        job = _job(client, job_id)
        assert (job["state"], job["nextRun"]) == ("QUEUED", f"2020-01-0{day} 10:00:00")


def test_a_leased_job_whose_lease_would_end_when_it_was_due_is_failed_not_handed_out(client):
    job_id = create(client, "leased", repeat="STARTED, START OF DAY", retryAfter="+5 MINUTES",
                    firstRun=_yesterday_noon())
    # Its lease ends at today's 00:00:00, already past: due again at once...
    handed = get_job(client, "leased")
    assert handed["jobID"] == job_id
    today = _day_start(_job(client, job_id)["lastRun"])
    assert _job(client, job_id)["nextRun"] == today
    # ...and handed out for that moment, the rule gives it again.
    assert client.request("GetJob", name="leased").status == "404 No job found"
    # From the second GetJob's moment: the first's lastRun, or a second
    # later if the clock's second turned between the two.
    first = datetime.strptime(_job(client, job_id)["lastRun"], "%Y-%m-%d %H:%M:%S")
    moments = [(first + timedelta(seconds=s)).strftime("%Y-%m-%d %H:%M:%S") for s in (0, 1)]
    assert _last_error(client, job_id) in [
        f"repeat rule gave {today} from {started}, {AGAIN}" for started in moments
    ]


def test_touch_job_of_a_job_whose_rule_gives_its_due_moment_fails_it(server, client):
    rule = "SCHEDULED, START OF DAY"
    job_id = create(client, "leased", repeat=rule, retryAfter="+5 MINUTES",
                    firstRun=_yesterday_noon())
    lease = ok(client.request("GetJob", name="leased")).headers["leaseID"]
    # Due at midnight, as its worker's earlier run of it would have left it.
    midnight = _day_start(_yesterday_noon())
    force(server.db, "UPDATE jobs SET data = ? WHERE jobID = ?",
          (f'{{"originalNextRun":"{midnight}"}}', job_id))
    reply = client.request("TouchJob", jobID=job_id, leaseID=lease)
    assert reply.status == (
        f"402 Malformed repeat: gives {midnight} from {midnight}, the moment this run was due; "
        "the job failed"
    )
    assert _last_error(client, job_id).startswith(f"repeat rule gave {midnight} from ")
    # Its worker's report is then refused: the job is no longer running.
    assert client.request("FinishJob", jobID=job_id).status.startswith("405 ")


def test_a_job_with_a_retry_policy_is_failed_too_not_retried(client):
    job_id = create(client, "policy", repeat="FINISHED, START OF HOUR", maxAttempts=5,
                    firstRun=_yesterday_noon())
    get_job(client, "policy")
    ok(client.request("FinishJob", jobID=job_id))
    assert _job(client, job_id)["state"] == "QUEUED"
    get_job(client, "policy")
    ok(client.request("FinishJob", jobID=job_id))
    assert _last_error(client, job_id).startswith("repeat rule gave ")


def test_a_leased_scheduled_job_catching_up_is_handed_out_again(server, client):
    # Its data keeps the originalNextRun of the run before, which its rule
    # counts from: the time it gives is the job's nextRun, not a stall.
    job_id = create(client, "late", repeat="SCHEDULED, +5 HOURS", retryAfter="+5 MINUTES",
                    firstRun="2020-01-01 10:00:00")
    get_job(client, "late")
    ok(client.request("FinishJob", jobID=job_id))
    job = _job(client, job_id)
    assert (job["state"], job["nextRun"]) == ("QUEUED", "2020-01-01 15:00:00")
    assert get_job(client, "late")["jobID"] == job_id
    assert _job(client, job_id)["state"] == "RUNQUEUED"


def test_the_check_does_not_mistake_another_spelling_of_the_base(server, client):
    # A leased SCHEDULED job counts from the originalNextRun in its data,
    # which a client may have written in ISO form.
    job_id = create(client, "iso", repeat="SCHEDULED, +1 HOUR", retryAfter="+5 MINUTES")
    get_job(client, "iso")
    base = (utcnow() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    force(server.db, "UPDATE jobs SET data = ? WHERE jobID = ?",
          (f'{{"originalNextRun":"{base}"}}', job_id))
    ok(client.request("FinishJob", jobID=job_id))
    job = _job(client, job_id)
    assert job["state"] == "QUEUED"
    expected = datetime.fromisoformat(base) + timedelta(hours=1)
    assert job["nextRun"] == expected.strftime("%Y-%m-%d %H:%M:%S")


# The invariant, for any rule of modifiers that keep the order of times
# (offsets of seconds to days, START OF): run after run, each no earlier
# than it was due, no computed moment comes twice. WEEKDAY and months do
# not keep it, and can go round (protocol.md section 6; the last test).


@st.composite
def modifiers(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return "START OF " + draw(st.sampled_from(["HOUR", "DAY", "MONTH", "YEAR"]))
    unit = draw(st.sampled_from(["SECONDS", "MINUTES", "HOURS", "DAYS"]))
    number = draw(st.sampled_from([0, 1, 2, 7, 28, 30, 59, 60]) | st.integers(0, 999))
    return f"{draw(st.sampled_from('+-'))}{number} {unit}"


rules = st.builds(
    lambda base, parts: ", ".join([base, *parts]),
    st.sampled_from(["SCHEDULED", "STARTED", "FINISHED"]),
    st.lists(modifiers(), min_size=1, max_size=4),
)
moments = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)).map(
    lambda m: m.replace(microsecond=0, tzinfo=UTC)
)


def _run_after_run(rule: str, first: datetime, start: datetime, runs: int) -> list[str]:
    """The moments a job with this rule, first due at `first`, is queued for
    run after run from `start` (each run no earlier than it was due), up
    to `runs` of them or until the rule stalls."""
    job = Job(created=times.to_millis(first), jobID=1, state=State.RUNNING, name="j",
              nextRun=times.to_millis(first), lastRun=None, repeat=rule, data="{}",
              priority=500, parentJobID=0, retryAfter="", maxAttempts=0,
              retryBackoff="", retryDelay=0, retryMaxDelay=0, attempts=0, lastError="",
              leaseID="")
    now = max(start, first)
    computed: list[str] = []
    for _ in range(runs):
        ctx = Context(None, now)  # type: ignore[arg-type]
        job = replace(job, lastRun=ctx.now_s)
        try:
            computed.append(schedule.next_run_after_run(ctx, job, schedule.due_moment(job)))
        except (schedule.RepeatStalled, CommandError):
            break
        job = replace(job, nextRun=computed[-1])
        now = max(now, times.parse_stored(computed[-1]))
    return computed


@settings(max_examples=150, deadline=None)
@given(rule=rules, first=moments, start=moments)
def test_no_computed_moment_comes_twice(rule: str, first: datetime, start: datetime) -> None:
    computed = _run_after_run(rule, first, start, 8)
    assert len(set(computed)) == len(computed), (rule, computed)


def test_a_rule_with_a_weekday_and_a_step_back_can_go_round_uncaught() -> None:
    # As protocol.md says: six moments, four hours apart, over and over.
    first = datetime(1999, 12, 31, 20, tzinfo=UTC)
    moments = _run_after_run("SCHEDULED, WEEKDAY 0, -28 HOURS", first, first, 7)
    assert len(set(moments)) == 6 and moments[6] == moments[0]


def test_a_rule_with_a_month_is_not_judged_by_one_month_of_it(client):
    # A month is as long as the calendar makes it: from February 10 this
    # rule goes back a day, from most other days it goes forward.
    job_id = create(client, "month", repeat="SCHEDULED, +1 MONTH, -29 DAYS",
                    firstRun="2026-02-10 12:00:00")
    get_job(client, "month")
    ok(client.request("FinishJob", jobID=job_id))
    job = _job(client, job_id)
    assert (job["state"], job["nextRun"]) == ("QUEUED", "2026-02-09 12:00:00")
