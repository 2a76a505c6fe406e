"""CRON repeats: `CRON <5 fields>` in the job's time zone (protocol.md 6.1).

The fields are Debian cron's (minute, hour, day of month, month, day of
week), read and iterated by cronsim, an optional dependency imported when
a rule is first met, so a server without it serves every other rule.

A next run is the first moment of the rule strictly after a given moment,
found in the job's zone and returned in UTC. Daylight saving follows
Debian cron, as cronsim does: a rule with a fixed minute and hour whose
time falls in the spring-forward gap runs when the gap ends (02:30 on the
night 02:00 becomes 03:00 runs at 03:00), and runs once, at the first of
the two, on the night that time happens twice; a rule whose minute or hour
field starts with `*` follows real time, so it skips what does not exist
and runs again in the repeated hour.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from jobserver.model import times, windows

if TYPE_CHECKING:
    from cronsim import CronSim

PREFIX = "CRON"
FIELDS = 5
# Longer than any readable rule (`0,15,30,45 8-18 1-7,15-21 * MON-FRI` is
# 34), short enough to keep the parse and the stored rule small.
MAX_LENGTH = 200
# How many upcoming runs QueryJob shows.
UPCOMING = 5
INSTALL = "pip install 'jobserver[cron]'"
# The fields as cronsim reads them: numbers, names (MON, JAN), `*`, ranges,
# steps, lists, and L, W and # in the day fields; anything else is refused
# before cronsim sees it.
_FIELD = re.compile(r"[0-9A-Z*/,#-]+")
_WORD = re.compile(rf"{PREFIX}(?:\s|$)")
# Where the check that a rule fires at all starts. cronsim gives up after
# 50 years without a moment; from here that spans every weekday that the
# 29th of February and a month's fifth Monday can fall on.
_CHECKED_FROM = datetime(2000, 1, 1, tzinfo=UTC)
# At a fall-back, cronsim walks the local wall clock, so it can give times
# of the first pass through the repeated hour, before the moment it was
# asked about. A rule lists at most 60 minutes an hour, and no zone goes
# back more than a few hours: this many is far more than can be skipped.
_MOST_SKIPPED = 24 * 60
_DISTINCT_RULES = 4096
NEVER_FIRES = "never fires (no moment in 50 years)"
# Each distinct rule's verdict ("" when it can run), oldest first, for
# _DISTINCT_RULES rules.
_verdicts: dict[str, str] = {}


class MalformedCron(ValueError):
    """Not a CRON rule that can run; the text says why."""


class CronUnavailable(RuntimeError):
    """cronsim is not installed."""

    def __init__(self) -> None:
        super().__init__(f"CRON repeat needs cronsim: {INSTALL}")


def is_cron(rule: str) -> bool:
    """Whether a repeat rule is a CRON rule (no Bedrock rule starts so)."""
    return _WORD.match(rule.strip().upper()) is not None


def normalise(rule: str) -> str:
    """`cron 0 9 * * mon-fri` -> `CRON 0 9 * * MON-FRI`, checked: raises
    MalformedCron, or CronUnavailable without cronsim."""
    if len(rule) > MAX_LENGTH:
        raise MalformedCron(f"longer than {MAX_LENGTH} characters")
    fields = rule.strip().upper().split()[1:]
    if len(fields) != FIELDS:
        raise MalformedCron(f"CRON needs {FIELDS} fields, got {len(fields)}")
    for field in fields:
        if not _FIELD.fullmatch(field):
            raise MalformedCron(f"bad field {field!r}")
    text = " ".join(fields)
    _library()
    problem = _verdicts.get(text)
    if problem is None:
        problem = _problem(text)
        _remember(text, problem)
    if problem:
        raise MalformedCron(problem)
    return f"{PREFIX} {text}"


def _remember(fields: str, verdict: str) -> None:
    if len(_verdicts) >= _DISTINCT_RULES:
        _verdicts.pop(next(iter(_verdicts)), None)
    _verdicts[fields] = verdict


def unchecked(rules: list[str]) -> bool:
    """Whether one of these is a CRON rule whose verdict is not remembered."""
    return any(
        is_cron(rule) and " ".join(rule.upper().split()[1:]) not in _verdicts for rule in rules
    )


def warm(rules: list[str]) -> None:
    """Check these rules' CRON ones now, in a thread of their own, so that
    the writer, which serves everyone, finds the verdicts remembered.
    Errors are the writer's to report."""
    for rule in rules:
        if is_cron(rule):
            with suppress(MalformedCron, CronUnavailable):
                normalise(rule)


def _library() -> type[CronSim]:
    try:
        from cronsim import CronSim
    except ImportError:
        raise CronUnavailable() from None
    return CronSim


def _problem(fields: str) -> str:
    """Why cronsim cannot use these fields, or ""; a rule with no moment
    in 50 years (`0 0 30 2 *`) takes cronsim up to some tens of
    milliseconds to give up on, so verdicts are remembered."""
    from cronsim import CronSim, CronSimError

    try:
        next(CronSim(fields, _CHECKED_FROM))
    except CronSimError as error:
        if _fires_in_some_month(fields):
            # cronsim's word for a day no month it names has (`31 2`).
            return NEVER_FIRES
        return str(error).lower()
    except StopIteration:
        return NEVER_FIRES
    return ""


def _fires_in_some_month(fields: str) -> bool:
    """Whether the fields are valid with every month allowed."""
    from cronsim import CronSim, CronSimError

    minute, hour, day, _, weekday = fields.split()
    try:
        CronSim(f"{minute} {hour} {day} * {weekday}", _CHECKED_FROM)
    except CronSimError:
        return False
    return True


def runs_after(rule: str, zone_name: str, after: datetime) -> Iterator[datetime]:
    """The rule's moments strictly after `after` (aware), in UTC, in
    `zone_name` (an IANA name; UTC when empty). Ends where cronsim finds
    none within 50 years. Raises CronUnavailable without cronsim."""
    cron_sim = _library()
    fields = " ".join(rule.split()[1:])
    zone = windows.parse_zone(zone_name or "UTC")
    skipped = 0
    for moment in cron_sim(fields, after.astimezone(zone)):
        found = moment.astimezone(UTC)
        if found > after:
            yield found
        else:
            skipped += 1
            if skipped > _MOST_SKIPPED:
                return


def next_run(rule: str, zone_name: str, after: datetime) -> datetime | None:
    """The first moment of the rule strictly after `after`, or None."""
    return next(runs_after(rule, zone_name, after), None)


def upcoming(rule: str, zone_name: str, start: datetime) -> list[datetime]:
    """The rule's next UPCOMING moments at or after `start`."""
    found = []
    for moment in runs_after(rule, zone_name, start - timedelta(microseconds=1)):
        found.append(moment)
        if len(found) == UPCOMING:
            break
    return found


def in_zone(stored: str, zone_name: str) -> datetime:
    """A stored UTC time on the wall clock of `zone_name` (UTC if empty)."""
    return times.parse_stored(stored).astimezone(windows.parse_zone(zone_name or "UTC"))
