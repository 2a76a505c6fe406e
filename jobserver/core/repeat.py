"""The repeat and retryAfter grammar.

A repeat is a base and one or more SQLite date modifiers:
`FINISHED, +1 HOUR`, `SCHEDULED, +1 DAY, START OF DAY, +4 HOURS`. Every part
is checked against a whitelist here and normalised, so what reaches SQLite
is always one of a handful of known shapes, passed as a bound parameter.
SQLite's own `DATETIME()` does the arithmetic (sqlite_functions.py).

A rule must also move forward: a repeating job never runs twice for the
same base moment. `check_moves_forward` computes the rule, the way the
store does, from sample base moments, and refuses it if any result is not
later than its base. It uses SQLite's date functions on a private
in-memory database per thread, which holds no tables.
"""

from __future__ import annotations

import calendar
import json
import re
from dataclasses import dataclass
from datetime import date, datetime
from functools import lru_cache

from jobserver.core import sqlite_functions
from jobserver.wire import jsonbody

BASES = ("SCHEDULED", "STARTED", "FINISHED")

# The canned schedules as the Bedrock::Jobs page defines them.
CANNED = {
    "HOURLY": "FINISHED, +1 HOUR",
    "DAILY": "FINISHED, +1 DAY",
    "WEEKLY": "FINISHED, +7 DAYS",
}

# Bedrock's limits: up to 8 digits of seconds, 3 digits of any other unit,
# which keeps every result inside SQLite's date range.
_OFFSET = re.compile(
    r"([+-]) ?(?:(\d{1,8}) (SECOND)|(\d{1,3}) (MINUTE|HOUR|DAY|MONTH|YEAR))S?"
)
_START_OF = re.compile(r"START OF (DAY|MONTH|YEAR)")
_WEEKDAY = re.compile(r"WEEKDAY ([0-6])")

START_OF_HOUR = sqlite_functions.START_OF_HOUR

# A SCHEDULED repeat that fell behind catches up by whole intervals when the
# interval is shorter than this, instead of running once per missed slot.
REANCHOR_LIMIT_SECONDS = 4 * 3600


class MalformedRepeat(ValueError):
    """Not a rule. `reason` is set when the syntax is fine but the rule
    cannot be used (it does not move forward); it goes in the status line."""

    def __init__(self, text: str, reason: str = "") -> None:
        super().__init__(text)
        self.reason = reason


@dataclass(frozen=True)
class Repeat:
    base: str
    modifiers: tuple[str, ...]

    @property
    def only_offsets(self) -> bool:
        """True when every modifier is a plain `+N UNIT` / `-N UNIT` shift."""
        return all(m[0] in "+-" for m in self.modifiers)


def parse_modifier(part: str, allow_start_of_hour: bool = False) -> str:
    """Validate one modifier and return it in its normal form."""
    text = " ".join(part.upper().split())
    offset = _OFFSET.fullmatch(text)
    if offset:
        sign, secs, sec_unit, count, unit = offset.groups()
        number, name = (secs, sec_unit) if secs else (count, unit)
        return f"{sign}{int(number)} {name}S"
    if _START_OF.fullmatch(text) or _WEEKDAY.fullmatch(text):
        return text
    if allow_start_of_hour and text == START_OF_HOUR:
        return text
    raise MalformedRepeat(part)


def parse_modifiers(text: str) -> tuple[str, ...]:
    """Parse a retryAfter value: a comma list of modifiers, e.g. `+5 MINUTES`."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise MalformedRepeat(text)
    return tuple(parse_modifier(p) for p in parts)


# Seconds per unit, for a lease's length without SQLite. A month counts as
# its shortest and a year as 365 days: a lease read too short is only
# renewed a little early.
_UNIT_SECONDS = {
    "SECONDS": 1,
    "MINUTES": 60,
    "HOURS": 3600,
    "DAYS": 86400,
    "MONTHS": 28 * 86400,
    "YEARS": 365 * 86400,
}


def offset_seconds(text: str) -> float | None:
    """The length of a retryAfter made only of `+N UNIT` / `-N UNIT`
    offsets, at least; None for one with START OF or WEEKDAY (its length
    depends on the moment) or that is malformed or not positive."""
    try:
        modifiers = parse_modifiers(text)
    except MalformedRepeat:
        return None
    total = 0
    for modifier in modifiers:
        if modifier[0] not in "+-":
            return None
        number, unit = modifier[1:].split(" ")
        sign = 1 if modifier[0] == "+" else -1
        total += sign * int(number) * _UNIT_SECONDS[unit]
    return float(total) if total > 0 else None


def parse_repeat(text: str) -> Repeat:
    """Parse a repeat: a canned name, or a base followed by modifiers."""
    upper = text.strip().upper()
    upper = CANNED.get(upper, upper)
    parts = [p.strip() for p in upper.split(",")]
    if len(parts) < 2 or parts[0] not in BASES:
        raise MalformedRepeat(text)
    modifiers = tuple(parse_modifier(p, allow_start_of_hour=True) for p in parts[1:])
    return Repeat(parts[0], modifiers)


def reanchor(last_scheduled: datetime, computed: datetime, now: datetime) -> datetime:
    """Catch a short SCHEDULED repeat up to the first slot after `now`.

    `SCHEDULED, +30 SECONDS` whose job ran an hour late would otherwise run
    120 times back to back; instead it keeps its phase and skips ahead.
    Long intervals keep the documented catch-up, one run per missed slot.
    """
    interval = (computed - last_scheduled).total_seconds()
    if computed > now or not 0 < interval < REANCHOR_LIMIT_SECONDS:
        return computed
    # Whole microseconds, not float seconds: 0.3 // 0.1 is 2.0 in floats,
    # which would land exactly on `now` instead of the slot after it.
    slots = (now - last_scheduled) // (computed - last_scheduled) + 1
    return last_scheduled + (computed - last_scheduled) * slots


# Moving forward. The result of a rule is a function of its base with jumps:
# where a `START OF` truncates, where a WEEKDAY or a month or year offset
# meets the calendar. Between jumps it is either the base plus a constant
# (the same difference everywhere) or constant (the smallest difference just
# before the next jump). So the samples are a calendar grid (every weekday,
# month ends, leap and non-leap Februaries and centuries) at midnight,
# midday and 23:59:59, plus, for this rule, the seconds just before and at
# each jump its own offsets put there.

# Leap years, common years, a leap century (2000), a common century (2100)
# and the years before it, so that offsets of years and days that nearly
# cancel meet every count of leap days they can span.
_SAMPLE_YEARS = (2024, 2023, 2000, 1999, 2096, 2097, 2099, 2100)
_SAMPLE_DAYS = (1, 15, 28, 29, 30, 31)
# A week across a leap day and the turn of a year: every weekday, each hour.
_HOURLY_DATES = (
    *(date(2024, 2, 26).toordinal() + n for n in range(8)),
    *(date(2023, 12, 31).toordinal() + n for n in range(2)),
)
_DAY = 86400
_HOUR = 3600
_FIXED_SECONDS = {"SECONDS": 1, "MINUTES": 60, "HOURS": _HOUR, "DAYS": _DAY}
_MIDNIGHT, _MIDDAY, _LAST_SECOND = 0, _DAY // 2, _DAY - 1
# Distinct rules whose verdict is remembered: checking one takes a few
# milliseconds.
_CACHED_RULES = 4096
# The most modifiers a rule a client sends may have. Bedrock's own rules
# use up to five. The check's samples grow with the product of WEEKDAY and
# month steps, and its SQL nests one call per modifier, which SQLite's
# parser refuses beyond about 25: at 8 the check stays a fraction of a
# second in the worst case, instead of minutes or a "parser stack overflow".
MAX_MODIFIERS = 8

def _expression(modifiers: tuple[str, ...], base: str) -> tuple[str, list[str]]:
    """SQL computing `base` with the modifiers applied one by one, as
    `sqlite_functions.datetime_after` does (NULL where SQLite cannot), and its
    parameters."""
    sql, parameters = base, []
    for modifier in modifiers:
        if modifier == START_OF_HOUR:
            sql = f"STRFTIME('%Y-%m-%d %H:00:00', {sql})"
        else:
            sql = f"DATETIME({sql}, ?)"
            parameters.append(modifier)
    return f"DATETIME({sql})", parameters


def _day_text(day: int) -> str:
    return date.fromordinal(day).isoformat() + " "


@lru_cache(maxsize=2 * _DAY)
def _time_text(second: int) -> str:
    return f"{second // _HOUR:02d}:{second // 60 % 60:02d}:{second % 60:02d}"


def _calendar_dates() -> list[str]:
    return [
        _day_text(date(year, month, day).toordinal())
        for year in _SAMPLE_YEARS
        for month in range(1, 13)
        for day in _SAMPLE_DAYS
        if day <= calendar.monthrange(year, month)[1]
    ]


_CALENDAR_DATES = _calendar_dates()
_HOURLY_DATE_TEXTS = [_day_text(day) for day in _HOURLY_DATES]


@dataclass
class _Jumps:
    """Where a rule's result may jump, found from its modifiers."""

    # Times of day to try on every calendar date, and on the hourly dates.
    daily: set[int]
    hourly: set[int]
    # For each step that reads the month: the offsets before it, undone
    # (negated, in reverse order), to carry a month's start back to a base.
    undo_before_month_steps: list[tuple[str, ...]]


def _jumps(modifiers: tuple[str, ...]) -> _Jumps:
    """Before the first `START OF`, every step moves the time by whole days
    except the fixed offsets (seconds to days), so a step that reads the
    calendar jumps where the base plus the offsets so far crosses midnight
    (or, for `START OF HOUR`, any hour), and a step that reads the month
    where that crosses into another month. After the first `START OF` the
    result is constant between that step's own jumps.
    """
    shift = 0
    jumps = _Jumps({_MIDNIGHT, _MIDDAY, _LAST_SECOND}, set(), [])
    offsets: list[str] = []
    weekdays = 0
    for modifier in modifiers:
        number, _, unit = modifier[1:].partition(" ")
        if modifier[0] in "+-" and unit in _FIXED_SECONDS:
            sign = 1 if modifier[0] == "+" else -1
            shift += sign * int(number) * _FIXED_SECONDS[unit]
            offsets.append(modifier)
            continue
        jumps.daily.update((-shift - before) % _DAY for before in (0, 1))
        if modifier == START_OF_HOUR:
            jumps.hourly.update(
                (-shift - before) % _HOUR + hour * _HOUR for hour in range(24) for before in (0, 1)
            )
        elif modifier.startswith("WEEKDAY"):
            weekdays += 1
        else:
            # START OF DAY reads only the date; the rest read the month.
            undo = tuple(_negated(m) for m in reversed(offsets))
            jumps.undo_before_month_steps += [
                (*undo, f"-{days} DAYS") for days in range(6 * weekdays + 1)
            ]
        if modifier.startswith("START OF"):
            break
        if modifier[0] in "+-":
            offsets.append(modifier)
    return jumps


def _negated(modifier: str) -> str:
    return ("-" if modifier[0] == "+" else "+") + modifier[1:]


# The first second of every month of the sample years.
_MONTH_STARTS = [
    f"{year:04d}-{month:02d}-01 00:00:00" for year in _SAMPLE_YEARS for month in range(1, 13)
]


def sample_bases(modifiers: tuple[str, ...]) -> list[str]:
    """The base moments a rule with these modifiers is tried from."""
    jumps = _jumps(modifiers)
    daily = [_time_text(second) for second in sorted(jumps.daily)]
    hourly = [_time_text(second) for second in sorted(jumps.hourly)]
    bases = [day + time for day in _CALENDAR_DATES for time in daily]
    bases += [day + time for day in _HOURLY_DATE_TEXTS for time in hourly]
    for undo in jumps.undo_before_month_steps:
        for before in ("-0 SECONDS", "-1 SECONDS"):
            sql, parameters = _expression((*undo, before), "value")
            rows = sqlite_functions.connection().execute(
                f"SELECT {sql} FROM json_each(?)", (*parameters, json.dumps(_MONTH_STARTS))
            )
            # Years before 0000 do not sort as text: out of the sample.
            bases += [base for (base,) in rows if base is not None and base[0].isdigit()]
    return bases


def rules_in(request_text: str) -> list[str]:
    """Repeat rules a CreateJobs `jobs` value holds, found without parsing
    more than its JSON; [] when it is not what CreateJobs wants."""
    try:
        elements = jsonbody.parse(request_text)
    except ValueError:  # not JSON, or nested too deeply (jsonbody.TooDeep)
        return []
    if not isinstance(elements, list):
        return []
    found = []
    for element in elements:
        if isinstance(element, dict):
            found += [v for k, v in element.items() if k.lower() == "repeat" and isinstance(v, str)]
    return found


def warm(texts: list[str]) -> None:
    """Check these rules now, so that the verdicts are cached before the
    writer asks: the check can take tens of milliseconds, and the writer
    thread serves everyone. Run in a thread of its own; errors are the
    writer's to report."""
    for text in texts:
        try:
            rule = parse_repeat(text)
        except MalformedRepeat:
            continue
        if len(rule.modifiers) <= MAX_MODIFIERS:
            _problem(rule.modifiers)


def check_moves_forward(rule: Repeat) -> None:
    """Raise MalformedRepeat, with the reason, if from some base the rule
    gives a time that is not later than the base, or if it has more
    modifiers than can be checked."""
    if len(rule.modifiers) > MAX_MODIFIERS:
        problem = f"more than {MAX_MODIFIERS} modifiers"
    else:
        problem = _problem(rule.modifiers)
    if problem:
        raise MalformedRepeat(", ".join((rule.base, *rule.modifiers)), problem)


@lru_cache(maxsize=_CACHED_RULES)
def _problem(modifiers: tuple[str, ...]) -> str:
    """Why these modifiers do not always move forward, or ""."""
    found = first_not_later(modifiers, sample_bases(modifiers))
    if found is None:
        return ""
    base, result = found
    if result is None:
        return f"out of range from {base}"
    return f"does not move forward from {base} (gives {result})"


def first_not_later(modifiers: tuple[str, ...], bases: list[str]) -> tuple[str, str | None] | None:
    """The first base from which the modifiers give no later time, and what
    they give there (None: no time, out of SQLite's range); None if every
    base moves forward."""
    sql, parameters = _expression(modifiers, "value")
    # Text order is time order for the years 0000 to 9999, SQLite's range.
    found = sqlite_functions.connection().execute(
        f"SELECT value, result FROM (SELECT value, {sql} AS result FROM json_each(?)) "
        "WHERE result IS NULL OR result <= value LIMIT 1",
        (*parameters, json.dumps(bases)),
    ).fetchone()
    return None if found is None else (found[0], found[1])
