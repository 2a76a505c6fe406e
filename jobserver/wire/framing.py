"""The wire protocol, without any IO.

The server's side: bytes go in through `RequestParser.feed`, requests come
out; a `Response` turns into bytes with `encode_response`. The client's
side: `encode_request` turns a command into bytes, and `ReplyReader` turns
bytes into `Reply` objects. Nothing here knows about sockets, so the same
code serves the server, both clients and tests that feed it byte strings.

A request is a method line, `Name: value` header lines, a blank line and an
optional body of `Content-Length` bytes. Lines may end in `\\r\\n` or `\\n`
(netcat sends bare newlines). Responses use a bare status line such as
`200 OK`, headers in case-insensitive name order, `Content-Length` always
last, a blank line and the body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobserver.wire.limits import (
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_LINE,
)

# Runs of what cannot stand in a status line: control characters and other
# unprintable ones (line and paragraph separators included).
_ONE_LINE = re.compile(r"[^\S ]+|[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
# A request line of HTTP's own methods. A browser can send HTTP to any
# port on this machine (a web page's form or fetch included), with a body
# the page chose; such a request is never a command, and its body must
# never be read as one. Bedrock's clients write `CreateJob / HTTP/1.1`, so
# only methods that name no command are refused; a page cannot send any
# other method without a preflight (OPTIONS), which is refused too.
# PRI is HTTP/2's preface.
_HTTP_REQUEST_LINE = re.compile(
    rb"(GET|HEAD|POST|PUT|DELETE|PATCH|OPTIONS|CONNECT|TRACE|PRI) \S+ HTTP/\d(\.\d)?",
    re.IGNORECASE,
)
NOT_HTTP = "400 This port speaks the jobserver protocol, not HTTP (see --http-port)"

# What a TLS port answers, in plain text, to a client that does not speak
# TLS: `nc` shows it, and the client library turns it into advice.
TLS_REQUIRED = "400 This port requires TLS"
# What a plain-text port answers to a TLS handshake: not TLS, so the
# client's TLS layer says plainly that the server does not speak it,
# rather than seeing the connection simply end (which a restart also does).
TLS_NOT_SPOKEN = "400 This port does not speak TLS"


class ProtocolError(Exception):
    """The peer broke the framing; the connection cannot stay in step.

    `status` is the full status line to answer with before closing.
    """

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class NotHttp(ProtocolError):
    """An HTTP request on the wire port: answered in HTTP's own form (so a
    browser or curl shows why), nothing of the request read past its head,
    then closed. `head_only` for a HEAD request, whose answer has no body."""

    def __init__(self, head_only: bool) -> None:
        super().__init__(NOT_HTTP)
        self.head_only = head_only


@dataclass
class Request:
    """One parsed request. Header names are stored lower-cased."""

    method_line: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    # Set when the request was framed correctly but its text was not valid
    # UTF-8: the stream is still in step, so the connection can go on.
    invalid_utf8: bool = False
    # JSON parameters as parsed, by header name: the text parsed, and its
    # value or the ValueError it raised (core/commands/json_params.json_value).
    # A value of 900 KB takes tens of milliseconds to parse: it is parsed
    # once, by whoever reads it first.
    parsed: dict[str, tuple[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def verb(self) -> str:
        """The method line up to its first space: `CreateJob / HTTP/1.1` is `CreateJob`."""
        return self.method_line.split(" ", 1)[0]

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def has(self, name: str) -> bool:
        return name.lower() in self.headers

    @property
    def wants_close(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


@dataclass
class Response:
    status: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A status line is one line, on either port: text from elsewhere in
        # it (a database's error, with its DETAIL on a line of its own)
        # must not become headers of the reply.
        if not self.status.isprintable():
            self.status = _ONE_LINE.sub(" ", self.status)

    @property
    def code(self) -> int:
        return int(self.status.split(" ", 1)[0])


def unescape(value: str) -> str:
    """Undo the backslash escaping clients apply to header values.

    `\\n`, `\\r`, `\\t`, `\\b`, `\\f` become control characters, `\\uXXXX` the
    code point (U+FFFD for a lone surrogate), a backslash before anything
    else yields that character, and a trailing lone backslash is kept. So
    JSON sent in a header has its own backslashes doubled by the client.
    """
    if "\\" not in value:
        return value
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        ch = value[i]
        if ch != "\\" or i + 1 == n:
            out.append(ch)
            i += 1
            continue
        nxt = value[i + 1]
        if nxt in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[nxt])
            i += 2
        elif nxt == "u" and _is_hex4(value, i + 2):
            out.append(_code_point(int(value[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(nxt)
            i += 2
    return "".join(out)


_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _code_point(number: int) -> str:
    # A lone surrogate has no UTF-8 form; it could never be stored or sent.
    return "\ufffd" if 0xD800 <= number <= 0xDFFF else chr(number)


def _is_hex4(value: str, start: int) -> bool:
    chunk = value[start : start + 4]
    return len(chunk) == 4 and all(c in _HEX for c in chunk)


def escape(value: str) -> str:
    """Escape a header value so that it stays on one line."""
    escaped = value.replace("\\", "\\\\").replace("\r", "\\r")
    return escaped.replace("\n", "\\n").replace("\t", "\\t")


class RequestParser:
    """Turns a byte stream into requests.

    `feed` accepts any slicing of the stream and returns every request that
    is now complete, in order. When the stream breaks the framing, the
    requests before the break are still returned and `error` is set: the
    connection answers them, then the error, then closes.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._head: Request | None = None
        self._body_length = 0
        self._scanned = self._blank_from = 0
        self.error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete request."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray) -> list[Request]:
        if self.error is not None:
            return []
        self._buffer += data
        requests: list[Request] = []
        try:
            while (request := self._next_request()) is not None:
                requests.append(request)
        except ProtocolError as error:
            # The requests before the break are still answered.
            self.error = error
            self._buffer.clear()
        return requests

    def _next_request(self) -> Request | None:
        """The next complete request, or None until more bytes arrive."""
        if self._head is None:
            if not self._buffer:  # most reads end with a whole request
                return None
            self._head = self._take_head()
            if self._head is None:
                return None
        if len(self._buffer) < self._body_length:
            return None
        request = self._head
        request.body = bytes(self._buffer[: self._body_length])
        del self._buffer[: self._body_length]
        self._head = None
        self._body_length = 0
        return request

    def _take_head(self) -> Request | None:
        self._skip_leading_blank_lines()
        end, sep_len = self._find_head_end()
        if end < 0:
            self._check_partial_head()
            return None
        if end > MAX_HEAD:
            raise ProtocolError("413 Request too large")
        raw = bytes(self._buffer[:end])
        del self._buffer[: end + sep_len]
        self._scanned = self._blank_from = 0
        request, length = _parse_head(raw)
        self._body_length = length
        return request

    def _skip_leading_blank_lines(self) -> None:
        # Stray newlines between requests (a habit of hand-typed sessions)
        # are not requests.
        i = 0
        while i < len(self._buffer) and self._buffer[i] in (0x0A, 0x0D):
            i += 1
        if i:
            del self._buffer[:i]
            self._scanned = self._blank_from = 0

    def _find_head_end(self) -> tuple[int, int]:
        start = self._resume_at()
        found = _HEAD_END.search(self._buffer, start)
        if found is None:
            self._note_scanned()
            return -1, 0
        begin = found.start()
        if begin > start and self._buffer[begin - 1] == 0x0D:
            begin -= 1  # the CR of the line break that ends the last header
        return begin, found.end() - begin

    def _resume_at(self) -> int:
        """Where the search for the head's end resumes. The bytes already
        scanned hold no separator, so one can only begin where they may
        still become its start: at a line break that only blanks follow
        (less one, for its CR), else at a final CR. Rescanning from the
        last line break whatever follows it would go over a long line (a
        megabyte of data) again at every read, which made such a request
        cost time quadratic in its size."""
        blank_from = self._blank_from
        if blank_from > 0 and self._buffer[blank_from - 1] == 0x0A:
            return max(0, blank_from - 2)
        return max(0, self._scanned - 1)

    def _note_scanned(self) -> None:
        """Moves past the bytes just searched, keeping where the run of
        blanks and CRs at their end begins (copying only the new bytes)."""
        new = bytes(self._buffer[self._scanned :]).rstrip(b" \t\r")
        if new:
            self._blank_from = self._scanned + len(new)
        self._scanned = len(self._buffer)

    def _check_partial_head(self) -> None:
        # Trailing CR/LF bytes may be the start of the blank line (at most
        # three: `\r\n\r`), and a trailing CR the end of the line, so they do
        # not count yet: where the stream is split must not decide whether a
        # request that fits the limits exactly is accepted.
        size = len(self._buffer)
        tail = 0
        while tail < min(3, size) and self._buffer[size - 1 - tail] in (0x0A, 0x0D):
            tail += 1
        if size - tail > MAX_HEAD:
            self._refuse_http_head()
            raise ProtocolError("413 Request too large")
        line_end = size - 1 if self._buffer.endswith(b"\r") else size
        if line_end - (self._buffer.rfind(b"\n") + 1) > MAX_LINE:
            self._refuse_http_head()
            raise ProtocolError("414 Line too long")

    def _refuse_http_head(self) -> None:
        """An HTTP head past the wire's bounds is told it is HTTP first."""
        first_line_end = self._buffer.find(b"\n", 0, MAX_LINE + 2)
        if first_line_end > 0:
            _refuse_http(bytes(self._buffer[:first_line_end]))


# A line of nothing but spaces or tabs ends the head too: text pasted into
# a terminal often carries trailing blanks, and such a line could only be
# an empty continuation otherwise. Its CR is found after its line feed:
# leading with `\r?` made the regex engine try every byte of the head.
_HEAD_END = re.compile(rb"\n[ \t]*\r?\n")


def _parse_head(raw: bytes) -> tuple[Request, int]:
    lines = raw.replace(b"\r\n", b"\n").split(b"\n")  # split at \r?\n, at C speed
    # Before the head's bounds: a browser's head (its cookies) may pass
    # them, and it must still be told in HTTP.
    _refuse_http(lines[0])
    _refuse_browser(lines[1:])
    if len(lines) - 1 > MAX_HEADERS:
        raise ProtocolError("431 Too many headers")
    if max(map(len, lines)) > MAX_LINE:
        raise ProtocolError("414 Line too long")
    length = _content_length(lines[1:])
    try:
        text = [line.decode("utf-8") for line in lines]
    except UnicodeDecodeError:
        return Request(method_line="", invalid_utf8=True), length
    return _build_request(text), length


_HTTP_METHOD = re.compile(rb"(GET|HEAD|POST|PUT|DELETE|PATCH|OPTIONS|CONNECT|TRACE|PRI) ",
                          re.IGNORECASE)


def starts_like_http(start: bytes) -> bool | None:
    """Whether bytes that cannot be a command (plain text on a TLS port)
    begin an HTTP request: None if not, else whether it is a HEAD."""
    found = _HTTP_METHOD.match(start)
    return None if found is None else found[1].upper() == b"HEAD"


def _refuse_http(first_line: bytes) -> None:
    """Raises NotHttp if the request line is HTTP's. Closing at the head,
    before the body, keeps a page's chosen bytes unread."""
    found = _HTTP_REQUEST_LINE.fullmatch(first_line.strip(b" \t\r"))
    if found is not None:
        raise NotHttp(head_only=found[1].upper() == b"HEAD")


def _refuse_browser(lines: list[bytes]) -> None:
    """Raises NotHttp if the head carries `Origin`. A page whose DNS name
    rebinds to this machine is same-origin with the wire port, so its
    fetch may use any method without a preflight: `CreateJob / HTTP/1.1`
    with headers the page chose is a command. A browser adds `Origin` to
    every request whose method is neither GET nor HEAD (the page cannot
    leave it out); no wire client sends it."""
    for line in lines:
        name, sep, _ = line.partition(b":")
        if sep and line[:1] not in (b" ", b"\t") and name.strip(b" \t").lower() == b"origin":
            raise NotHttp(head_only=False)


def _content_length(lines: list[bytes]) -> int:
    """Find Content-Length before decoding, so framing never depends on text."""
    value: bytes | None = None
    for line in lines:
        # Same rules as _build_request: a continuation line is part of the
        # previous value, so it must not frame a body the headers never show.
        if line[:1] in (b" ", b"\t"):
            continue
        name, sep, rest = line.partition(b":")
        if sep and name.strip(b" \t").lower() == b"content-length":
            value = rest.strip(b" \t")
    if value is None:
        return 0
    if not value.isdigit() or len(value) > 12:
        raise ProtocolError("400 Malformed Content-Length")
    length = int(value)
    if length > MAX_BODY:
        raise ProtocolError("413 Body too large")
    return length


def _build_request(lines: list[str]) -> Request:
    method_line = lines[0]
    raw: dict[str, str] = {}
    last: str | None = None
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            # A continuation line extends the previous value, as in Bedrock.
            if last is None:
                method_line += line
            else:
                raw[last] += line
            continue
        name, _, value = line.partition(":")
        last = name.strip(" \t").lower()
        raw[last] = value
    # Unescaped once the value is whole, so a backslash means the same on
    # a continuation line as on the first.
    headers = {name: unescape(value.strip(" ")) for name, value in raw.items()}
    # A stray CR of a blank line (" \r" before it) is not part of the verb.
    return Request(method_line=method_line.strip(" \t\r"), headers=headers)


def encode_response(response: Response, close: bool = False) -> bytes:
    """Serialize a response: status, sorted headers, Content-Length last, body."""
    headers: Mapping[str, str] = response.headers
    if close:
        headers = {**headers, "Connection": "close"}
    parts = [response.status, "\r\n"]
    for name in sorted(headers, key=str.lower):
        if name.lower() == "content-length":
            continue
        parts += [name, ": ", escape(headers[name]), "\r\n"]
    parts += ["Content-Length: ", str(len(response.body)), "\r\n\r\n"]
    return "".join(parts).encode("utf-8") + response.body


# The client's side: requests out, replies in.
