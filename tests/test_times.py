"""Stored times are UTC text that sorts the way time runs."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.model import times
from jobserver.model.times import parse_stored, parse_user_time, to_millis, to_seconds

FAST = settings(max_examples=300, deadline=None)

SECONDS_TEXT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")
MILLIS_TEXT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}")


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("2026-12-01", "2026-12-01 00:00:00"),
        ("2026-12-01 08:00", "2026-12-01 08:00:00"),
        ("2026-12-01 08:00:59", "2026-12-01 08:00:59"),
        ("2026-12-01 08:00:59.999", "2026-12-01 08:00:59"),
        ("2026-12-01T08:00:00", "2026-12-01 08:00:00"),
        ("2026-12-01T08:00:00Z", "2026-12-01 08:00:00"),
        ("2026-12-01T08:00:00+02:00", "2026-12-01 06:00:00"),
        ("2026-12-01T23:30:00-02:00", "2026-12-02 01:30:00"),
        ("2026-01-01T01:00:00+05:30", "2025-12-31 19:30:00"),
        ("1000-01-01", "1000-01-01 00:00:00"),
        ("9999-12-31 23:59:59", "9999-12-31 23:59:59"),
    ],
)
def test_parse_user_time(text: str, stored: str) -> None:
    assert parse_user_time(text) == stored


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "soon",
        "next tuesday",
        "abc1",
        "2026-13-01",
        "2026-02-30",
        "2026-12-01 25:00",
        "2026-12-01T08:00:00+25:00",
        "10000-01-01",
        "99999999999999999999999",
        "2026-12-01'; DROP TABLE jobs",
    ],
)
def test_garbage_is_not_a_time(text: str) -> None:
    with pytest.raises(ValueError):
        parse_user_time(text)


@pytest.mark.parametrize(
    "text",
    [
        "0999-12-31 23:59:59",
        "999-01-01",
        "0001-01-01",
        # In range as written, but not once moved to UTC.
        "1000-01-01T00:30:00+01:00",
        "0001-01-01T00:00:00+01:00",
        "9999-12-31T23:00:00-02:00",
    ],
)
def test_years_outside_four_digits_are_rejected(text: str) -> None:
    # strftime does not pad years below 1000, so such text would not sort.
    with pytest.raises(ValueError):
        parse_user_time(text)


# Aware datetimes in the years whose text sorts; kept a day clear of the
# ends so an offset cannot move them out.
_MOMENTS = st.datetimes(
    min_value=datetime(1000, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
)
_OFFSETS = st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: timezone(timedelta(minutes=m)))


@FAST
@given(moment=_MOMENTS, offset=_OFFSETS)
def test_iso_time_with_any_offset_is_stored_as_utc(moment: datetime, offset: timezone) -> None:
    written = moment.astimezone(offset).replace(microsecond=0).isoformat()
    assert parse_user_time(written) == to_seconds(moment)


# protocol.md 4.3, written out again: year first, two-digit fields.
DOCUMENTED = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r"([Tt ][0-9]{2}(:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?)?"
    r"( ?([Zz]|[Uu][Tt][Cc]?|[Gg][Mm][Tt]|[+-][0-9]{2}(:?[0-9]{2})?))?)?"
)


@FAST
@given(st.text(max_size=30) | st.from_regex(DOCUMENTED, fullmatch=True))
def test_any_text_is_a_documented_time_or_a_value_error(text: str) -> None:
    try:
        stored = parse_user_time(text)
    except ValueError:
        return
    assert DOCUMENTED.fullmatch(text.strip()), text
    assert SECONDS_TEXT.fullmatch(stored)


@st.composite
def written_times(draw: st.DrawFn) -> tuple[str, datetime]:
    """A time in one of the documented forms, and the moment it names."""
    moment = draw(_MOMENTS).replace(tzinfo=None)
    precision = draw(st.sampled_from(["date", "hour", "minute", "second", "fraction"]))
    keep = {"date": 0, "hour": 1, "minute": 2, "second": 3, "fraction": 3}[precision]
    fields = [moment.hour, moment.minute, moment.second][:keep]
    # Fields left out are zero; a fraction is dropped.
    moment = datetime(moment.year, moment.month, moment.day, *fields)
    text = f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"
    if precision == "date":
        return text, moment.replace(tzinfo=UTC)
    text += draw(st.sampled_from(["T", "t", " "])) + ":".join(f"{f:02d}" for f in fields)
    if precision == "fraction":
        text += "." + draw(st.from_regex(r"[0-9]{1,9}", fullmatch=True))
    zone = draw(st.sampled_from(["none", "name", "offset"]))
    gap = draw(st.sampled_from(["", " "]))
    if zone == "name":
        text += gap + draw(st.sampled_from(["Z", "z", "UTC", "utc", "GMT", "UT"]))
    if zone != "offset":
        return text, moment.replace(tzinfo=UTC)
    minutes = draw(st.integers(-(23 * 60 + 59), 23 * 60 + 59))
    if draw(st.booleans()):
        minutes -= minutes % 60 if minutes >= 0 else -(-minutes % 60)
    sign, size = ("-" if minutes < 0 else "+"), abs(minutes)
    hours_text, minutes_text = f"{size // 60:02d}", f"{size % 60:02d}"
    if size % 60 == 0 and draw(st.booleans()):
        text += f"{gap}{sign}{hours_text}"
    else:
        text += f"{gap}{sign}{hours_text}{draw(st.sampled_from([':', '']))}{minutes_text}"
    return text, moment.replace(tzinfo=timezone(timedelta(minutes=minutes)))


@FAST
@given(written_times())
def test_every_documented_form_is_read(written: tuple[str, datetime]) -> None:
    text, moment = written
    assert parse_user_time(text) == to_seconds(moment)


@FAST
@given(st.dates(min_value=datetime(1000, 1, 1).date(), max_value=datetime(9999, 12, 31).date()))
def test_dates_written_other_than_year_first_are_refused(day) -> None:
    y, m, d = day.year, day.month, day.day
    for text in (
        f"{m}/{d}/{y}", f"{d}/{m}/{y}", f"{m:02d}/{d:02d}/{y}", f"{d:02d}.{m:02d}.{y}",
        f"{d:02d}-{m:02d}-{y}", f"{y}/{m:02d}/{d:02d}", f"{y}{m:02d}{d:02d}",
        day.strftime("%b %d %Y"), day.strftime("%d %B %Y"), day.strftime("%B %d, %Y 10:00"),
    ):
        with pytest.raises(ValueError):
            parse_user_time(text)


@pytest.mark.parametrize(
    "text",
    [
        "1/2/2030", "2/1/2030", "Jan 2 2030", "2030/01/02", "2030-1-2", "2030-01-2",
        "2030-01-02 1:00", "2030-01-02 10:0", "2030-01-02 10:00:0", "2030-01-02  10:00",
        "2030-01-02 10:00 PST", "2030-01-02 10:00 CET", "2030-01-02 10:00+2",
        "2030-01-02 10:00+02:00:00", "2030-01-02 10:00 +24:00", "2030-01-02 10:00+02:60",
        "2030-01-02Z", "2030-01-02 10:00:60", "2030-01-02 24:00", "\u0662030-01-02",
        "\uff12030-01-02", "2030-01-02 10:00:00.", "2030-01-02T",
    ],
)
def test_ambiguous_or_incomplete_forms_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_user_time(text.encode().decode("unicode_escape"))


def test_formats() -> None:
    moment = datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
    assert to_seconds(moment) == "2026-03-04 05:06:07"
    assert to_millis(moment) == "2026-03-04 05:06:07.890"


def test_formats_convert_to_utc() -> None:
    moment = datetime(2026, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=2)))
    assert to_seconds(moment) == "2025-12-31 23:00:00"
    assert to_millis(moment) == "2025-12-31 23:00:00.000"


@FAST
@given(a=_MOMENTS, b=_MOMENTS)
def test_text_sorts_like_time(a: datetime, b: datetime) -> None:
    # "Is this job due" is a text comparison in SQLite, so text order must
    # be time order, at each precision and across the two precisions.
    a, b = min(a, b), max(a, b)
    assert SECONDS_TEXT.fullmatch(to_seconds(a))
    assert MILLIS_TEXT.fullmatch(to_millis(a))
    assert to_seconds(a) <= to_seconds(b)
    assert to_millis(a) <= to_millis(b)
    assert to_seconds(a) <= to_millis(b)
    if to_millis(a) < to_seconds(b):
        assert a < b
    if b - a >= timedelta(seconds=1):
        assert to_seconds(a) < to_seconds(b)
    if b - a >= timedelta(milliseconds=1):
        assert to_millis(a) < to_millis(b)


@FAST
@given(st.datetimes(timezones=st.just(UTC)))
def test_millis_are_written_as_format_specs_write_them(moment: datetime) -> None:
    # to_millis looks its digits up in tables; years below 1000 padded too.
    t = moment
    assert to_millis(moment) == (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond // 1000:03d}"
    )


def test_a_later_time_is_made_once_a_moment_for_each_span() -> None:
    now = datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
    now_ms = to_millis(now)
    day = times.later_millis(now, now_ms, 86400)
    assert day == "2026-03-05 05:06:07.890"
    assert times.later_millis(now, now_ms, 86400) is day
    assert times.later_millis(now, now_ms, 1.5) == "2026-03-04 05:06:09.390"
    assert times.later_millis(now, now_ms, 86400) is day
    later = now + timedelta(seconds=1)
    assert times.later_millis(later, to_millis(later), 86400) == "2026-03-05 05:06:08.890"


@FAST
@given(_MOMENTS)
def test_stored_text_reads_back(moment: datetime) -> None:
    assert parse_stored(to_seconds(moment)) == moment.replace(microsecond=0)
    truncated = moment.replace(microsecond=moment.microsecond // 1000 * 1000)
    assert parse_stored(to_millis(moment)) == truncated


@pytest.mark.parametrize("text", ["5", "2026", "-1", "1.5", "2026-12", "10:00"])
def test_text_without_a_complete_date_is_refused(text: str) -> None:
    # dateutil would fill the missing parts from today's date; a job must
    # not run on "some day this month" because of a typo.
    with pytest.raises(ValueError):
        parse_user_time(text)


@given(st.integers(0, 3650 * 86400))
def test_a_duration_is_written_whole_and_reads_back(seconds: int) -> None:
    # It names --stale-after in a job's lastError: 1234567 was "1.23457e+06s".
    text = times.duration_text(seconds)
    assert "e" not in text and times.parse_duration(text) == seconds
