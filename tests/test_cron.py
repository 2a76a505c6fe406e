"""CRON repeats (protocol.md 6.1): when a cron job runs, in its time zone,
across daylight-saving nights, on both backends.

The runs are driven on trio's MockClock (test_clock.py shows how): a
worker takes the job with a waiting GetJob and finishes it, and every
hand-out's moment is exact, so a week of a schedule takes a fraction of a
second. What a client sees (status lines, QueryJob's nextRuns, the CLI)
is checked over a real server.
"""

from __future__ import annotations

import json
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import CliHere
from test_clock import PEER, Core, request, running_core
from trio.testing import MockClock

from harness import ThreadServer
from helpers import create, ok
from jobserver.core.commands import params
from jobserver.core.commands.params import MAX_WAIT_MS
from jobserver.core.errors import CommandError
from jobserver.model import cron
from jobserver.wire.framing import Request
from wire import Client

pytestmark = pytest.mark.backends

WEEKDAYS_AT_NINE = "CRON 0 9 * * MON-FRI"
PARIS = "Europe/Paris"
HOUR = 3600.0


async def runs(core: Core, name: str, until: datetime, hold: float = 0.0) -> list[str]:
    """Work `name` until `until`: take each hand-out with a waiting GetJob
    and finish it `hold` seconds later. The hand-outs' moments, in UTC."""
    seen = []
    while core.clock.now() < until:
        timeout = min(MAX_WAIT_MS, int((until - core.clock.now()).total_seconds() * 1000) + 1)
        answer = await core.dispatcher.dispatch(
            request("GetJob", name=name, connection="wait", timeout=timeout), PEER
        )
        if answer.response.code == 404:
            continue
        assert answer.response.code == 200, answer.response.status
        seen.append(f"{core.clock.now():%Y-%m-%d %H:%M:%S}")
        await trio.sleep(hold)
        job_id = json.loads(answer.response.body)["jobID"]
        assert (await core.send("FinishJob", jobID=job_id)).code == 200
    return seen


async def both(
    first: Coroutine[Any, Any, list[str]], second: Coroutine[Any, Any, list[str]]
) -> tuple[list[str], list[str]]:
    """Two workers at once, each on its own job's name."""
    results: list[list[str]] = [[], []]

    async def run(index: int, work: Coroutine[Any, Any, list[str]]) -> None:
        results[index] = await work

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, first)
        nursery.start_soon(run, 1, second)
    return results[0], results[1]


async def test_weekdays_at_nine_in_paris_run_at_nine_local_across_a_week_and_spring_forward(
    tmp_path: Path, db: Path | str, autojump_clock: MockClock
) -> None:
    # Thursday 2027-03-25, noon; Paris goes from UTC+1 to UTC+2 on Sunday.
    start = datetime(2027, 3, 25, 12, tzinfo=UTC)
    # As below: no thread at CreateJob, while which the mock clock would jump.
    cron.warm([(WEEKDAYS_AT_NINE, PARIS)], start)
    async with running_core(tmp_path, db=str(db), epoch=start) as core:
        job_id = await core.create(name="report", repeat=WEEKDAYS_AT_NINE, timeZone=PARIS)
        shown = await core.json("QueryJob", jobID=job_id)
        # Without firstRun, first due at the rule's first moment.
        assert shown["nextRun"] == "2027-03-26 08:00:00"
        assert shown["nextRuns"] == [
            "2027-03-26 08:00:00", "2027-03-29 07:00:00", "2027-03-30 07:00:00",
            "2027-03-31 07:00:00", "2027-04-01 07:00:00",
        ]
        assert (shown["repeat"], shown["timeZone"]) == (WEEKDAYS_AT_NINE, PARIS)
        seen = await runs(core, "report", start + timedelta(days=7, hours=20))
        assert seen == [
            "2027-03-26 08:00:00",  # Friday, 09:00 at UTC+1
            "2027-03-29 07:00:00",  # Monday, 09:00 at UTC+2
            "2027-03-30 07:00:00",
            "2027-03-31 07:00:00",
            "2027-04-01 07:00:00",
            "2027-04-02 07:00:00",
        ]


async def test_half_past_two_on_the_nights_the_clocks_change(
    tmp_path: Path, db: Path | str, autojump_clock: MockClock
) -> None:
    spring = datetime(2027, 3, 27, 12, tzinfo=UTC)
    night_and_hourly = [("CRON 30 2 * * *", PARIS), ("CRON 30 * * * *", PARIS)]
    # Checked and their first runs found beforehand: CreateJob then needs
    # no thread, while which the mock clock would jump to the first job's
    # moment.
    cron.warm(night_and_hourly, spring)
    async with running_core(tmp_path, db=str(db), epoch=spring) as core:
        await core.create(name="nightly", repeat="cron 30 2 * * *", timeZone=PARIS)
        await core.create(name="hourly", repeat="CRON 30 * * * *", timeZone=PARIS)
        nightly, hourly = await both(
            runs(core, "nightly", spring + timedelta(days=1, hours=13)),
            runs(core, "hourly", spring + timedelta(hours=15)),
        )
        # 02:30 does not exist: at 03:00, when the gap ends, then 02:30 again.
        assert nightly == ["2027-03-28 01:00:00", "2027-03-29 00:30:00"]
        # An hour that does not exist has no half past.
        assert hourly[-4:] == [
            "2027-03-27 23:30:00", "2027-03-28 00:30:00", "2027-03-28 01:30:00",
            "2027-03-28 02:30:00",
        ]
    autumn = datetime(2027, 10, 30, 12, tzinfo=UTC)
    cron.warm(night_and_hourly, autumn)
    # The same database, seven months later: other names.
    async with running_core(tmp_path, db=str(db), epoch=autumn) as core:
        await core.create(name="autumn/nightly", repeat="CRON 30 2 * * *", timeZone=PARIS)
        await core.create(name="autumn/hourly", repeat="CRON 30 * * * *", timeZone=PARIS)
        # Each run lasts 40 minutes: the first 02:30 (00:30 UTC) ends in
        # the second pass through 02:00-03:00, after which the rule's next
        # 02:30 on the wall clock is the first one again, already past.
        nightly, hourly = await both(
            runs(core, "autumn/nightly", autumn + timedelta(days=1, hours=14), hold=40 * 60),
            runs(core, "autumn/hourly", autumn + timedelta(hours=15)),
        )
        # 02:30 happens twice: once, at the first.
        assert nightly == ["2027-10-31 00:30:00", "2027-11-01 01:30:00"]
        # Minute 30 of every hour that passes: both 02:30s.
        assert hourly[-4:] == [
            "2027-10-30 23:30:00", "2027-10-31 00:30:00", "2027-10-31 01:30:00",
            "2027-10-31 02:30:00",
        ]


async def test_a_cron_job_that_missed_a_day_runs_once_then_keeps_to_its_rule(
    tmp_path: Path, db: Path | str, autojump_clock: MockClock
) -> None:
    start = datetime(2027, 6, 1, 10, 0, 30, tzinfo=UTC)
    cron.warm([("CRON 0 * * * *", "")], start)
    async with running_core(tmp_path, db=str(db), epoch=start) as core:
        job_id = await core.create(name="autumn/hourly", repeat="CRON 0 * * * *")
        assert (await core.json("QueryJob", jobID=job_id))["nextRun"] == "2027-06-01 11:00:00"
        # Nobody takes it for a day (the workers were down): 24 moments pass.
        await core.at(24 * HOUR)
        seen = await runs(core, "autumn/hourly", start + timedelta(hours=26, minutes=30))
        assert seen == [
            "2027-06-02 10:00:30",  # once, at once, for all the missed hours
            "2027-06-02 11:00:00",
            "2027-06-02 12:00:00",
        ]


# Over a real server.


def status_of(client: Client, verb: str, **params: Any) -> str:
    return client.request(verb, **params).status


def paris(stored: str) -> datetime:
    return datetime.fromisoformat(stored).replace(tzinfo=UTC).astimezone(ZoneInfo(PARIS))


def test_cron_rules_on_the_wire_and_in_the_cli(
    server: ThreadServer, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    job_id = create(client, "report", repeat="cron 0 9 * * mon-fri", timeZone=PARIS)
    shown = ok(client.request("QueryJob", jobID=job_id)).json
    assert (shown["repeat"], shown["timeZone"]) == (WEEKDAYS_AT_NINE, PARIS)
    # Its first run is the rule's first moment; the next five follow it.
    assert shown["nextRuns"][0] == shown["nextRun"]
    local = [paris(run) for run in shown["nextRuns"]]
    assert len(local) == 5 and local == sorted(local) and local[0] > before
    assert all(m.weekday() < 5 and (m.hour, m.minute, m.second) == (9, 0, 0) for m in local)
    assert local[0] - before <= timedelta(days=3, hours=1)
    # Bedrock's keys stay as they were for every other job.
    plain = create(client, "plain", repeat="FINISHED, +1 HOUR")
    assert "nextRuns" not in ok(client.request("QueryJob", jobID=plain)).json

    # Refusals: each says why, none is a 500.
    refused = {
        "CRON 0 9 * *": "402 Malformed repeat: CRON needs 5 fields, got 4",
        "CRON 0 0 9 * * MON": "402 Malformed repeat: CRON needs 5 fields, got 6",
        "CRON @daily": "402 Malformed repeat: CRON needs 5 fields, got 1",
        "CRON 61 9 * * *": "402 Malformed repeat: bad minute",
        "CRON 0 9 * * MON;rm": "402 Malformed repeat: bad field 'MON;RM'",
        "CRON 0 0 31 2 *": "402 Malformed repeat: never fires (no moment in 50 years)",
        "CRON 0 0 */20 * MON#5": "402 Malformed repeat: never fires (no moment in 50 years)",
        "CRON 0 9 * * " + "1," * 100 + "1": "402 Malformed repeat: longer than 200 characters",
        "CRONE 0 9 * * *": "402 Malformed repeat",
        # A bare cron expression: the refusal says how it is written.
        "0 2 * * *": '402 Malformed repeat: a CRON rule is written "CRON 0 2 * * *"',
        " */15 9-17 * * mon-fri ": (
            '402 Malformed repeat: a CRON rule is written "CRON */15 9-17 * * MON-FRI"'
        ),
        "0 2 * *": "402 Malformed repeat",
        "DAILY HOURLY WEEKLY A B": "402 Malformed repeat",
        "0 2 * * *;rm": "402 Malformed repeat",
    }
    for rule, line in refused.items():
        assert status_of(client, "CreateJob", name="bad", repeat=rule) == line, rule
    assert status_of(
        client, "CreateJob", name="bad", repeat=WEEKDAYS_AT_NINE, timeZone="Mars/Olympus"
    ) == "402 Malformed timeZone"
    # A zone alone is still for windows or a CRON rule.
    assert status_of(
        client, "CreateJob", name="bad", repeat="DAILY", timeZone=PARIS
    ) == "402 Missing timeWindows"

    # UpdateJob and RetryJob take a CRON rule wherever they take a repeat;
    # the job's zone is UTC when it has none.
    ok(client.request("UpdateJob", jobID=plain, data="{}", repeat="CRON 15 3 * * *"))
    updated = ok(client.request("QueryJob", jobID=plain)).json
    assert updated["repeat"] == "CRON 15 3 * * *" and "timeZone" not in updated
    assert updated["nextRun"].endswith(" 03:15:00") and updated["nextRun"] > f"{before:%F %T}"
    assert status_of(
        client, "UpdateJob", jobID=plain, data="{}", repeat="CRON 0 0 30 2 *"
    ) == "402 Malformed repeat: never fires (no moment in 50 years)"
    now_due = create(client, "now", repeat=WEEKDAYS_AT_NINE, timeZone=PARIS, firstRun="2020-01-01")
    assert ok(client.request("GetJob", name="now")).json["jobID"] == now_due
    ok(client.request("RetryJob", jobID=now_due, delay=5))
    again = ok(client.request("QueryJob", jobID=now_due)).json
    assert (again["state"], again["nextRun"]) == ("QUEUED", shown["nextRun"])
    batch = [{"name": "batch", "repeat": "CRON */5 * * * *", "timeZone": "Asia/Kolkata"}]
    (batch_id,) = ok(client.request("CreateJobs", jobs=json.dumps(batch))).json["jobIDs"]
    # Kolkata is UTC+05:30: every fifth minute there is at :x0 or :x5 in UTC too.
    assert ok(client.request("QueryJob", jobID=batch_id)).json["nextRun"][15:] in ("0:00", "5:00")

    # The CLI prints the next runs on the zone's clock beside UTC's.
    cli = CliHere(f"127.0.0.1:{server.port}", capsys)
    printed = cli.ok("query", str(job_id))
    assert printed["nextRuns"] == shown["nextRuns"]
    assert printed["nextRunsLocal"] == [m.isoformat() for m in local]
    assert printed["nextRunsLocal"][0].endswith(("T09:00:00+01:00", "T09:00:00+02:00"))
    created = cli.ok("create", "cli", "--repeat", "CRON 0 9 * * 1-5", "--time-zone", PARIS)
    assert cli.ok("query", str(created["jobID"]))["timeZone"] == PARIS
    usage = cli("create", "cli", "--repeat", "DAILY", "--time-zone", PARIS)
    assert usage.returncode == 2
    assert "--time-zone needs --time-windows or a CRON --repeat" in usage.stderr


def test_a_new_cron_rule_or_zone_moves_nextrun_at_a_unique_recreate_and_updatejob(
    client: Client,
) -> None:
    # Re-created with a new rule and data, the job kept its old nextRun
    # (01:00 UTC) while its nextRuns began at 03:30 Paris; a new timeZone
    # was dropped, and UpdateJob took none.
    job_id = create(client, "nightly", unique="true", repeat="CRON 0 1 * * *", data='{"v":1}')
    assert ok(client.request("QueryJob", jobID=job_id)).json["nextRun"].endswith(" 01:00:00")
    again = create(
        client, "nightly", unique="true", repeat="CRON 30 3 * * *", timeZone=PARIS,
        data='{"v":2}',
    )
    assert again == job_id
    shown = ok(client.request("QueryJob", jobID=job_id)).json
    assert (shown["repeat"], shown["timeZone"]) == ("CRON 30 3 * * *", PARIS)
    assert shown["data"] == {"v": 2}
    assert shown["nextRun"] == shown["nextRuns"][0]
    assert (paris(shown["nextRun"]).hour, paris(shown["nextRun"]).minute) == (3, 30)
    # A zone alone moves it too; the same data changes nothing (Bedrock).
    create(client, "nightly", unique="true", repeat="CRON 30 3 * * *", timeZone="Asia/Tokyo",
           data='{"v":2}')
    assert ok(client.request("QueryJob", jobID=job_id)).json["timeZone"] == PARIS
    create(client, "nightly", unique="true", repeat="CRON 30 3 * * *", timeZone="UTC",
           data='{"v":3}')
    moved = ok(client.request("QueryJob", jobID=job_id)).json
    assert moved["timeZone"] == "UTC" and moved["nextRun"].endswith(" 03:30:00")
    # Bedrock's rules keep Bedrock's nextRun at a unique re-create.
    plain = create(client, "hourly", unique="true", repeat="HOURLY", firstRun="2030-01-01")
    create(client, "hourly", unique="true", repeat="DAILY", data='{"v":1}')
    assert ok(client.request("QueryJob", jobID=plain)).json["nextRun"] == "2030-01-01 00:00:00"

    # UpdateJob takes timeZone, checked as CreateJob checks it, and moves a
    # CRON job's nextRun into it.
    ok(client.request("UpdateJob", jobID=job_id, data="{}", timeZone=PARIS))
    updated = ok(client.request("QueryJob", jobID=job_id)).json
    assert updated["timeZone"] == PARIS and updated["nextRun"] == updated["nextRuns"][0]
    assert (paris(updated["nextRun"]).hour, paris(updated["nextRun"]).minute) == (3, 30)
    ok(client.request("UpdateJob", jobID=job_id, data="{}", repeat="CRON 0 6 * * *",
                      timeZone="UTC"))
    assert ok(client.request("QueryJob", jobID=job_id)).json["nextRun"].endswith(" 06:00:00")
    assert status_of(
        client, "UpdateJob", jobID=job_id, data="{}", timeZone="Mars/Olympus"
    ) == "402 Malformed timeZone"
    assert status_of(
        client, "UpdateJob", jobID=plain, data="{}", timeZone=PARIS
    ) == "402 Missing timeWindows"
    assert status_of(
        client, "UpdateJob", jobID=job_id, data="{}", shouldClearRepeat="true", timeZone=PARIS
    ) == "402 Missing timeWindows"
    assert ok(client.request("QueryJob", jobID=job_id)).json["timeZone"] == "UTC"
    windowed = create(client, "windowed", timeWindows="09:00-17:00")
    ok(client.request("UpdateJob", jobID=windowed, data="{}", timeZone=PARIS))
    assert ok(client.request("QueryJob", jobID=windowed)).json["timeZone"] == PARIS


def test_the_client_and_the_cli_move_a_cron_job_into_a_new_zone(
    server: ThreadServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from jobserver.client import Client as JobsClient
    from jobserver.client import InvalidRequest

    with JobsClient(f"127.0.0.1:{server.port}", timeout=10) as jobs:
        job_id = jobs.create_job("zoned", repeat="CRON 30 3 * * *")
        jobs.update_job(job_id, {}, time_zone=PARIS)
        moved = jobs.query_job(job_id)
        assert moved["timeZone"] == PARIS
        assert (paris(moved["nextRun"]).hour, paris(moved["nextRun"]).minute) == (3, 30)
        with pytest.raises(InvalidRequest, match="402 Malformed timeZone"):
            jobs.update_job(job_id, {}, time_zone="Mars/Olympus")
    cli = CliHere(f"127.0.0.1:{server.port}", capsys)
    assert cli.ok("update", str(job_id), "--data", "{}", "--time-zone", "UTC") == {}
    shown = cli.ok("query", str(job_id))
    assert shown["timeZone"] == "UTC" and shown["nextRun"].endswith(" 03:30:00")


# The grammar, on the function the server reads a repeat with.

def _field(low: int, high: int, *words: str) -> st.SearchStrategy[str]:
    """A field of numbers from low to a little past high (out of range
    too), the field's names, `*`, ranges, steps and lists, and the day
    fields' L, W and #, on any field."""
    atom = st.one_of(st.integers(low, high + 2).map(str), st.sampled_from(["*", *words]))
    term = st.one_of(
        atom,
        st.builds("{}-{}".format, atom, atom),
        st.builds("{}/{}".format, atom, st.integers(0, 9)),
        st.sampled_from(["L", "LW", "5L", "1#5", "MON#2", "?", "", "x"]),
    )
    return st.lists(term, min_size=1, max_size=3).map(",".join)


_RULES = st.one_of(
    st.tuples(
        _field(0, 59), _field(0, 23), _field(1, 31), _field(1, 12, "JAN", "dec"),
        _field(0, 7, "MON", "fri", "sun"),
    ).map(lambda fields: "CRON " + " ".join(fields)),
    st.lists(_field(0, 59), max_size=7).map(lambda fields: "cron " + " ".join(fields)),
    st.text(max_size=30).map(lambda text: "CRON " + text),
)


@settings(max_examples=75, deadline=None)
@given(_RULES)
def test_any_cron_rule_is_stored_normalised_or_refused_with_its_reason(rule: str) -> None:
    try:
        stored = params.repeat_rule(Request("CreateJob", {"repeat": rule}))
    except CommandError as error:
        assert error.status.startswith("402 Malformed repeat"), error.status
        return
    assert stored is not None and stored == "CRON " + " ".join(rule.upper().split()[1:])
