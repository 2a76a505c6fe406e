"""A brief fuzz of the request parser, in memory and over a real socket.

RequestParser.feed must never raise, whatever the bytes: it returns
requests, or sets `error` to a 4xx framing error and then stays silent.
Over a socket, garbage gets 4xx replies (or replies to whatever commands it
happened to spell) and a closed connection, never a 5xx, and the server
goes on answering other connections. test_protocol.py has the properties
of valid streams (any split parses alike); this file throws junk.
"""

from __future__ import annotations

import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ThreadServer
from jobserver.wire.framing import (
    ProtocolError,
    Request,
    RequestParser,
    escape,
)
from jobserver.wire.limits import MAX_HEADERS

FRAMING_ERRORS = {
    "400 Malformed Content-Length",
    "413 Body too large",
    "413 Request too large",
    "414 Line too long",
    "431 Too many headers",
}

VERBS = ["CreateJob", "GetJob", "GetJobs", "QueryJob", "FinishJob", "Ping", "Status", "Bogus"]
HEADER_NAMES = ["name", "data", "jobID", "Content-Length", "Connection", "timeout", "priority", "x"]


@st.composite
def valid_requests(draw: st.DrawFn) -> bytes:
    """A few well-formed requests, as a client would send them."""
    stream = b""
    for _ in range(draw(st.integers(1, 3))):
        eol = draw(st.sampled_from([b"\n", b"\r\n"]))
        lines = [draw(st.sampled_from(VERBS)).encode()]
        body = b""
        for _ in range(draw(st.integers(0, 4))):
            name = draw(st.sampled_from(HEADER_NAMES))
            if name == "Content-Length":
                body = draw(st.binary(max_size=30))
                value = str(len(body))
            else:
                value = escape(draw(st.text(max_size=20)))
            lines.append(f"{name}: {value}".encode())
        stream += eol.join(lines) + eol + eol + body
    return stream


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid stream with bytes inserted, deleted, replaced or duplicated."""
    data = bytearray(draw(valid_requests()))
    interesting = [b"\r", b"\n", b"\n\n", b":", b" ", b"\t", b"\\", b"\xff", b"\x00", b"9" * 13,
                   b"Content-Length: ", b"\\u", b"\xc3", b"-1"]
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["insert", "delete", "replace", "repeat"]))
        if action == "insert":
            data[at:at] = draw(st.sampled_from(interesting) | st.binary(min_size=1, max_size=4))
        elif action == "delete" and data:
            data[at : at + draw(st.integers(1, 8))] = b""
        elif action == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "repeat":
            data[at:at] = bytes(data[max(0, at - 16) : at]) * draw(st.integers(1, 3))
    return bytes(data)


def feed_in_pieces(stream: bytes, cuts: list[int]) -> tuple[list[Request], RequestParser]:
    parser = RequestParser()
    requests: list[Request] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got = parser.feed(stream[start:end])
        assert isinstance(got, list)
        requests += got
    return requests, parser


def check_parse(stream: bytes, cuts: list[int]) -> None:
    requests, parser = feed_in_pieces(stream, sorted(cuts))
    for request in requests:
        assert isinstance(request, Request)
        assert isinstance(request.method_line, str) and isinstance(request.body, bytes)
        assert request.method_line == request.method_line.strip(" \t")
        assert all(name == name.lower() for name in request.headers)
        assert all("\n" not in name for name in request.headers)
        assert len(request.headers) <= MAX_HEADERS
        if request.invalid_utf8:
            assert request.method_line == "" and request.headers == {}
        else:
            assert not request.verb.startswith(("\r", "\n"))
    if parser.error is not None:
        assert isinstance(parser.error, ProtocolError)
        assert parser.error.status in FRAMING_ERRORS
        # A broken stream stays broken: nothing more comes out of it.
        assert parser.feed(b"Ping\r\n\r\n") == []
    # Every request had a head ended by an empty line; a stream of n bytes
    # cannot hold more than n/2 of them.
    assert len(requests) <= len(stream) // 2 + 1


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(stream=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=5))
def test_arbitrary_bytes_never_make_the_parser_raise(stream: bytes, cuts: list[int]) -> None:
    check_parse(stream, [min(cut, len(stream)) for cut in cuts])


@FUZZ
@given(stream=mutated(), cuts=st.lists(st.integers(0, 400), max_size=5))
def test_mutated_requests_never_make_the_parser_raise(stream: bytes, cuts: list[int]) -> None:
    check_parse(stream, [min(cut, len(stream)) for cut in cuts])


@settings(max_examples=30, deadline=None)
@given(
    line=st.integers(0, 3 * 1024 * 1024),
    headers=st.integers(0, 150),
    length=st.sampled_from(
        [b"", b"0", b"1048576", b"1048577", b"999999999999", b"1" * 13, b"x", b"-0"]
    ),
)
def test_near_the_limits_the_parser_raises_nothing(line: int, headers: int, length: bytes) -> None:
    head = b"CreateJob\n" + b"data: " + b"a" * line + b"\n" + b"h: v\n" * headers
    if length:
        head += b"Content-Length: " + length + b"\n"
    check_parse(head + b"\n" + b"b" * 100, [len(head) // 2, len(head)])


# End to end: garbage down a real socket.

_STATUS = re.compile(rb"([0-9]{3}) [^\r\n]*\r\n")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    running = ThreadServer(tmp_path_factory.mktemp("fuzz") / "jobs.db")
    yield running
    running.stop()


def send_garbage(port: int, garbage: bytes) -> bytes:
    """Send, half-close, and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close first, after a framing error
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return received


def status_lines(received: bytes) -> list[str]:
    """The status lines of the replies in a stream of replies."""
    lines = []
    position = 0
    while position < len(received):
        match = _STATUS.match(received, position)
        assert match, f"not a status line at {position}: {received[position:position + 80]!r}"
        lines.append(match.group(0).decode("utf-8").rstrip("\r\n"))
        end = received.index(b"\r\n\r\n", position) + 4
        length = re.search(rb"Content-Length: ([0-9]+)\r\n\r\n", received[position:end])
        assert length, received[position:end]
        position = end + int(length.group(1))
    return lines


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.one_of(st.binary(min_size=1, max_size=2000), mutated()))
def test_garbage_on_one_connection_never_hurts_the_server(fuzz_server, garbage: bytes) -> None:
    received = send_garbage(fuzz_server.port, garbage)
    for status in status_lines(received):
        # Garbage is a 4xx; whatever commands it happened to spell are
        # answered as commands; nothing is a server error, except what Query
        # says of SQL it was given (protocol.md 5.15).
        query_error = status == "555 Timeout"
        assert 200 <= int(status[:3]) < 500 or (query_error and b"query" in garbage.lower()), (
            status, garbage,
        )
    with fuzz_server.client(timeout=5) as other:
        assert other.request("Ping").status == "200 OK"
