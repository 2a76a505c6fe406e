"""The repeat and retryAfter grammar.

A repeat is a base and one or more SQLite date modifiers:
`FINISHED, +1 HOUR`, `SCHEDULED, +1 DAY, START OF DAY, +4 HOURS`. Every part
is checked against a whitelist here and normalised, so what reaches SQLite
is always one of a handful of known shapes, passed as a bound parameter.
SQLite's own `DATETIME()` does the arithmetic (sqlite_functions.py).
Any rule that parses is accepted, as Bedrock does, even one that can give
a moment not later than its base: schedule.py keeps such a job from
running twice for one moment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from jobserver.model import sqlite_functions

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
    """Not a rule."""


@dataclass(frozen=True)
class Repeat:
    base: str
    modifiers: tuple[str, ...]

    @property
    def only_offsets(self) -> bool:
        """True when every modifier is a plain `+N UNIT` / `-N UNIT` shift."""
        return all(m[0] in "+-" for m in self.modifiers)

    @property
    def only_fixed_offsets(self) -> bool:
        """True when every modifier shifts by a fixed length (seconds to
        days), so the rule moves every moment by the same amount; a month
        or a year is as long as the calendar makes it."""
        return self.only_offsets and not any(
            m.endswith(("MONTH", "MONTHS", "YEAR", "YEARS")) for m in self.modifiers
        )


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
