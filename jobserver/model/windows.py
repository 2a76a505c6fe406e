"""Time windows: the daily hours in which a job may run (protocol.md 14.8).

A window is a local wall-clock range, `05:00-07:00`, in the job's time
zone; one whose end is not after its start (`22:00-02:00`) spans midnight.
Every function here is pure and takes `now`, so daylight-saving changes
are tested with fixed moments rather than by waiting for them.

Daylight saving: a start that falls in the spring-forward gap (02:30 on
the night clocks jump from 02:00 to 03:00) begins when the gap ends, as a
person's alarm set for then would; a start that happens twice in the
autumn (01:30 when 02:00 goes back to 01:00) is the first of the two.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo

from dateutil import tz

# Twenty windows a day is more than any schedule needs; the cap keeps the
# per-hand-out work small.
MAX_WINDOWS = 20

_WINDOW = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-3]):([0-5][0-9])")
# IANA names only (`Europe/Paris`, `UTC`): no paths, no POSIX TZ strings.
_ZONE = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+)*")


@dataclass(frozen=True)
class Window:
    start: time
    end: time

    def __str__(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"


def parse_windows(text: str) -> tuple[Window, ...]:
    """`05:00-07:00, 22:00-23:30` -> windows; ValueError if malformed."""
    windows = []
    for part in text.split(","):
        found = _WINDOW.fullmatch(part.strip())
        if found is None:
            raise ValueError(f"not a window: {part!r}")
        h1, m1, h2, m2 = (int(g) for g in found.groups())
        if (h1, m1) == (h2, m2):
            raise ValueError(f"empty window: {part!r}")
        windows.append(Window(time(h1, m1), time(h2, m2)))
    if not windows or len(windows) > MAX_WINDOWS:
        raise ValueError("too many windows")
    return tuple(windows)


def format_windows(windows: tuple[Window, ...]) -> str:
    return ",".join(str(w) for w in windows)


def parse_zone(name: str) -> tzinfo:
    """An IANA zone name -> tzinfo; ValueError for anything else."""
    if name.upper() == "UTC":
        return UTC
    zone = tz.gettz(name) if _ZONE.fullmatch(name) else None
    if not isinstance(zone, tz.tzfile):
        raise ValueError(f"unknown time zone {name!r}")
    return zone


def _local(day: date, at: time, zone: tzinfo) -> datetime:
    """A wall-clock time on a day as a UTC moment: gaps move forward,
    repeated times take their first occurrence (fold 0)."""
    moment = datetime.combine(day, at, tzinfo=zone)
    # Gaps last at most a few hours (usually one): walk to their end.
    while not tz.datetime_exists(moment):
        moment = (moment + timedelta(minutes=1)).replace(second=0)
    return moment.astimezone(UTC)


def _intervals(
    windows: tuple[Window, ...], zone: tzinfo, now: datetime
) -> Iterator[tuple[datetime, datetime]]:
    """Every window opening from the day before `now` (local) to a week
    after it, as (start, end) UTC moments."""
    today = now.astimezone(zone).date()
    for offset in range(-1, 9):
        day = today + timedelta(days=offset)
        for window in windows:
            end_day = day if window.end > window.start else day + timedelta(days=1)
            yield _local(day, window.start, zone), _local(end_day, window.end, zone)


def next_start(windows: tuple[Window, ...], zone: tzinfo, now: datetime) -> datetime:
    """`now` if it lies inside a window, else the start of the next one."""
    later = []
    for start, end in _intervals(windows, zone, now):
        if start <= now < end:
            return now
        if start > now:
            later.append(start)
    return min(later)


def place(windows_text: str, zone_name: str, stored: datetime) -> datetime:
    """next_start for a job's stored timeWindows and timeZone."""
    return next_start(parse_windows(windows_text), parse_zone(zone_name or "UTC"), stored)
