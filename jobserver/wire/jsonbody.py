"""Compact JSON bodies, built without re-encoding stored JSON.

Job data is stored as validated, compact JSON text; a reply embeds it as it
is (`Raw`) instead of parsing and dumping it again. Object keys come out in
case-insensitive order, as Bedrock's replies do, so replies are stable
byte for byte.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
from _json import make_encoder
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring as _quote
from json.encoder import encode_basestring_ascii
from typing import Any

from jobserver.wire.limits import MAX_JSON_DEPTH
from jobserver.wire.raw import Raw

# A str as a JSON string, quotes and escapes included (json's own, in C).
quote = _quote


def encode(value: Any) -> bytes:
    return _encode(value).encode("utf-8")


def _encode(value: Any) -> str:
    # Replies are built for every hand-out: the common types are written
    # directly instead of going through json.dumps for each value, and an
    # object's values of those types without a call each (a GetJobs of 100
    # made 40 Python calls a job here).
    kind = type(value)
    if kind is str:
        return _quote(value)
    if kind is Raw:
        return value
    if kind is dict:
        return _object(value)
    if kind is list or kind is tuple:
        return "[" + ",".join([_encode(v) for v in value]) + "]"
    return _encode_other(value)


# Object keys as they are written, `"key":`: replies use a few dozen names.
# Bounded in count and in length, since a key may come from a client's text
# (a queue's name): at most 1,024 keys of 64 characters are kept.
_KEYS: dict[str, str] = {}
_MAX_KEYS = 1024
_MAX_KEPT_KEY = 64


def _object(value: dict[str, Any]) -> str:
    parts = []
    # str.lower as the key is C; sorted is stable, so keys that differ only
    # in case keep their order, as they did.
    for key in sorted(value, key=str.lower):
        head = _KEYS.get(key)
        if head is None:
            head = _quote(key) + ":"
            if len(_KEYS) < _MAX_KEYS and type(key) is str and len(key) <= _MAX_KEPT_KEY:
                _KEYS[key] = head
        item = value[key]
        kind = type(item)
        if kind is str:
            text = _quote(item)
        elif kind is Raw:
            text = item
        elif kind is int:
            text = str(item)
        else:
            text = _encode(item)
        parts.append(head + text)
    return "{" + ",".join(parts) + "}"


def _encode_other(value: Any) -> str:
    """Everything but a plain str, Raw, dict, list or tuple: subclasses
    (a StrEnum, an IntEnum) keep the meaning isinstance gave them."""
    if isinstance(value, str):
        return value if isinstance(value, Raw) else _quote(value)
    if isinstance(value, bool) or value is None:
        return "null" if value is None else ("true" if value else "false")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return _object(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join([_encode(v) for v in value]) + "]"
    return json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


class TooDeep(ValueError):
    """JSON text nested deeper than MAX_JSON_DEPTH."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


# A JSON string, escapes included, or an unterminated one to the end of the
# text (possessive, and never failing once it starts: a string that may
# fail is tried again from every later quote, and 80 KB of `\\"` after a
# quote took 32 s).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# A string of a text with no backslash: up to the next quote, or the end.
_UNESCAPED_STRING = re.compile(r'"[^"]*+(?:"|\Z)')
# Brackets alone, as one kind of each (`[` opens, `]` closes): what depth
# is made of. Bytes, so that translate works through a table in C.
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
# Built with chr: mypyc compiles no surrogate in a literal (setup.py).
_LONE_SURROGATE = re.compile(f"[{chr(0xD800)}-{chr(0xDFFF)}]")


def _nesting(depth: int) -> re.Pattern[bytes]:
    """Brackets nested at most `depth` deep from where the match starts, a
    group left open at the end included: each level one possessive group
    in the one below it, so matching is linear and never backtracks. It
    stops before a bracket that opens level depth + 1, or one that closes
    below the start."""
    pattern = b""
    for _ in range(depth):
        pattern = rb"(?:\[" + pattern + rb"(?:\]|\Z))*+"
    return re.compile(pattern)


_WITHIN_DEPTH = _nesting(MAX_JSON_DEPTH)


def check_depth(text: str) -> None:
    """Raise TooDeep if `text` nests arrays and objects deeper than
    MAX_JSON_DEPTH, counting brackets outside strings: done before parsing,
    so that no parser recursion ever sees deep input. Every step is one
    C call, linear in the text (58 ms for 300,000 `[]` as a Python loop
    over the brackets, 3 ms so). A text that closes more than it opened
    is counted no further: the parser refuses it there, before any
    deeper part."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return  # too few brackets to be that deep: the common case
    # Without an escape every string runs from a quote to the next, which
    # a simpler expression finds in under half the time (a CreateJobs of
    # 1,000 jobs, 124 KB: 0.58 ms against 1.35). Not a split at the
    # quotes (0.29 ms): its pieces took 30 MB for a 2 MB body of short
    # strings, the expression's result 7.
    strings = _STRING if "\\" in text else _UNESCAPED_STRING
    outside = strings.sub("", text)
    brackets = outside.encode("utf-8", "surrogatepass").translate(_AS_BRACKETS, _NOT_BRACKETS)
    within = _WITHIN_DEPTH.match(brackets)  # it matches at least nothing
    end = within.end() if within else 0
    if brackets[end : end + 1] == b"[":
        raise TooDeep()


def has_lone_surrogate(text: str) -> bool:
    """Whether `text` holds a surrogate code point (from a JSON escape such
    as `\\ud800` that is not half of a pair): it has no UTF-8 form, so it
    can be neither stored nor sent as a name, a key or a header."""
    return _LONE_SURROGATE.search(text) is not None


# One decoder for every parse: json.loads with options builds a new one
# (and its scanner) on each call, which cost more than parsing a job's data.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def parse(text: str, *, stored: bool = False) -> Any:
    """Strict JSON: no NaN or Infinity (written, or reached by overflowing
    a number like 1e400), which could never be written back as JSON, and
    nested at most MAX_JSON_DEPTH deep (TooDeep, a ValueError).

    `stored`: text the database holds (a job's data), parsed whatever its
    depth: it was checked when it came in, but may since have grown a level
    (a reply put in a job's data), or have come from elsewhere (SQL on
    PostgreSQL, an older version). Too deep for the parser is a ValueError."""
    if not stored:
        check_depth(text)
    try:
        return _DECODER.decode(text)
    except RecursionError as error:
        raise ValueError("JSON nested too deeply") from error


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off, for parsing a large text
    in a thread. 300,000 new arrays made the parse run three full
    collections of the process's objects, 20 to 35 ms each, inside the one
    C call that parses, which holds the GIL, and so the event loop, for
    all of them. Threads that parse this way take turns (a limiter)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def parse_object(text: str, *, stored: bool = False) -> dict[str, Any]:
    """Parse a JSON object; raises ValueError for anything else."""
    value = parse(text, stored=stored)
    if not isinstance(value, dict):
        # The text is malformed, not the argument's type: callers catch ValueError.
        raise ValueError("not a JSON object")
    return value


def compact(value: Any) -> str:
    """Compact JSON text of a parsed value, keeping the caller's key order.

    Non-ASCII text stays as it is unless it holds a lone surrogate (from a
    `\\ud800` escape), which has no UTF-8 form and so stays escaped.
    """
    text = "".join(_COMPACT(value, 0))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = "".join(_COMPACT_ASCII(value, 0))
    return text


def _compact_encoder(quote_text: Callable[[str], str]) -> make_encoder:
    """json's encoder in C, made once: JSONEncoder.encode makes one for
    every call (1.7 µs a CreateJobs element's data, 0.65 made once). No
    check for cycles: a parsed value has none, and its depth is bounded."""
    default = json.JSONEncoder().default
    return make_encoder(None, default, quote_text, None, ":", ",", False, False, True)


_COMPACT = _compact_encoder(_quote)
_COMPACT_ASCII = _compact_encoder(encode_basestring_ascii)
