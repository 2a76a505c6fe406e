"""SQLite's GLOB, in Python, to decide which waiting GetJobs a new job wakes.

The database remains the judge of which job a GetJob receives; this only
answers "could this waiter want a job of this name" without a query. It
follows SQLite's matching rules exactly (the tests compare it with SQLite):
`*` any run of characters, `?` one character, `[...]` a set with ranges and
`^` negation, `]` first in a set is literal, no escape character, case
sensitive, and a set that is never closed matches nothing.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

# The most wildcards (`*`, `?` and `[...]` sets) a pattern may hold: a real
# job's pattern needs a few (`report/*/2026-*`); each star is one more
# search per name, and each run between stars one more regular expression
# to compile (100 patterns of 2,400 such runs each held the event loop for
# seconds). Checked where a pattern arrives (core/commands/params.py).
MAX_WILDCARDS = 32
# The most GLOB patterns a GetJob's comma list may hold: a waiter's are
# each tried against every new job's name on the event loop.
MAX_PATTERNS = 100
# The most characters a pattern's sets may hold between them (`[a-z]` is
# three): SQLite's GLOB reads a set character by character at every place
# it tries it, so a set after a star costs a name its length times the
# set's. One set of 12,747 characters cost 14 ms a name in a GetJob's
# scan; 64 cost about 60 us, as a star and a name-long literal do. A real
# pattern's sets are a few characters (`[0-9]`, `[ab]`).
MAX_SET_CHARACTERS = 64
# Compiled patterns kept for the next GetJob that waits on one.
_KEPT_MATCHERS = 4096


@dataclass(frozen=True)
class _CharSet:
    ranges: tuple[tuple[str, str], ...]
    invert: bool
    closed: bool


_STAR = "*"
_ONE = "?"
_Token = str | _CharSet


def _parse_set(pattern: str, i: int) -> tuple[_CharSet, int]:
    """Parse the set starting after `[` at index i; return it and the next index."""
    ranges: list[tuple[str, str]] = []
    invert = False
    n = len(pattern)
    if i < n and pattern[i] == "^":
        invert = True
        i += 1
    if i < n and pattern[i] == "]":
        ranges.append(("]", "]"))
        i += 1
    prior: str | None = None
    while i < n and pattern[i] != "]":
        ch = pattern[i]
        if ch == "-" and prior is not None and i + 1 < n and pattern[i + 1] != "]":
            ranges.append((prior, pattern[i + 1]))
            prior = None
            i += 2
            continue
        ranges.append((ch, ch))
        prior = ch
        i += 1
    closed = i < n
    return _CharSet(tuple(ranges), invert, closed), i + 1


@lru_cache(maxsize=4096)
def _compile(pattern: str) -> tuple[_Token, ...]:
    tokens: list[_Token] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "[":
            charset, i = _parse_set(pattern, i + 1)
            tokens.append(charset)
            continue
        # A literal star or question mark cannot be written in GLOB, so the
        # characters themselves can stand for the wildcards.
        tokens.append(ch)
        i += 1
    return tuple(tokens)


# What makes a pattern a GLOB rather than one exact name.
_SPECIALS = frozenset("*?[")


def is_glob(pattern: str) -> bool:
    """Whether a pattern can match more than one name: an exact name is
    looked up in an index, a GLOB is tried against every due job's."""
    # Searched in C: a set's test of each character of a 12 KB name, for
    # thousands of waiter-name pairs, held the event loop for seconds.
    return "*" in pattern or "?" in pattern or "[" in pattern


def literal_start(pattern: str) -> str:
    """What every name a GLOB pattern matches begins with: the pattern up
    to its first wildcard (or NUL, where SQLite's GLOB stops reading)."""
    text = pattern.partition("\0")[0]
    for at, ch in enumerate(text):
        if ch in _SPECIALS:
            return text[:at]
    return text


def after_prefix(prefix: str) -> str | None:
    """The least text above every text that begins with `prefix`, in the
    order of code points (UTF-8's bytes: SQLite's BINARY, PostgreSQL's
    "C"), so that those texts are an index range; None if no text is."""
    while prefix:
        point = ord(prefix[-1]) + 1
        if point == 0xD800:
            point = 0xE000  # no surrogate is a character of a UTF-8 text
        if point <= 0x10FFFF:
            return prefix[:-1] + chr(point)
        prefix = prefix[:-1]
    return None


def listed_names(text: str) -> tuple[str, ...]:
    """The pieces a GetJob's `name` splits into at its commas, each without
    its leading spaces, empty ones dropped (protocol.md 5.3): more than one
    is a list of exact names, else `text` is one GLOB pattern."""
    return tuple(n.lstrip(" ") for n in text.split(",") if n.lstrip(" "))


def too_many_wildcards(pattern: str) -> bool:
    """Whether a pattern holds more than MAX_WILDCARDS stars, question
    marks and sets (inside a set, `*`, `?` and `[` are plain characters)."""
    # Never fewer than the exact count, and counted in C: most patterns
    # are read no further.
    if pattern.count("*") + pattern.count("?") + pattern.count("[") <= MAX_WILDCARDS:
        return False
    return wildcards(pattern) > MAX_WILDCARDS


def too_many_set_characters(pattern: str) -> bool:
    """Whether a pattern's sets hold more than MAX_SET_CHARACTERS between
    them; most patterns hold no set and are read no further."""
    return "[" in pattern and set_characters(pattern) > MAX_SET_CHARACTERS


def set_characters(pattern: str) -> int:
    """How many characters a pattern's sets hold, as SQLite reads them:
    what lies between each `[` and its `]` (a first `]` is one of them, a
    negating `^` is not), and to the end for a set that is never closed."""
    total = 0
    i = 0
    while (opened := pattern.find("[", i)) >= 0:
        charset, i = _parse_set(pattern, opened + 1)
        total += min(i - 1, len(pattern)) - (opened + 1) - charset.invert
    return total


# What a test of one name against a pattern may cost, in units of a plain
# test (about 50 ns): a star makes SQLite's GLOB try what follows at each
# place in the name, so each byte after the first wildcard costs up to a
# name's length (255 bytes) of steps, about 5 units, and so does each
# character of a set. Measured against names that make each pattern
# slowest: `*` and 254 letters 37 us (1,276 units), `*[a]` and 121 letters
# 23 us (631), `*?` and 11 letters 2.8 us (66), `*/email` 2 us (36),
# `email/*` 0.05 us (1). PostgreSQL's regular expression of a pattern
# costs each name in the pattern's length, past a name's: `*` and 12,749
# letters 2 ms (63,746).
MATCH_UNITS_PER_BYTE = 5


def match_cost(pattern: str) -> int:
    """What testing a name against the pattern may cost, in units of a plain
    test: 1, and MATCH_UNITS_PER_BYTE for each byte from its first wildcard
    to its last character that is not a star (trailing stars match at
    once), and for each character of its sets."""
    tested = pattern.partition("\0")[0]  # what a GLOB reads of it
    tail = tested[len(literal_start(tested)) :].rstrip("*")
    return 1 + MATCH_UNITS_PER_BYTE * (len(tail.encode()) + set_characters(tail))


def wildcards(pattern: str) -> int:
    """How many stars, question marks and sets a pattern holds."""
    return sum(1 for token in _compile(pattern) if token in (_STAR, _ONE) or isinstance(
        token, _CharSet
    ))


Matcher = Callable[[str], bool]


def glob_match(pattern: str, text: str) -> bool:
    return matcher(pattern)(text)


def matcher(pattern: str) -> Matcher:
    """The pattern as a function of a name, compiled once: a pattern's runs
    between stars are regular expressions to compile (milliseconds for a
    long one), so a caller on the event loop compiles it first in a thread
    (`compiled` says whether that is needed). One exact name is compared,
    never compiled: a waiting GetJob's may be 12,750 bytes, and compiling
    hundreds of those held the event loop for seconds."""
    if not is_glob(pattern):
        return _exact_name(pattern.partition("\0")[0])
    with _kept_lock:
        found = _kept.get(pattern)
        if found is not None:
            _kept.move_to_end(pattern)
            return found
    made = _nul_ended(_matcher(pattern.partition("\0")[0]))
    with _kept_lock:
        _kept[pattern] = made
        while len(_kept) > _KEPT_MATCHERS:
            _kept.popitem(last=False)
    return made


def compiled(pattern: str) -> Matcher | None:
    """The pattern's matcher if it is compiled already, else None."""
    with _kept_lock:
        return _kept.get(pattern)


_kept: OrderedDict[str, Matcher] = OrderedDict()
_kept_lock = threading.Lock()


def _exact_name(name: str) -> Matcher:
    return lambda text: text.partition("\0")[0] == name


def _nul_ended(match: Matcher) -> Matcher:
    # SQLite's GLOB reads both as C strings, so a NUL (a job name can hold
    # one through `\u0000`) ends them there.
    return lambda text: match(text.partition("\0")[0])


def _matcher(pattern: str) -> Matcher:
    """The pattern as a function of a name.

    A waiting GetJob's pattern is tried against the names of new jobs on
    the event loop, so a hostile pattern must not make that slow. Between
    its stars a pattern is a run of fixed-length pieces, each one
    character; such a run is a regular expression with no repetition,
    which Python's engine searches in C without backtracking into earlier
    runs. And because a star takes any run of characters, matching each
    run at the leftmost place it fits leaves the most room for the rest:
    the first run is anchored at the start, the last at the end, and
    those between are searched for in turn. The cost is one search per
    run, however many stars there are.
    """
    tokens = _compile(pattern)
    if any(isinstance(t, _CharSet) and not t.closed for t in tokens):
        return _never
    runs: list[list[_Token]] = [[]]
    for token in tokens:
        if token == _STAR:
            runs.append([])
        else:
            runs[-1].append(token)
    if len(runs) == 1:
        return _exactly(runs[0])
    return _with_stars(runs[0], [r for r in runs[1:-1] if r], runs[-1])


def _never(text: str) -> bool:
    return False


def _run_regex(run: list[_Token]) -> re.Pattern[str]:
    return re.compile("".join(_token_regex(token) for token in run), re.DOTALL)


def _token_regex(token: _Token) -> str:
    if token == _ONE:
        return "."
    if isinstance(token, _CharSet):
        return _set_to_regex(token)
    return _escape(token)


def _exactly(run: list[_Token]) -> Matcher:
    regex = _run_regex(run)
    return lambda text: len(text) == len(run) and regex.match(text) is not None


def _with_stars(first: list[_Token], middle: list[list[_Token]], last: list[_Token]) -> Matcher:
    head, tail = _run_regex(first), _run_regex(last)
    between = [
        (len(run), None if all(t == _ONE for t in run) else _run_regex(run)) for run in middle
    ]
    fixed = len(first) + len(last)

    def matches(text: str) -> bool:
        end = len(text) - len(last)
        if len(text) < fixed or head.match(text) is None or tail.match(text, end) is None:
            return False
        at = len(first)
        for size, regex in between:
            if regex is None:
                # Only `?`s: any `size` characters fit where the last run ended.
                at += size
                if at > end:
                    return False
                continue
            found = regex.search(text, at, end)
            if found is None:
                return False
            at = found.end()
        return True

    return matches


def glob_to_regex(pattern: str) -> str:
    """The same pattern as an anchored PostgreSQL regular expression (ARE),
    for backends without GLOB. Every literal character is written as a
    code-point escape, so nothing in a name is read as regex syntax; a
    reversed range matches nothing, as in SQLite, and a set that is never
    closed makes the whole pattern match nothing."""
    parts = ["^"]
    for token in _compile(pattern.partition("\0")[0]):
        if token == _STAR:
            # A run of stars is one: PostgreSQL takes seconds to compile
            # hundreds of `.*` in a row (17 s for 800), holding the writer.
            if parts[-1] != ".*":
                parts.append(".*")
        elif token == _ONE:
            parts.append(".")
        elif isinstance(token, _CharSet):
            parts.append(_set_to_regex(token))
        else:
            parts.append(_escape(token))
    parts.append("$")
    return "".join(parts)


# A regex that matches nothing: a lookahead that always fails.
_NOTHING = "(?!)"


def _set_to_regex(charset: _CharSet) -> str:
    if not charset.closed:
        return _NOTHING
    ranges = [(lo, hi) for lo, hi in charset.ranges if lo <= hi]
    if not ranges:
        # Nothing in the set: it matches no character, or, inverted, any.
        return "." if charset.invert else _NOTHING
    body = "".join(
        _escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}" for lo, hi in ranges
    )
    return f"[{'^' if charset.invert else ''}{body}]"


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
