"""Times as jobs store them: UTC text that sorts the way time runs.

`created` and `lastRun` have second precision, `YYYY-MM-DD HH:MM:SS`; the
default `nextRun` of a new job has milliseconds so that jobs created within
the same second are still handed out oldest first. Because the text sorts like the
time, "is this job due" is a text comparison SQLite can answer from an index.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone, tzinfo

from dateutil import parser as dateparser
from dateutil import tz

SECONDS_FORMAT = "%Y-%m-%d %H:%M:%S"

_DEFAULTS = (datetime(2000, 1, 1), datetime(2001, 2, 2))


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def to_seconds(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime(SECONDS_FORMAT)


def to_millis(moment: datetime) -> str:
    # Built by hand: this runs for every request, and strftime is slow.
    t = moment.astimezone(timezone.utc)
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond // 1000:03d}"
    )


def parse_stored(text: str) -> datetime:
    """Read back a time this server wrote (seconds or milliseconds)."""
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def _zone(name: str | None, offset: int | None) -> tzinfo:
    """Time zone names in a time: UTC and its aliases only. An abbreviation
    such as `PST` means different zones in different places, so a time that
    uses one is refused rather than silently read as UTC."""
    if offset is not None:
        return tz.tzoffset(name, offset)
    if name is None or name.upper() in ("UTC", "GMT", "Z", "UT"):
        return timezone.utc
    raise ValueError(f"unknown time zone {name!r}")


def parse_user_time(text: str) -> str:
    """Parse a time a person wrote (`2026-12-01`, `2026-12-01 08:00`,
    `2026-12-01T08:00:00+02:00`, ...) into stored UTC text.

    A time without an offset is taken as UTC, as Bedrock's are. Raises
    ValueError when the text is not a time.
    """
    if not any(ch.isdigit() for ch in text):
        raise ValueError(f"not a time: {text!r}")
    try:
        moment = dateparser.parse(text, default=_DEFAULTS[0], tzinfos=_zone)
        # dateutil fills missing fields from its default: text that names no
        # full date ("5", "2026") parses differently with another default,
        # and is refused rather than read as some day this month.
        if moment != dateparser.parse(text, default=_DEFAULTS[1], tzinfos=_zone):
            raise ValueError(f"not a complete date: {text!r}")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        stored = to_seconds(moment)
    except (ValueError, OverflowError) as error:
        raise ValueError(str(error)) from error
    # strftime does not pad years below 1000, and such text would not sort.
    if len(stored) != 19:
        raise ValueError(f"year out of range: {text!r}")
    return stored


_DURATION = re.compile(r"([0-9]{1,9})([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`0`, `90`, `90s`, `30m`, `12h`, `7d` -> seconds; ValueError otherwise."""
    found = _DURATION.fullmatch(text.strip().lower())
    if found is None:
        raise ValueError(f"not a duration: {text!r}")
    return float(int(found.group(1)) * _UNIT_SECONDS[found.group(2)])
