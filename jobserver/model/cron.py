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
run is remembered per (rule, zone, minute): every job of a rule asked
about in one minute costs one search, which a thread does before the
writer for the rules a request carries.
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
# Next runs remembered, each for a (rule, zone, minute): a minute's worth
# for thousands of rules and zones at once, each entry a few hundred bytes
# (a rule is at most MAX_LENGTH characters), about 8 MB in all. Each
# request carries at most MOST_RULES_A_REQUEST distinct pairs, found in
# the thread before the writer: sixteen such requests would have to be
# searched between one's search and its turn in the writer for it to
# search again there.
REMEMBERED_RUNS = 16_384
MOST_RULES_A_REQUEST = 1000
_MINUTE = timedelta(minutes=1)
# What a next run is remembered by: a rule's fields, a zone's name, a minute.
_Key = tuple[str, str, datetime]
NEVER_FIRES = "never fires (no moment in 50 years)"
# Each distinct rule's verdict ("" when it can run), oldest first, for
# _DISTINCT_RULES rules.
_verdicts: dict[str, str] = {}


class MalformedCron(ValueError):
    """Not a CRON rule that can run; the text says why."""


class _Remembered:
    """Next runs found lately, by _key, the least recently used forgotten
    first. The writer and the threads that warm it share it: a lock keeps
    its order whole."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._runs: OrderedDict[_Key, datetime] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: _Key) -> datetime | None:
        with self._lock:
            found = self._runs.get(key)
            if found is not None:
                self._runs.move_to_end(key)
            return found

    def put(self, key: _Key, found: datetime) -> None:
        with self._lock:
            self._runs[key] = found
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
        try:
            key = _key(fields, zone_name.strip(), now)
        except ValueError:
            continue  # an unknown zone: the writer refuses it
        if key is not None and _runs.get(key) is None:
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
    same as `search_next_run`, remembered for the minute `after` falls in (a
    None, which a rule checked at arrival never gives, is not). Raises
    ValueError for an unknown zone."""
    key = _key(" ".join(rule.split()[1:]), zone_name, after)
    if key is None:
        return search_next_run(rule, zone_name, after)
    found = _runs.get(key)
    if found is None:
        found = search_next_run(rule, zone_name, key[2])
        if found is None:
            return None
        _runs.put(key, found)
    # The minute's search gave the first moment after the minute began: on
    # the whole-minute offsets _key admits, a later minute, so after
    # `after` too. Checked all the same, since a wrong next run is silent.
    return found if found > after else search_next_run(rule, zone_name, after)


def search_next_run(rule: str, zone_name: str, after: datetime) -> datetime | None:
    """The first moment of the rule strictly after `after`, or None: one
    search, remembered nowhere."""
    return next(runs_after(rule, zone_name, after), None)


def _key(fields: str, zone_name: str, after: datetime) -> _Key | None:
    """What a next run after `after` is remembered by: the fields, the zone,
    and the minute `after` falls in; None where moments of one minute may
    have different next runs. cronsim steps a second, then to the next
    whole minute of the wall clock, and compares fields of wall-clock time:
    from any moment of a minute it walks the same steps, provided the
    minute is a whole minute on the wall clock too and the zone's offset
    holds through it (offsets of seconds are old local mean times)."""
    zone = windows.parse_zone(zone_name or "UTC")
    minute = after.astimezone(UTC).replace(second=0, microsecond=0)
    if not _same_whole_minute_offset(zone, minute, after):
        return None
    return fields, zone_name or "UTC", minute


def _same_whole_minute_offset(zone: tzinfo, start: datetime, moment: datetime) -> bool:
    offset = moment.astimezone(zone).utcoffset()
    return (
        offset is not None
        and offset % _MINUTE == timedelta(0)
        and start.astimezone(zone).utcoffset() == offset
    )


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
