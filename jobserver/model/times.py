"""Times as jobs store them: UTC text that sorts the way time runs.

`created` and `lastRun` have second precision, `YYYY-MM-DD HH:MM:SS`; the
default `nextRun` of a new job has milliseconds so that jobs created within
the same second are still handed out oldest first. Because the text sorts like the
time, "is this job due" is a text comparison SQLite can answer from an index.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

SECONDS_FORMAT = "%Y-%m-%d %H:%M:%S"

# The times clients send: year first, so that no reader can take the day
# for the month. `YYYY-MM-DD`, then optionally `T` or a space and
# `HH[:MM[:SS[.fraction]]]`, then optionally a zone: `Z`, `UTC`, `GMT`,
# `UT` or a numeric offset (`+02:00`, `+0200`, `-08`), after an optional
# space. Names other than UTC's (`PST`) are refused: abbreviations mean
# different zones in different places.
_USER_TIME = re.compile(
    r"(?P<year>[0-9]{4})-(?P<month>[0-9]{2})-(?P<day>[0-9]{2})"
    r"(?:[T ](?P<hour>[0-9]{2})(?::(?P<minute>[0-9]{2})"
    r"(?::(?P<second>[0-9]{2})(?:\.[0-9]+)?)?)?"
    r"(?: ?(?:Z|UTC|GMT|UT"
    r"|(?P<sign>[+-])(?P<offset_hours>[0-9]{2})(?::?(?P<offset_minutes>[0-9]{2}))?))?)?",
    re.IGNORECASE,
)


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_seconds(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(SECONDS_FORMAT)


# Two and three digits, zero-padded, looked up: a format spec per field
# (`{t.month:02d}`) cost three times as much as the rest of to_millis.
_TWO = [f"{n:02d}" for n in range(100)]
_THREE = [f"{n:03d}" for n in range(1000)]


def to_millis(moment: datetime) -> str:
    # Built by hand: this runs several times a batch, and strftime, a format
    # spec per field and isoformat all cost two to three times as much
    # (callgrind: 21,000 instructions with specs, 6,900 so).
    t = moment.astimezone(UTC)
    year = t.year
    return (
        f"{year if year >= 1000 else f'{year:04d}'}-{_TWO[t.month]}-{_TWO[t.day]} "
        f"{_TWO[t.hour]}:{_TWO[t.minute]}:{_TWO[t.second]}.{_THREE[t.microsecond // 1000]}"
    )


# The times `later_millis` made at the last moment asked about, by seconds:
# every request of a batch shares one moment, so a stale deadline or an
# outcome's expiry is formatted once a batch, not once a request.
_later: tuple[str, dict[float, str]] = ("", {})


def later_millis(now: datetime, now_ms: str, seconds: float) -> str:
    """to_millis(now + seconds), where `now_ms` is to_millis(now)."""
    global _later
    # Read once, as a pair: several servers in one process (tests) use it
    # too, each filling only the table of its own moment.
    at, known = _later
    if at != now_ms:
        known = {}
        _later = (now_ms, known)
    later = known.get(seconds)
    if later is None:
        later = known[seconds] = to_millis(now + timedelta(seconds=seconds))
    return later


def parse_stored(text: str) -> datetime:
    """Read back a time this server wrote (seconds or milliseconds)."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def parse_user_time(text: str) -> str:
    """Parse a time a client sent (`2026-12-01`, `2026-12-01 08:00`,
    `2026-12-01T08:00:00+02:00`, ...) into stored UTC text.

    A time without a zone is UTC, as Bedrock's are; fractions of a second
    are dropped. Raises ValueError when the text is not such a time.
    """
    found = _USER_TIME.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"not a time (YYYY-MM-DD[ HH:MM[:SS]][+HH:MM]): {text!r}")
    # The groups that matched, as numbers (the sign stays text).
    number = {k: int(v) for k, v in found.groupdict().items() if v and k != "sign"}
    try:
        moment = datetime(
            number["year"], number["month"], number["day"],
            number.get("hour", 0), number.get("minute", 0), number.get("second", 0),
            tzinfo=_zone(found, number),
        )
        stored = to_seconds(moment)
    except (ValueError, OverflowError) as error:
        raise ValueError(f"not a time: {text!r} ({error})") from error
    # strftime does not pad years below 1000, and such text would not sort.
    if len(stored) != 19:
        raise ValueError(f"year out of range: {text!r}")
    return stored


def _zone(found: re.Match[str], number: dict[str, int]) -> timezone:
    if found["sign"] is None:
        return UTC
    hours, minutes = number["offset_hours"], number.get("offset_minutes", 0)
    if hours > 23 or minutes > 59:
        raise ValueError(f"not an offset: {found['sign']}{hours:02d}:{minutes:02d}")
    offset = timedelta(hours=hours, minutes=minutes)
    return timezone(-offset if found["sign"] == "-" else offset)


_DURATION = re.compile(r"([0-9]{1,9})([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`0`, `90`, `90s`, `30m`, `12h`, `7d` -> seconds; ValueError otherwise."""
    found = _DURATION.fullmatch(text.strip().lower())
    if found is None:
        raise ValueError(f"not a duration: {text!r}")
    return float(int(found.group(1)) * _UNIT_SECONDS[found.group(2)])


def duration_text(seconds: float) -> str:
    """Seconds as the largest unit that writes them whole: 3600 is 1h."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    if not seconds:
        return "0"
    # Not :g, which writes 1234567 as 1.23457e+06.
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{seconds}s"
