"""The repeat / retryAfter whitelist, checked against SQLite's own DATETIME()."""

from __future__ import annotations

import re
import sqlite3
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.model.repeat import (
    REANCHOR_LIMIT_SECONDS,
    START_OF_HOUR,
    MalformedRepeat,
    Repeat,
    parse_modifier,
    parse_modifiers,
    parse_repeat,
    reanchor,
)

FAST = settings(max_examples=300, deadline=None)

_db = sqlite3.connect(":memory:")


def sqlite_datetime(modifier: str) -> str | None:
    """What the store would compute: DATETIME(base, modifier), NULL if SQLite refuses."""
    row = _db.execute("SELECT DATETIME('2026-01-01 00:00:00', ?)", (modifier,)).fetchone()
    return row[0]


# The only shapes a modifier may take once normalised.
NORMAL_FORM = re.compile(
    r"[+-][0-9]{1,8} SECONDS|[+-][0-9]{1,3} (MINUTE|HOUR|DAY|MONTH|YEAR)S"
    r"|START OF (DAY|MONTH|YEAR|HOUR)|WEEKDAY [0-6]"
)


def assert_safe(modifiers: tuple[str, ...]) -> None:
    for modifier in modifiers:
        assert NORMAL_FORM.fullmatch(modifier), modifier
        if modifier != START_OF_HOUR:  # the store truncates to the hour itself
            assert sqlite_datetime(modifier) is not None, modifier


# Examples.


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FINISHED, +1 HOUR", Repeat("FINISHED", ("+1 HOURS",))),
        ("started, +90 minutes", Repeat("STARTED", ("+90 MINUTES",))),
        (
            "SCHEDULED, +1 DAY, START OF DAY, +4 HOURS",
            Repeat("SCHEDULED", ("+1 DAYS", "START OF DAY", "+4 HOURS")),
        ),
        (
            "SCHEDULED, START OF DAY, +5 MINUTES, START OF HOUR",
            Repeat("SCHEDULED", ("START OF DAY", "+5 MINUTES", "START OF HOUR")),
        ),
        ("Scheduled,-5 Seconds", Repeat("SCHEDULED", ("-5 SECONDS",))),
        ("  FINISHED ,  +2   MONTHS  ", Repeat("FINISHED", ("+2 MONTHS",))),
        ("FINISHED, +007 YEARS", Repeat("FINISHED", ("+7 YEARS",))),
        ("FINISHED, WEEKDAY 0, START OF YEAR", Repeat("FINISHED", ("WEEKDAY 0", "START OF YEAR"))),
        ("FINISHED, +99999999 SECONDS", Repeat("FINISHED", ("+99999999 SECONDS",))),
        ("FINISHED, -999 DAYS", Repeat("FINISHED", ("-999 DAYS",))),
    ],
)
def test_parse_repeat(text: str, expected: Repeat) -> None:
    assert parse_repeat(text) == expected


@pytest.mark.parametrize(
    ("canned", "expected"),
    [
        ("HOURLY", Repeat("FINISHED", ("+1 HOURS",))),
        ("daily", Repeat("FINISHED", ("+1 DAYS",))),
        (" Weekly ", Repeat("FINISHED", ("+7 DAYS",))),
    ],
)
def test_canned_schedules(canned: str, expected: Repeat) -> None:
    assert parse_repeat(canned) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "FINISHED",
        "FINISHED,",
        "FINISHED, +1 HOUR,",
        "FINISHED,, +1 HOUR",
        "+1 HOUR",
        "NOW, +1 HOUR",
        "HOURLY, +1 HOUR",
        "FINISHED, 1 HOUR",
        "FINISHED, +1 WEEK",
        "FINISHED, +1.5 HOURS",
        "FINISHED, +1e3 SECONDS",
        "FINISHED, +0x10 SECONDS",
        "FINISHED, +-1 HOUR",
        "FINISHED, ++1 HOUR",
        "FINISHED, +123456789 SECONDS",
        "FINISHED, +1000 DAYS",
        "FINISHED, +99999999999999999999 SECONDS",
        "FINISHED, +1 HOURSS",
        "FINISHED, +1 HOUR +1 HOUR",
        "FINISHED, WEEKDAY 7",
        "FINISHED, WEEKDAY -1",
        "FINISHED, START OF WEEK",
        "FINISHED, START OF MINUTE",
        "FINISHED, 2026-01-01",
        # SQLite modifiers outside the whitelist: time zones and epochs
        # would make a repeat mean something else on every host.
        "FINISHED, localtime",
        "FINISHED, utc",
        "FINISHED, unixepoch",
        "FINISHED, julianday",
        "FINISHED, subsec",
        "FINISHED, auto",
        # Whatever reaches SQLite is one of the known shapes.
        "FINISHED, +1 HOUR'; DROP TABLE jobs; --",
        "FINISHED, +1 HOUR')",
        "FINISHED, +1 HOUR /*",
        "FINISHED; DROP TABLE jobs",
        "FINISHED, +1 HOUR\x00",
        "FINISHED\x00, +1 HOUR",
        "FINISHED, +1\x00 HOUR",
    ],
)
def test_malformed_repeats_are_rejected(text: str) -> None:
    with pytest.raises(MalformedRepeat):
        parse_repeat(text)


def test_start_of_hour_is_only_for_repeats() -> None:
    assert parse_modifier("start of hour", allow_start_of_hour=True) == START_OF_HOUR
    with pytest.raises(MalformedRepeat):
        parse_modifier("START OF HOUR")
    with pytest.raises(MalformedRepeat):
        parse_modifiers("+1 HOUR, START OF HOUR")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("+5 MINUTES", ("+5 MINUTES",)),
        ("+1 second", ("+1 SECONDS",)),
        ("+1 DAY, START OF DAY", ("+1 DAYS", "START OF DAY")),
    ],
)
def test_parse_modifiers(text: str, expected: tuple[str, ...]) -> None:
    assert parse_modifiers(text) == expected


@pytest.mark.parametrize("text", ["", ",", " , ", "FINISHED, +1 HOUR", "+1 HOUR; DROP"])
def test_malformed_retry_after(text: str) -> None:
    with pytest.raises(MalformedRepeat):
        parse_modifiers(text)


@pytest.mark.parametrize(
    ("part", "accepted"),
    [
        ("+1 SECOND", True),
        ("+12345678 SECONDS", True),
        ("+123456789 SECONDS", False),
        ("+123 MINUTES", True),
        ("+1234 MINUTES", False),
        ("+999 HOURS", True),
        ("+1000 HOURS", False),
        ("+999 MONTHS", True),
        ("-999 YEARS", True),
        ("+1000 YEARS", False),
    ],
)
def test_digit_limits(part: str, accepted: bool) -> None:
    # Bedrock's limits: 8 digits of seconds, 3 of anything else.
    if accepted:
        assert sqlite_datetime(parse_modifier(part)) is not None
    else:
        with pytest.raises(MalformedRepeat):
            parse_modifier(part)


def test_only_offsets() -> None:
    assert parse_repeat("SCHEDULED, +1 HOUR, -5 MINUTES").only_offsets
    assert not parse_repeat("SCHEDULED, +1 DAY, START OF DAY").only_offsets
    assert not parse_repeat("SCHEDULED, +1 DAY, WEEKDAY 1").only_offsets


# Properties: whatever the whitelist lets through, SQLite understands.


def random_case(draw: st.DrawFn, text: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.lower() if flip else c for c, flip in zip(text, flips, strict=True))


_GAP = st.sampled_from([" ", "  ", "\t", " \t "])


@st.composite
def modifier_and_normal_form(draw: st.DrawFn) -> tuple[str, str]:
    """A modifier as a person might type it, and its normal form."""
    kind = draw(st.sampled_from(["seconds", "other", "start", "weekday"]))
    gap = draw(_GAP)
    if kind == "seconds":
        sign = draw(st.sampled_from("+-"))
        digits = draw(st.from_regex(r"[0-9]{1,8}", fullmatch=True))
        plural = draw(st.sampled_from(["", "S"]))
        raw, normal = f"{sign}{digits}{gap}SECOND{plural}", f"{sign}{int(digits)} SECONDS"
    elif kind == "other":
        sign = draw(st.sampled_from("+-"))
        digits = draw(st.from_regex(r"[0-9]{1,3}", fullmatch=True))
        unit = draw(st.sampled_from(["MINUTE", "HOUR", "DAY", "MONTH", "YEAR"]))
        plural = draw(st.sampled_from(["", "S"]))
        raw, normal = f"{sign}{digits}{gap}{unit}{plural}", f"{sign}{int(digits)} {unit}S"
    elif kind == "start":
        unit = draw(st.sampled_from(["DAY", "MONTH", "YEAR"]))
        raw, normal = f"START{gap}OF {unit}", f"START OF {unit}"
    else:
        day = draw(st.integers(0, 6))
        raw, normal = f"WEEKDAY{gap}{day}", f"WEEKDAY {day}"
    padding = draw(st.sampled_from(["", " ", "  "]))
    return padding + random_case(draw, raw) + padding, normal


@FAST
@given(
    base=st.sampled_from(["SCHEDULED", "STARTED", "FINISHED"]),
    parts=st.lists(modifier_and_normal_form(), min_size=1, max_size=5),
    data=st.data(),
)
def test_every_valid_repeat_parses_to_sqlite_modifiers(
    base: str, parts: list[tuple[str, str]], data: st.DataObject
) -> None:
    text = ",".join([random_case(data.draw, base), *(raw for raw, _ in parts)])
    rule = parse_repeat(text)
    assert rule == Repeat(base, tuple(normal for _, normal in parts))
    assert_safe(rule.modifiers)
    assert parse_modifiers(",".join(raw for raw, _ in parts)) == rule.modifiers


# Pieces of the grammar, SQL and SQLite's other modifiers, mixed freely.
_TOKENS = st.sampled_from(
    [
        "+", "-", " ", ",", "1", "0", "7", "99999999", "123456789", "1000",
        "SECOND", "MINUTE", "HOUR", "DAY", "MONTH", "YEAR", "S", "WEEKDAY",
        "START OF", "FINISHED", "SCHEDULED", "STARTED", "HOURLY", "WEEKLY",
        "localtime", "utc", "unixepoch", "julianday", "subsec", "auto",
        "'", ";", "--", "DROP TABLE jobs", "\x00", ".5", "e3", "\n", "\u0660",
    ]
)


@FAST
@given(st.lists(_TOKENS, max_size=14).map("".join) | st.text(max_size=40))
def test_accepted_repeat_is_always_safe(text: str) -> None:
    try:
        rule = parse_repeat(text)
    except MalformedRepeat:
        return
    assert rule.base in ("SCHEDULED", "STARTED", "FINISHED")
    assert rule.modifiers
    assert_safe(rule.modifiers)


@FAST
@given(st.lists(_TOKENS, max_size=10).map("".join) | st.text(max_size=30))
def test_accepted_retry_after_is_always_safe(text: str) -> None:
    try:
        modifiers = parse_modifiers(text)
    except MalformedRepeat:
        return
    assert START_OF_HOUR not in modifiers
    assert_safe(modifiers)


# Re-anchoring a SCHEDULED repeat that fell behind.

T0 = datetime(2026, 1, 1, 10, 0, 0)


def test_reanchor_keeps_phase_and_skips_to_the_next_slot() -> None:
    # `SCHEDULED, +30 SECONDS` scheduled an hour ago runs once, on its phase.
    now = T0 + timedelta(hours=1, seconds=10)
    assert reanchor(T0, T0 + timedelta(seconds=30), now) == T0 + timedelta(hours=1, seconds=30)


def test_reanchor_when_now_is_exactly_on_a_slot_goes_to_the_next() -> None:
    now = T0 + timedelta(seconds=90)
    assert reanchor(T0, T0 + timedelta(seconds=30), now) == T0 + timedelta(seconds=120)


def test_reanchor_is_exact_where_float_seconds_are_not() -> None:
    # 0.3 // 0.1 == 2.0 in floats; the slot must still be after `now`.
    now = T0 + timedelta(milliseconds=300)
    result = reanchor(T0, T0 + timedelta(milliseconds=100), now)
    assert result == T0 + timedelta(milliseconds=400)


def test_reanchor_leaves_a_future_time_alone() -> None:
    computed = T0 + timedelta(seconds=30)
    assert reanchor(T0, computed, T0 + timedelta(seconds=5)) == computed


def test_reanchor_leaves_long_intervals_to_catch_up_one_by_one() -> None:
    # `SCHEDULED, +5 HOURS` scheduled 10 h ago: still in the past.
    computed = T0 + timedelta(hours=5)
    assert reanchor(T0, computed, T0 + timedelta(hours=10)) == computed
    edge = T0 + timedelta(seconds=REANCHOR_LIMIT_SECONDS)
    assert reanchor(T0, edge, T0 + timedelta(days=1)) == edge


@pytest.mark.parametrize("shift", [timedelta(0), timedelta(seconds=-30)])
def test_reanchor_ignores_intervals_that_do_not_move_forward(shift: timedelta) -> None:
    assert reanchor(T0, T0 + shift, T0 + timedelta(hours=1)) == T0 + shift


@FAST
@given(
    interval_us=st.integers(1, REANCHOR_LIMIT_SECONDS * 10**6 - 1),
    behind_us=st.integers(0, 30 * 86400 * 10**6),
    start_us=st.integers(0, 10**6 - 1),
)
def test_reanchor_lands_on_the_first_slot_after_now(
    interval_us: int, behind_us: int, start_us: int
) -> None:
    last = T0 + timedelta(microseconds=start_us)
    interval = timedelta(microseconds=interval_us)
    now = last + max(interval, timedelta(microseconds=behind_us))
    result = reanchor(last, last + interval, now)
    assert result > now
    assert result - interval <= now
    assert (result - last) % interval == timedelta(0)
