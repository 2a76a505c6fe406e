"""The client's side of the wire protocol (protocol.md 2 and 3): the
requests it sends, their values escaped, and the replies it reads, their
heads bounded. The server's side is framing.py."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobserver.wire.framing import escape, unescape
from jobserver.wire.limits import DEFAULT_CLIENT_MAX_REPLY_BYTES


def encode_request(method: str, params: Mapping[str, object]) -> bytes:
    """A request's bytes: the method line, a `Name: value` line for each
    parameter that is not None, and a blank line (protocol.md 1.2)."""
    if not method or method[0] in " \t" or "\r" in method or "\n" in method:
        raise ValueError(f"not a method line: {method!r}")
    lines = [method]
    for name, value in params.items():
        if value is None:
            continue
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a parameter name: {name!r}")
        lines.append(f"{name}: {encode_value(value)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


_NAME = re.compile(r"[^\s:]+")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """`text` with each lone surrogate (from a JSON escape in a client's
    data, say in an error made of it) as U+FFFD: UTF-8 cannot carry one."""
    if text.isascii() or not _has_lone_surrogate(text):
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def encode_value(value: object) -> str:
    """A parameter value, escaped so that the server's unescaping gives it
    back exactly (protocol.md 1.3). Dicts and lists are sent as compact JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return _escape_text(without_lone_surrogates(value))
    if isinstance(value, (dict, list, tuple)):
        # Compact JSON holds no raw line breaks; escaping doubles its backslashes.
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        if not text.isascii() and _has_lone_surrogate(text):
            # UTF-8 cannot carry one: as JSON's \u escape, which the server
            # keeps as it is (protocol.md 3).
            text = json.dumps(value, separators=(",", ":"), allow_nan=False)
        return escape(text)
    raise TypeError(f"cannot send a {type(value).__name__} as a parameter value")


# The server trims spaces around a value before unescaping it, so spaces
# that belong to the value travel as an escape.
_SPACE = "\\u0020"


def _escape_text(text: str) -> str:
    escaped = escape(text)
    rest = escaped.lstrip(" ")
    core = rest.rstrip(" ")
    return _SPACE * (len(escaped) - len(rest)) + core + _SPACE * (len(rest) - len(core))


@dataclass(frozen=True)
class Reply:
    """One reply as a client reads it. Header names are lower-cased (they
    are case-insensitive) and their values unescaped."""

    status: str
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> int:
        return int(self.status[:3])

    @property
    def closes_connection(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"

    def json(self) -> Any:
        return json.loads(self.body)


# A reply head is a status line and a few short headers; a peer that sends
# a megabyte without ending its head is not a jobserver.
_MAX_REPLY_HEAD = 1024 * 1024


class ReplyReader:
    """Bytes in, replies out, without any IO (protocol.md 2).

    `feed` the bytes as they arrive, `b""` at the end of the stream; `reply`
    returns the next Reply once it is complete. Malformed input raises
    ValueError, and so does a head announcing a body of more than
    `max_body` bytes, before any of it is kept: the reader never holds more
    than that and one read past it.
    """

    def __init__(self, max_body: int = DEFAULT_CLIENT_MAX_REPLY_BYTES) -> None:
        self.max_body = max_body
        self._buffer = bytearray()
        # Status line, headers and body length, once the head is complete.
        self._head: tuple[str, dict[str, str], int] | None = None

    def feed(self, data: bytes | bytearray) -> None:
        if not data:
            raise ValueError("the server closed the connection before its reply was complete")
        self._buffer += data

    def reply(self) -> Reply | None:
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_REPLY_HEAD:
                    raise ValueError("reply head too large: not a jobserver?")
                return None
            self._head = _parse_reply_head(bytes(self._buffer[:end]))
            del self._buffer[: end + 4]
            if self._head[2] > self.max_body:
                raise ValueError(
                    f"reply of {self._head[2]:,} bytes announced, more than the "
                    f"{self.max_body:,} this client reads (max_reply_bytes)"
                )
        status, headers, length = self._head
        if len(self._buffer) < length:
            return None
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._head = None
        return Reply(status, headers, body)

    @property
    def leftover(self) -> int:
        """Bytes received beyond the replies taken out."""
        return len(self._buffer)


_STATUS_LINE = re.compile(r"[0-9]{3} .*")
_DIGITS = re.compile(r"[0-9]+")


def _parse_reply_head(raw: bytes) -> tuple[str, dict[str, str], int]:
    status, *lines = raw.decode("utf-8").split("\r\n")
    if not _STATUS_LINE.fullmatch(status):
        raise ValueError(f"not a status line: {status[:100]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"not a header line: {line[:100]!r}")
        headers[name.strip().lower()] = unescape(value.strip(" "))
    length = headers.get("content-length", "")
    if not _DIGITS.fullmatch(length):
        raise ValueError(f"bad or missing Content-Length: {length[:100]!r}")
    return status, headers, int(length)
