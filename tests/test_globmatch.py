"""glob_match decides which waiting GetJobs a new job wakes; it must agree
with SQLite's GLOB, which decides which job a GetJob actually receives, and
so must glob_to_regex, which stands for GLOB on PostgreSQL."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pg
import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobserver.model.globmatch import (
    MAX_SET_CHARACTERS,
    MAX_WILDCARDS,
    after_prefix,
    glob_match,
    glob_to_regex,
    literal_start,
    set_characters,
    too_many_set_characters,
    too_many_wildcards,
    wildcards,
)

_db = sqlite3.connect(":memory:")


def sqlite_glob(pattern: str, text: str) -> bool:
    return bool(_db.execute("SELECT ? GLOB ?", (text, pattern)).fetchone()[0])


@pytest.mark.parametrize(
    ("pattern", "text", "matches"),
    [
        ("*", "", True),
        ("*", "anything", True),
        ("?", "", False),
        ("?", "é", True),
        ("job*", "jobA", True),
        ("job*", "Job", False),  # case sensitive, unlike LIKE
        ("a*b*c", "aXbYbZc", True),
        ("a*b*c", "aXbYbZ", False),
        ("[abc]x", "bx", True),
        ("[a-c]", "d", False),
        ("[^a-c]", "d", True),
        ("[^a-c]", "b", False),
        ("[]]", "]", True),  # `]` first in a set is literal
        ("[^]]", "]", False),
        ("[a-]", "-", True),  # `-` before `]` is literal
        ("[-a]", "-", True),
        ("[z-a]", "m", False),  # an empty range matches nothing
        ("[abc", "a", False),  # an unclosed set matches nothing
        ("x[", "x", False),
        ("[*]", "*", True),  # how a literal star is written
        ("[*]", "a", False),
        ("[?]", "?", True),
        ("[α-ω]", "λ", True),  # noqa: RUF001 - Greek letters on purpose
        ("[α-ω]", "a", False),  # noqa: RUF001 - against a Latin a
        ("€?", "€𝄞", True),
    ],
)
def test_glob(pattern: str, text: str, matches: bool) -> None:
    assert glob_match(pattern, text) is matches
    assert sqlite_glob(pattern, text) is matches


def test_nul_ends_pattern_and_text_as_in_sqlite() -> None:
    # A job name can hold NUL through `\u0000`; SQLite stops reading there.
    assert glob_match("a", "a\0b") == sqlite_glob("a", "a\0b") is True
    assert glob_match("a\0zzz", "a") == sqlite_glob("a\0zzz", "a") is True


# Wildcards and set syntax are most of the alphabet, so sets, ranges and
# negations come up constantly; a few letters (some outside ASCII and outside
# the BMP) give them something to match.
_PATTERN = st.text(st.sampled_from("*?[]^-ab]é€𝄞"), max_size=12)
_TEXT = st.text(st.sampled_from("ab-^]*?[é€𝄞z"), max_size=10)
_TWO_LETTERS = st.text(st.sampled_from("ab"), max_size=40)


@settings(max_examples=1500, deadline=None)
@given(pattern=_PATTERN, text=_TEXT)
@example(pattern="*[", text="a")
@example(pattern="[^]-a]", text="^")
@example(pattern="[]-a]", text="^")
@example(pattern="[a-]b]", text="]")
@example(pattern="*a*?", text="aa")
def test_agrees_with_sqlite(pattern: str, text: str) -> None:
    assert glob_match(pattern, text) == sqlite_glob(pattern, text)


# Many stars over a two-letter alphabet: each run between stars has many
# places to fit, where taking the leftmost one must still find every match.
@settings(max_examples=1500, deadline=None)
@given(pattern=st.text(st.sampled_from("**??ab[]^"), max_size=30), text=_TWO_LETTERS)
@example(pattern="*a?*?b*", text="aab")
@example(pattern="*??*a", text="aa")
def test_many_stars_agree_with_sqlite(pattern: str, text: str) -> None:
    assert glob_match(pattern, text) == sqlite_glob(pattern, text)


@settings(max_examples=300, deadline=None)
@given(
    pattern=st.text(st.characters(blacklist_categories=("Cs",)), max_size=10),
    text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=10),
)
def test_agrees_with_sqlite_on_any_characters(pattern: str, text: str) -> None:
    assert glob_match(pattern, text) == sqlite_glob(pattern, text)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_text_matches_itself_when_free_of_glob_syntax(text: str) -> None:
    literal = "".join(f"[{c}]" if c in "*?[" else c for c in text)
    assert glob_match(literal, text)
    assert sqlite_glob(literal, text)


# A bulk search reads only the names of a pattern's literal start, an index
# range from it to after_prefix of it: every name the pattern matches must
# lie there, in the order of the indexes (SQLite's BINARY, code points).
_ANY = st.characters(blacklist_categories=("Cs",))
_EDGES = st.sampled_from(["\U0010ffff", "\ud7ff", "\ue000", "\x00", "/", "0", "a", "é"])


@settings(max_examples=1500, deadline=None)
@given(pattern=_PATTERN | st.text(_ANY | _EDGES, max_size=10), rest=st.text(_ANY | _EDGES))
@example(pattern="a\0b*", rest="")
def test_every_match_begins_with_the_literal_start(pattern: str, rest: str) -> None:
    start = literal_start(pattern)
    for text in (rest, start + rest):
        if sqlite_glob(pattern, text):
            assert text.startswith(start)


@settings(max_examples=1500, deadline=None)
@given(prefix=st.text(_ANY | _EDGES, max_size=4), text=st.text(_ANY | _EDGES, max_size=6))
@example(prefix="a\U0010ffff", text="a\U0010ffff\U0010ffff")
@example(prefix="\U0010ffff", text="\U0010ffffz")
@example(prefix="\ud7ff", text="\ue000")
def test_the_names_of_a_prefix_are_an_index_range(prefix: str, text: str) -> None:
    end = after_prefix(prefix)
    for name in (text, prefix + text):
        inside = _db.execute(
            "SELECT ? >= ? AND (? IS NULL OR ? < ?)", (name, prefix, end, name, end)
        ).fetchone()[0]
        assert bool(inside) is name.startswith(prefix), (name, prefix, end)


# PostgreSQL has no GLOB: the PostgreSQL backend matches names with
# glob_to_regex's translation, which must agree with SQLite too.


@pytest.fixture(scope="module")
def postgres() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg.database_url(), autocommit=True) as db:
        yield db


def postgres_glob(db: psycopg.Connection[Any], pattern: str, text: str) -> bool:
    # As the jobs table compares names: by code point (COLLATE "C").
    row = db.execute(
        'SELECT %s::text COLLATE "C" ~ %s', (text.replace("\0", ""), glob_to_regex(pattern))
    ).fetchone()
    assert row is not None
    return bool(row[0])


# The connection is the module's; nothing in it changes between examples.
_ONE_CONNECTION = [HealthCheck.function_scoped_fixture]
_ANY = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")


@settings(max_examples=1500, deadline=None, suppress_health_check=_ONE_CONNECTION)
@given(pattern=_PATTERN, text=_TEXT)
@example(pattern="[z-a]", text="m")
@example(pattern="[^z-a]", text="m")
@example(pattern="[", text="[")
@example(pattern="a.b", text="axb")
@example(pattern="[\\]", text="\\")
def test_regex_translation_agrees_with_sqlite(
    postgres: psycopg.Connection[Any], pattern: str, text: str
) -> None:
    assert postgres_glob(postgres, pattern, text) == sqlite_glob(pattern, text)


@settings(max_examples=500, deadline=None, suppress_health_check=_ONE_CONNECTION)
@given(pattern=st.text(_ANY, max_size=10), text=st.text(_ANY, max_size=10))
def test_regex_translation_agrees_on_any_characters(
    postgres: psycopg.Connection[Any], pattern: str, text: str
) -> None:
    assert postgres_glob(postgres, pattern, text) == sqlite_glob(pattern, text)


def test_a_run_of_stars_is_one_star_in_the_regex() -> None:
    """`***` means `*`; written as hundreds of `.*` in a row, it took
    PostgreSQL seconds to compile (17 s for 800), holding a node's writer."""
    assert glob_to_regex("a" + "*" * 5000 + "b") == glob_to_regex("a*b")
    assert glob_to_regex("*?*") == "^.*..*$"


def test_the_longest_pattern_of_stars_is_compiled_at_once_by_postgresql(
    postgres: psycopg.Connection[Any],
) -> None:
    """A pattern of 12,750 bytes (the bound on GetJob's and the bulk actions'
    `name`) made of stars, alone or between others, is matched in far less
    than the seconds one star-run took."""
    for pattern in ("*" * 12_749 + "x", "*?" * 6_375, "*a" * 6_375, "?*" * 6_000 + "[a-z]" * 150):
        started = time.monotonic()
        postgres_glob(postgres, pattern, "a" * 300 + "x")
        assert time.monotonic() - started < 2.0, pattern[:20]


# A pattern's wildcards are bounded where it arrives (protocol.md 3).


def _exact_counts(pattern: str) -> tuple[int, int]:
    """Stars, question marks and sets, and the characters in the sets, read
    one character at a time as SQLite reads a pattern: inside a set, `*`,
    `?` and `[` are plain, a first `]` is one of its characters and a
    negating `^` is not."""
    count, in_sets, i = 0, 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch in "*?":
            count += 1
        elif ch == "[":
            count += 1
            i += 1
            if i < len(pattern) and pattern[i] == "^":
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                in_sets += 1
                i += 1
            while i < len(pattern) and pattern[i] != "]":
                in_sets += 1
                i += 1
        i += 1
    return count, in_sets


@given(pattern=st.text(st.sampled_from("*?[]^ab-"), max_size=120))
@settings(max_examples=400)
@example(pattern="[^]" + "a" * MAX_SET_CHARACTERS)
@example(pattern="[" + "a" * MAX_SET_CHARACTERS + "]")
def test_wildcards_are_counted_as_sqlite_reads_the_pattern(pattern: str) -> None:
    exact, in_sets = _exact_counts(pattern)
    assert (wildcards(pattern), set_characters(pattern)) == (exact, in_sets)
    assert too_many_wildcards(pattern) == (exact > MAX_WILDCARDS)
    assert too_many_set_characters(pattern) == (in_sets > MAX_SET_CHARACTERS)


def test_a_set_of_stars_counts_once() -> None:
    assert wildcards("[*?[]" * 40) == 40 and not too_many_wildcards("[*?[]" * 32)
    assert too_many_wildcards("[*?[]" * 33)
    assert wildcards("job/[*]") == 1
    assert wildcards("plain/name") == 0
