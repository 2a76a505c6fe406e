"""SQLite's GLOB, in Python, to decide which waiting GetJobs a new job wakes.

The database remains the judge of which job a GetJob receives; this only
answers "could this waiter want a job of this name" without a query. It
follows SQLite's matching rules exactly (the tests compare it with SQLite):
`*` any run of characters, `?` one character, `[...]` a set with ranges and
`^` negation, `]` first in a set is literal, no escape character, case
sensitive, and a set that is never closed matches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class _CharSet:
    ranges: tuple[tuple[str, str], ...]
    invert: bool
    closed: bool

    def matches(self, ch: str) -> bool:
        if not self.closed:
            return False
        seen = any(lo <= ch <= hi for lo, hi in self.ranges)
        return seen != self.invert


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


def _token_matches(token: _Token, ch: str) -> bool:
    if isinstance(token, _CharSet):
        return token.matches(ch)
    return token in (_ONE, ch)


def glob_match(pattern: str, text: str) -> bool:
    # SQLite's GLOB reads both as C strings, so a NUL (a job name can hold
    # one through `\u0000`) ends them there.
    tokens = _compile(pattern.partition("\0")[0])
    text = text.partition("\0")[0]
    ti = si = 0
    star_ti = -1
    star_si = 0
    while si < len(text):
        if ti < len(tokens) and tokens[ti] == _STAR:
            star_ti, star_si = ti, si
            ti += 1
        elif ti < len(tokens) and _token_matches(tokens[ti], text[si]):
            ti += 1
            si += 1
        elif star_ti >= 0:
            star_si += 1
            si = star_si
            ti = star_ti + 1
        else:
            return False
    while ti < len(tokens) and tokens[ti] == _STAR:
        ti += 1
    return ti == len(tokens)


def glob_to_regex(pattern: str) -> str:
    """The same pattern as an anchored PostgreSQL regular expression (ARE),
    for backends without GLOB. Every literal character is written as a
    code-point escape, so nothing in a name is read as regex syntax; a
    reversed range matches nothing, as in SQLite, and a set that is never
    closed makes the whole pattern match nothing."""
    parts = ["^"]
    for token in _compile(pattern.partition("\0")[0]):
        if token == _STAR:
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
