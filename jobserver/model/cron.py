"""CRON repeats: `CRON <5 fields>` in the job's time zone (protocol.md 6.1).

The fields are Debian cron's (minute, hour, day of month, month, day of
week), read and iterated by cronsim.

A next run is the first moment of the rule strictly after a given moment,
found in the job's zone and returned in UTC. Daylight saving follows
Debian cron, as cronsim does: a rule with a fixed minute and hour whose
time falls in the spring-forward gap runs when the gap ends (02:30 on the
night 02:00 becomes 03:00 runs at 03:00), and runs once, at the first of
the two, on the night that time happens twice; a rule whose minute or hour
field starts with `*` follows real time, so it skips what does not exist
and runs again in the repeated hour.

Searching can walk decades (`0 0 * 2 MON#5` next fires in 2044), so a next
run is remembered per (rule, zone), for the whole span it holds where
cronsim's moments are the same whatever it starts from (found after t,
it is the next run after every moment from t until it comes), else for
the minute: see next_run. A thread does the search before the writer for
the rules a request carries.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import suppress
from datetime import UTC, datetime, timedelta, tzinfo

from cronsim import CronSim, CronSimError

from jobserver.model import times, windows

PREFIX = "CRON"
FIELDS = 5
# Longer than any readable rule (`0,15,30,45 8-18 1-7,15-21 * MON-FRI` is
# 34), short enough to keep the parse and the stored rule small.
MAX_LENGTH = 200
# How many upcoming runs QueryJob shows.
UPCOMING = 5
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
_DISTINCT_RULES = 16_384
# Next runs remembered, each for a (rule, zone) with the moment its search
# started from: each entry a few hundred bytes (a rule is at most
# MAX_LENGTH characters), about 8 MB in all. Each request carries at most
# MOST_RULES_A_REQUEST distinct pairs, found in the thread before the
# writer: sixteen such requests would have to be searched between one's
# search and its turn in the writer for it to search again there.
REMEMBERED_RUNS = 16_384
MOST_RULES_A_REQUEST = 1000
_MINUTE = timedelta(minutes=1)
# What a next run is remembered by: a rule's fields, a zone's name.
_Key = tuple[str, str]
# A next run and the moments it is the next run after: [start, end).
_Span = tuple[datetime, datetime, datetime]
NEVER_FIRES = "never fires (no moment in 50 years)"
# Each distinct rule's verdict ("" when it can run), oldest first, for
# _DISTINCT_RULES rules.
_verdicts: dict[str, str] = {}


class MalformedCron(ValueError):
    """Not a CRON rule that can run; the text says why."""


class _Remembered:
    """Next runs found lately, by (rule, zone), each with the span of
    moments it answers for; the least recently used forgotten first. The
    writer and the threads that warm it share it: a lock keeps its order
    whole."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._runs: OrderedDict[_Key, _Span] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: _Key, after: datetime) -> datetime | None:
        """The remembered next run after `after`, if its span holds it."""
        with self._lock:
            span = self._runs.get(key)
            if span is None or not span[0] <= after < span[1]:
                return None
            self._runs.move_to_end(key)
            return span[2]

    def put(self, key: _Key, span: _Span) -> None:
        with self._lock:
            self._runs[key] = span
            self._runs.move_to_end(key)
            while len(self._runs) > self._size:
                self._runs.popitem(last=False)


_runs = _Remembered(REMEMBERED_RUNS)


def is_cron(rule: str) -> bool:
    """Whether a repeat rule is a CRON rule (no Bedrock rule starts so)."""
    return _WORD.match(rule.strip().upper()) is not None


def as_cron(rule: str) -> str | None:
    """`0 2 * * *` -> `CRON 0 2 * * *`: the CRON rule that a repeat which
    is not one looks meant to be (five cron fields, the minute's with a
    digit or `*`: no Bedrock rule reads so), or None. Only characters of a
    field go into the answer, so it may be echoed in a status line."""
    fields = rule.upper().split() if len(rule) <= MAX_LENGTH else []
    if len(fields) != FIELDS or not all(_FIELD.fullmatch(field) for field in fields):
        return None
    if not any(character.isdigit() or character == "*" for character in fields[0]):
        return None
    return f"{PREFIX} {' '.join(fields)}"


def normalise(rule: str) -> str:
    """`cron 0 9 * * mon-fri` -> `CRON 0 9 * * MON-FRI`, checked: raises
    MalformedCron."""
    if len(rule) > MAX_LENGTH:
        raise MalformedCron(f"longer than {MAX_LENGTH} characters")
    fields = rule.strip().upper().split()[1:]
    if len(fields) != FIELDS:
        raise MalformedCron(f"CRON needs {FIELDS} fields, got {len(fields)}")
    for field in fields:
        if not _FIELD.fullmatch(field):
            raise MalformedCron(f"bad field {field!r}")
    text = " ".join(fields)
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


def unchecked(rules: list[tuple[str, str]], now: datetime) -> bool:
    """Whether one of these (rule, zone) is a CRON rule whose verdict, or
    next run after `now`, is not remembered."""
    for rule, zone_name in rules:
        if not is_cron(rule):
            continue
        fields = " ".join(rule.upper().split()[1:])
        verdict = _verdicts.get(fields)
        if verdict is None:
            return True
        if verdict:
            continue  # refused: there is no next run to remember
        if _runs.get((fields, zone_name.strip() or "UTC"), now) is None:
            return True
    return False


def warm(rules: list[tuple[str, str]], now: datetime) -> None:
    """Check these (rule, zone) CRON rules and find their next runs after
    `now`, in a thread of their own, so that the writer, which serves
    everyone, finds both remembered. Errors are the writer's to report."""
    for rule, zone_name in dict.fromkeys(rules):
        if is_cron(rule):
            with suppress(MalformedCron, ValueError):
                next_run(normalise(rule), zone_name.strip(), now)


def _problem(fields: str) -> str:
    """Why cronsim cannot use these fields, or ""; a rule with no moment
    in 50 years (`0 0 30 2 *`) takes cronsim up to some tens of
    milliseconds to give up on, so verdicts are remembered."""
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
    minute, hour, day, _, weekday = fields.split()
    try:
        CronSim(f"{minute} {hour} {day} * {weekday}", _CHECKED_FROM)
    except CronSimError:
        return False
    return True


def runs_after(rule: str, zone_name: str, after: datetime) -> Iterator[datetime]:
    """The rule's moments strictly after `after` (aware), in UTC, in
    `zone_name` (an IANA name; UTC when empty). Ends where cronsim finds
    none within 50 years."""
    fields = " ".join(rule.split()[1:])
    zone = windows.parse_zone(zone_name or "UTC")
    skipped = 0
    for moment in CronSim(fields, after.astimezone(zone)):
        found = moment.astimezone(UTC)
        if found > after:
            yield found
        else:
            skipped += 1
            if skipped > _MOST_SKIPPED:
                return


def next_run(rule: str, zone_name: str, after: datetime) -> datetime | None:
    """The first moment of the rule strictly after `after`, or None; the
    same as `search_next_run`, remembered (a None, which a rule checked at
    arrival never gives, is not). Raises ValueError for an unknown zone."""
    fields = " ".join(rule.split()[1:])
    key = (fields, zone_name or "UTC")
    found = _runs.get(key, after)
    if found is not None:
        return found
    zone = windows.parse_zone(zone_name or "UTC")
    span_start = after if _one_set(fields, zone) else _minute_start(zone, after)
    if span_start is None:
        return search_next_run(rule, zone_name, after)
    found = search_next_run(rule, zone_name, span_start)
    if found is None:
        return None
    span_end = found if span_start is after else min(found, span_start + _MINUTE)
    _runs.put(key, (span_start, span_end, found))
    return found


def _one_set(fields: str, zone: tzinfo) -> bool:
    """Whether cronsim gives the rule's moments as one set whatever moment
    it starts from, so that a run N found after t is the run after any t'
    in [t, N). In UTC it walks plain times. For a fixed minute and hour in
    another zone it walks the wall clock with no offset, up from the
    start's, and places each time it finds at its first occurrence (a
    gap's at its end), which never goes back as the wall clock goes on;
    runs_after drops what falls at or before the start. Not with a `*`
    minute or hour, which walk real time with wall-clock jumps: around
    Lord Howe's half-hour changes a walk from 01:59 skips 02:00-02:29 that
    one from 02:00 finds (tests/test_cron_cost.py checks both kinds)."""
    minute, hour = fields.split()[:2]
    return zone is UTC or not (minute.startswith("*") or hour.startswith("*"))


def _minute_start(zone: tzinfo, after: datetime) -> datetime | None:
    """The start of the minute `after` falls in, from which cronsim gives
    the same next run as from `after`; None where it may not. cronsim steps
    a second, then to the next whole minute of the wall clock: from any
    moment of a minute it walks the same steps, provided the minute is a
    whole minute on the wall clock too and the zone's offset holds through
    it (offsets of seconds are old local mean times)."""
    start = after.astimezone(UTC).replace(second=0, microsecond=0)
    offset = after.astimezone(zone).utcoffset()
    if offset is None or offset % _MINUTE or start.astimezone(zone).utcoffset() != offset:
        return None
    return start


def search_next_run(rule: str, zone_name: str, after: datetime) -> datetime | None:
    """The first moment of the rule strictly after `after`, or None: one
    search, remembered nowhere."""
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
