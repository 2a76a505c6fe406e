"""HTTP's own status codes for the wire's replies (web/statuses.py): every
status line the server can send has one, with a reason phrase, and a real
server answers /api/* and POST /queue with them, the wire's line kept in
the `Jobserver-Status` header and the body."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

from harness import ThreadServer
from helpers import until
from jobserver.web import statuses

TIMEOUT = 10.0
SOURCE = Path(__file__).resolve().parent.parent / "jobserver"
# A string literal that begins with a status code: a status line, its
# placeholders (f-strings) to be read as one word.
STATUS_LITERAL = re.compile(r"""f?["']([1-5][0-9][0-9] [^"']*)""")
# Lines of the HTTP side's own, not wire replies.
NOT_WIRE = ("421 Misdirected Request", "200 when the database answers")


def status_lines_in_the_code() -> set[str]:
    found = set()
    for path in SOURCE.rglob("*.py"):
        for literal in STATUS_LITERAL.findall(path.read_text()):
            line = re.sub(r"\{[^}]*\}", "x", literal).split("\\n")[0]
            if not line.startswith(NOT_WIRE):
                found.add(line)
    return found


def test_the_code_sends_many_status_lines() -> None:
    # The reading of the code finds what it must (a guard on the regex).
    lines = status_lines_in_the_code()
    assert len(lines) > 80
    assert {"430 Unrecognized command", "402 Malformed maxAttempts", "555 Timeout"} <= lines


@pytest.mark.parametrize("line", sorted(status_lines_in_the_code()))
def test_every_status_line_has_an_http_status_with_a_reason(line: str) -> None:
    code = int(line.split(" ", 1)[0])
    assert code in statuses.BY_CODE, f"{line!r}: its code is not in the table"
    status = statuses.http_status(line)
    assert isinstance(status, HTTPStatus) and status.phrase
    # 2xx stays 2xx; a refusal is never answered as a success, nor a
    # client's mistake as the server's.
    assert (status < 300) == (code < 300), line
    if status >= 500:
        assert code >= 500, line


@pytest.mark.parametrize(
    "line,expected",
    [
        ("200 OK", 200),
        ("202 Reply kept", 202),
        ("402 Malformed maxAttempts", 400),
        ("402 Missing name", 400),
        ("401 Invalid JSON: Expecting value", 400),
        ("401 Unauthorized", 401),
        ("402 Name too large (255 bytes at most)", 400),
        ("402 Data too large (1048576 bytes at most)", 413),
        ("402 Too many CRON rules (64 distinct rules and time zones a request at most)", 413),
        ("402 Cost 5 exceeds limit x (max 2)", 409),
        ("404 No job with this jobID", 404),
        ("404 No job found", 404),
        ("404 Invalid jobID - Cannot cancel a job with children", 409),
        ("404 Reply already delivered", 409),
        ("405 Can only retry/finish RUNNING and RUNQUEUED jobs", 409),
        ("409 Lease expired", 409),
        ("410 Job cancelled", 410),
        ("413 Too many jobIDs (max 1000)", 413),
        ("413 Too many limits (max 1000)", 409),
        ("430 Unrecognized command", 404),
        ("500 Unhandled Exception: KeyError", 500),
        ("501 Backup is off: the server has no backup directory", 501),
        ("502 Query failed: disk I/O error", 500),
        ("502 Failed to compute nextRun", 400),
        ("503 Database unavailable: disk I/O error", 503),
        ("504 Outcome unknown: the connection was lost", 504),
        ("555 Timeout", 503),
    ],
)
def test_meanings(line: str, expected: int) -> None:
    assert statuses.http_status(line) == expected


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


def post(server: ThreadServer, path: str, document: Any) -> tuple[bytes, dict[str, str], Any]:
    """(the raw status line, the headers, the JSON body) of a POST sent on a
    socket, so the reason phrase is seen as sent."""
    body = json.dumps(document).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    assert server.server.http_port is not None
    with socket.create_connection(("127.0.0.1", server.server.http_port), TIMEOUT) as sock:
        sock.sendall(head + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head_text, _, payload = reply.partition(b"\r\n\r\n")
    status_line, *lines = head_text.split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status_line, headers, json.loads(payload)


def test_the_api_answers_in_http_s_terms_with_the_wire_line_kept(
    http_server: ThreadServer,
) -> None:
    expect = [
        ("Bogus", {}, b"HTTP/1.1 404 Not Found", "430 Unrecognized command"),
        ("CreateJob", {"name": "x", "repeat": "NEVER"}, b"HTTP/1.1 400 Bad Request",
         "402 Malformed repeat"),
        ("FinishJob", {"jobID": 999}, b"HTTP/1.1 404 Not Found", "404 No job with this jobID"),
    ]
    for command, params, status_line, wire in expect:
        line, headers, body = post(http_server, f"/api/{command}", params)
        assert (line, headers["jobserver-status"], body) == (status_line, wire, {"status": wire})
    # A job in a state the move does not allow: Bedrock's 405, HTTP's 409.
    _, _, created = post(http_server, "/api/CreateJob", {"name": "queued"})
    line, headers, _ = post(http_server, "/api/FinishJob", {"jobID": created["jobID"]})
    assert line == b"HTTP/1.1 409 Conflict"
    assert headers["jobserver-status"] == "405 Can only retry/finish RUNNING and RUNQUEUED jobs"
    # A lease that moved on.
    post(http_server, "/api/CreateJob", {"name": "leased", "retryAfter": "+1 HOUR"})
    _, _, job = post(http_server, "/api/GetJob", {"name": "leased", "includeLeaseID": True})
    line, headers, _ = post(http_server, "/api/FinishJob", {"jobID": job["jobID"],
                                                           "leaseID": "not-the-lease"})
    assert (line, headers["jobserver-status"]) == (b"HTTP/1.1 409 Conflict", "409 Lease expired")
    # Success is the wire's 200, with its line too.
    line, headers, body = post(http_server, "/api/Ping", {})
    assert (line, headers["jobserver-status"], body) == (b"HTTP/1.1 200 OK", "200 OK",
                                                         {"status": "200 OK"})


def test_post_queue_answers_in_http_s_terms(http_server: ThreadServer) -> None:
    blob = {"blob": "y" * (1024 * 1024)}
    line, headers, body = post(http_server, "/queue", {"type": "x", "payload": blob})
    wire = "402 Data too large (1048576 bytes at most)"
    assert line == b"HTTP/1.1 413 Request Entity Too Large"
    assert (headers["jobserver-status"], body) == (wire, {"error": wire, "status": wire})
    line, _, body = post(http_server, "/queue", {"type": "bad\nname"})
    assert line == b"HTTP/1.1 400 Bad Request" and body["status"] == "402 Malformed name"


def test_the_openapi_document_lists_every_refusal_with_its_meaning() -> None:
    from jobserver.web import openapi

    described = openapi.document()["paths"]["/api/FinishJob"]["post"]["responses"]
    for status in statuses.refusals():
        assert statuses.MEANINGS[status]
        assert str(int(status)) in described
    assert "4XX" not in described and "5XX" not in described
