"""The wire port's answer to HTTP, the most likely first mistake (`curl
localhost:8888/`, a browser pointed at it): a valid HTTP/1.1 `400 Bad
Request` saying this is the wire port and where HTTP is, then closed.
Its security side (nothing of the request is read past its head, nothing
acts) is tests/test_security_wire.py's."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import ThreadServer
from helpers import ok, until
from jobserver.wire.limits import MAX_HEADERS, MAX_LINE
from tls_certs import make_certificates

TIMEOUT = 10.0


@pytest.fixture
def with_http(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


@pytest.fixture
def without_http(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db")
    yield running
    running.stop()


def exchange(port: int, request: bytes, wrap: ssl.SSLContext | None = None) -> bytes:
    """Everything the server sends back to `request` until it closes."""
    with socket.create_connection(("127.0.0.1", port), TIMEOUT) as raw:
        sock = raw if wrap is None else wrap.wrap_socket(raw, server_hostname="127.0.0.1")
        sock.sendall(request)
        received = b""
        # A reset after the answer (what was sent past the head is unread)
        # ends the read.
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
        return received


def parse(response: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.decode("ascii").partition(":")
        headers[name.lower()] = value.strip()
    return status, headers, body


GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"


def test_a_get_is_answered_in_http_with_the_http_port(with_http: ThreadServer) -> None:
    status, headers, body = parse(exchange(with_http.port, GET))
    assert status == b"HTTP/1.1 400 Bad Request"
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    text = body.decode()
    assert "jobserver's wire port" in text
    assert f"port {with_http.server.http_port} " in text
    assert f"http://HOST:{with_http.server.http_port}/" in text
    # The server goes on.
    with with_http.client() as client:
        assert ok(client.request("Ping")).status == "200 OK"


def test_without_http_it_says_how_to_have_it(without_http: ThreadServer) -> None:
    status, _, body = parse(exchange(without_http.port, GET))
    assert status == b"HTTP/1.1 400 Bad Request"
    assert b"--http-port PORT" in body and b"jobserverd[web]" in body


def test_head_gets_the_head_alone(without_http: ThreadServer) -> None:
    request = b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    status, headers, body = parse(exchange(without_http.port, request))
    assert status == b"HTTP/1.1 400 Bad Request" and int(headers["content-length"]) > 0
    assert body == b""


@pytest.mark.parametrize("method", [b"POST", b"PUT", b"OPTIONS", b"DELETE", b"get"])
def test_nothing_of_the_request_is_reflected(without_http: ThreadServer, method: bytes) -> None:
    marker = b"Reflected<script>"
    request = (
        method + b" /" + marker + b" HTTP/1.1\r\nHost: " + marker + b"\r\nX-" + marker
        + b": " + marker + b"\r\nContent-Length: 5\r\n\r\nhello"
    )
    response = exchange(without_http.port, request)
    assert response.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert marker.lower() not in response.lower()


def test_a_head_past_the_wire_s_bounds_is_still_told_in_http(without_http: ThreadServer) -> None:
    many = b"".join(b"X-%d: y\r\n" % n for n in range(MAX_HEADERS + 5))
    response = exchange(without_http.port, b"GET / HTTP/1.1\r\n" + many + b"\r\n")
    assert response.startswith(b"HTTP/1.1 400 Bad Request\r\n"), response[:80]
    # One byte past the bound and no more: the server reads all of it
    # before it answers, so its close is not a reset that loses the answer.
    cookie = b"Cookie: " + b"c" * (MAX_LINE + 1 - len(b"Cookie: "))
    response = exchange(without_http.port, b"GET / HTTP/1.1\r\n" + cookie)
    assert response.startswith(b"HTTP/1.1 400 Bad Request\r\n"), response[:80]


def test_over_tls_the_answer_is_inside_tls_and_names_https(tmp_path: Path) -> None:
    files = make_certificates(tmp_path, "127.0.0.1")
    server = ThreadServer(
        tmp_path / "jobs.db", http_port=0, tls_cert=str(files.cert), tls_key=str(files.key)
    )
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        context = ssl.create_default_context(cafile=str(files.ca))
        status, _, body = parse(exchange(server.port, GET, context))
        assert status == b"HTTP/1.1 400 Bad Request"
        assert f"https://HOST:{server.server.http_port}/".encode() in body
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_shows_the_answer(with_http: ThreadServer) -> None:
    shown = subprocess.run(
        ["curl", "-sS", "-i", "--max-time", str(TIMEOUT), f"http://127.0.0.1:{with_http.port}/"],
        capture_output=True, timeout=TIMEOUT * 2, check=False,
    )
    # curl exits 0 on a 400 (no --fail) and prints what it got.
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(b"HTTP/1.1 400 Bad Request\r\n"), shown.stdout
    assert b"jobserver's wire port" in shown.stdout
    assert str(with_http.server.http_port).encode() in shown.stdout


def test_plain_http_to_a_tls_port_is_told_in_http(tmp_path: Path) -> None:
    files = make_certificates(tmp_path, "127.0.0.1")
    server = ThreadServer(
        tmp_path / "jobs.db", http_port=0, tls_cert=str(files.cert), tls_key=str(files.key)
    )
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        status, headers, body = parse(exchange(server.port, GET))
        assert status == b"HTTP/1.1 400 Bad Request"
        assert headers["connection"] == "close"
        assert f"https://HOST:{server.server.http_port}/".encode() in body
        # A client of the protocol is told as before (the client library
        # reads that line as advice to use TLS).
        assert exchange(server.port, b"Ping\n\n").startswith(b"400 This port requires TLS\r\n")
        if shutil.which("curl") is not None:
            shown = subprocess.run(
                ["curl", "-sS", "-i", "--max-time", str(TIMEOUT),
                 f"http://127.0.0.1:{server.port}/"],
                capture_output=True, timeout=TIMEOUT * 2, check=False,
            )
            assert shown.stdout.startswith(b"HTTP/1.1 400 Bad Request\r\n"), shown
    finally:
        server.stop()
