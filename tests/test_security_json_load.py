"""Large JSON from a client does not hold the event loop, on either port.

A body of 900 KB of empty arrays (`{"name":"x","data":{"a":[[],[],...]}}`,
300,000 of them) was depth-checked by a Python loop, parsed, written out
again and parsed a second time, all on the event loop (HTTP), and parsed
with three full collections of the process's objects in one C call
(wire): a neighbour's Ping waited up to 1.5 s and /healthz 4.7 s while
eight arrived at once. Now such JSON is parsed once, in a thread, with
the collector held off meanwhile; a declared body past the limit is
refused before it is read.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from helpers import answer_waits, assert_answering, ok
from wire import Client, encode

ARRAYS = 300_000
DATA = '{"a":[' + ",".join(["[]"] * ARRAYS) + "]}"
BODY = ('{"name":"x","data":' + DATA + "}").encode()
# Nine answers in ten within the first bound, all within the second, on a
# shared machine of two cores: each body still holds the interpreter about
# 40 ms while it is parsed; parsed on the event loop, a neighbour waited up
# to 1.5 s. Under other tests' load, nine in ten came within 0.2 to 0.31 s
# and the worst within 0.5 s, for the code before this issue and after
# alike (0.1 s, then 0.2 s, were each passed under load; then 0.35 s, nine
# in ten within 0.41 s and the worst 0.47 s, with five other checkouts'
# tests on the same two cores). With four tests at once on two cores
# (-n 4), /healthz's worst of 23 was 1.01 s in one run of the suite, nine in
# ten within 0.22 s. The worst's bound is under what a parse on the event
# loop cost a neighbour's Ping (1.5 s, on a quiet machine; /healthz 4.7 s).
NEIGHBOUR_BOUND = 0.6
NEIGHBOUR_WORST = 1.25
WATCH_SECONDS = 3.0
# Bodies arriving at once over HTTP, besides one CreateJob on the wire.
HTTP_SENDERS = 2
HTTP_LISTENING = re.compile(r"HTTP on [\d.]+:(\d+)")


def post(port: int, body: bytes, timeout: float = 30) -> bytes:
    """POST /api/CreateJob with `body`; the response's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(
            b"POST /api/CreateJob HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    return response.split(b"\r\n", 1)[0]


@contextmanager
def sending(*senders: Callable[[], object]) -> Iterator[list[BaseException]]:
    """Each sender called again and again in a thread of its own until the
    block ends; the errors they met."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def again(send: Callable[[], object]) -> None:
        while not stop.is_set():
            try:
                send()
            except Exception as error:  # noqa: BLE001 - reported to the test
                errors.append(error)
                return

    threads = [threading.Thread(target=again, args=(send,), daemon=True) for send in senders]
    for thread in threads:
        thread.start()
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def test_large_json_on_both_ports_keeps_neighbours_answering(start_server) -> None:
    # A server process of its own: in this one, a collection of the test
    # run's own garbage would count against the bound.
    running = start_server(None, "--http-port", "0")
    assert running.port is not None, running.log
    [line] = running.matching(HTTP_LISTENING, 1, 15)
    http_port = int(HTTP_LISTENING.search(line).group(1))
    health = f"http://127.0.0.1:{http_port}/healthz"
    assert post(http_port, BODY).endswith(b" 200 OK")
    with running.client(timeout=30) as creator, running.client() as neighbour:

        def create_on_the_wire() -> None:
            creator.send(encode("CreateJob", {"name": "x", "data": DATA}))
            ok(creator.read_reply())

        def create_over_http() -> None:
            assert post(http_port, BODY).endswith(b" 200 OK")

        with sending(create_on_the_wire, *[create_over_http] * HTTP_SENDERS) as errors:
            wire = answer_waits(lambda: ok(neighbour.request("Ping")), WATCH_SECONDS)
            http = answer_waits(
                lambda: urllib.request.urlopen(health, timeout=5).read(), WATCH_SECONDS
            )
        assert not errors, errors
        assert_answering(wire, "a neighbour's Ping", NEIGHBOUR_BOUND, NEIGHBOUR_WORST)
        assert_answering(http, "/healthz", NEIGHBOUR_BOUND, NEIGHBOUR_WORST)


def test_a_declared_body_past_the_limit_is_refused_at_once(start_server) -> None:
    running = start_server(None, "--http-port", "0")
    [line] = running.matching(HTTP_LISTENING, 1, 15)
    http_port = int(HTTP_LISTENING.search(line).group(1))
    for declared in (b"99999999999999999999", b"%d" % (2 * len(BODY))):
        with socket.create_connection(("127.0.0.1", http_port), timeout=5) as sock:
            began = time.monotonic()
            sock.sendall(
                b"POST /api/CreateJob HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + declared + b"\r\n\r\n{}"
            )
            response = sock.recv(65536)
            while b"larger than" not in response and (chunk := sock.recv(65536)):
                response += chunk
            assert time.monotonic() - began < 2
        assert response.startswith(b"HTTP/1.1 413 "), response
    with Client(running.port) as client:
        assert ok(client.request("Ping"))
