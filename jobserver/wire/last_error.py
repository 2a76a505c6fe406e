"""A job's last error (`lastError`), as lines for a person to read.

The worker manager records a failed worker as compact JSON,
`{"exitStatus":1,"stderr":"..."}` or `{"signal":"SIGSEGV","stderr":"..."}`;
other clients send free text, or JSON of any shape. `describe` turns any of
them into a short head (the exit status or signal, then any other keys)
and the output (stderr, or the free text), one line per line.

An error is whatever a client sent: every character that is not printable
is shown escaped (`\\x1b`), so that an error cannot move a terminal's
cursor or forge lines, and every line is cut at MAX_WIDTH characters.
Escaping for HTML is the templates' business. The raw text stays the
source of truth: `jobserver failed --json` and the dashboard show it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A line longer than this (a minified blob) is cut: the rest says nothing more.
MAX_WIDTH = 1000
# Keys of the worker manager's errors, shown first in this order and in words.
EXIT_STATUS, SIGNAL, STDERR = "exitStatus", "signal", "stderr"


@dataclass(frozen=True)
class Description:
    """A last error in lines: `head` says how the job ended, `output` is
    what it printed (or the whole text of a free-text error)."""

    head: list[str]
    output: list[str]

    def lines(self, tail: int | None = None) -> list[str]:
        """The head, then the output: all of it, or its last `tail` lines
        (where what went wrong is said) after a line counting the rest."""
        output = self.output
        if tail is not None and len(output) > tail:
            left_out = len(output) - tail
            marker = f"... {left_out} earlier line{'s' if left_out > 1 else ''}"
            output = [marker, *output[-tail:]]
        return self.head + output


def describe(text: str) -> Description:
    value = _json(text)
    if isinstance(value, dict):
        return _fields(value)
    if isinstance(value, str):
        return Description([], _lines(value))
    return Description([], _lines(text))


def _json(text: str) -> Any:
    if not text.lstrip().startswith(("{", '"')):
        return None  # free text: not parsed at all
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _fields(error: dict[str, Any]) -> Description:
    head: list[str] = []
    if EXIT_STATUS in error:
        head.append(_line(f"exit status {_value(error[EXIT_STATUS])}"))
    if SIGNAL in error:
        head.append(_line(f"killed by signal {_value(error[SIGNAL])}"))
    output: list[str] = []
    for key, value in error.items():
        if key in (EXIT_STATUS, SIGNAL, STDERR):
            continue
        if isinstance(value, str) and "\n" in value.rstrip("\n"):
            head.append(f"{_line(key)}:")
            head += ["  " + line for line in _lines(value)]
        else:
            head.append(_line(f"{key}: {_value(value)}"))
    stderr = error.get(STDERR)
    if isinstance(stderr, str):
        output = _lines(stderr)
    elif stderr is not None:
        head.append(_line(f"{STDERR}: {_value(stderr)}"))
    return Description(head, output)


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _lines(text: str) -> list[str]:
    return [_line(line) for line in text.rstrip("\n").split("\n")] if text.strip() else []


def _line(text: str) -> str:
    shown = printable(text.rstrip("\r"))
    return shown if len(shown) <= MAX_WIDTH else shown[: MAX_WIDTH - 3] + "..."


def printable(text: str) -> str:
    """`text` with every character that is not printable escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
