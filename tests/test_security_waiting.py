"""Waiting GetJobs against a client that chooses hostile patterns.

A new job's name is matched against the pattern of every waiting GetJob on
the event loop. Before this was bounded, 2,000 waiters with patterns such
as `*[a-a]*[a-a]...b` and one CreateJobs of 200 long names held the event
loop for 108 seconds: no connection was answered meanwhile. Matching now
costs one regular-expression search per run of a pattern between stars,
and past a budget per commit it goes on a slice at a time between other
connections' requests.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from harness import ThreadServer
from helpers import ok
from wire import Client

WAITERS = 500
NAMES = 400
# Generous for a loaded machine; without the bound a ping waited minutes.
PING_BOUND = 2.0
WATCH_SECONDS = 4.0


def hostile_pattern(i: int) -> str:
    # Forty sets between stars, then a letter no name has: every name is
    # tried at every place, and none matches.
    return ("*[a-a]" * 40)[:230] + f"b{i:05d}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WAITERS * 2 + 256
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.fail(f"the test needs {wanted} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    running = ThreadServer(tmp_path / "jobs.db")
    yield running
    running.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def wait_for(port: int, pattern: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    request = f"GetJob\r\nname: {pattern}\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n"
    sock.sendall(request.encode())
    return sock


def test_hostile_waiting_patterns_do_not_hold_the_event_loop(server: ThreadServer) -> None:
    waiters = [wait_for(server.port, hostile_pattern(i)) for i in range(WAITERS)]
    worker = Client(server.port, timeout=30)
    worker.send(b"GetJob\r\nname: target*\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n")
    try:
        with server.client() as neighbour, server.client() as creator:
            # Every waiter has arrived once Status counts them.
            deadline = time.monotonic() + 30
            while ok(neighbour.request("Status")).json["waitingGetJobs"] < WAITERS + 1:
                assert time.monotonic() < deadline, "the waiters did not all arrive"
            jobs = [{"name": "a" * 240 + f"c{i:05d}"} for i in range(NAMES)]
            jobs.append({"name": "target/1"})
            ok(creator.request("CreateJobs", jobs=json.dumps(jobs)))
            worst = 0.0
            neighbour.sock.settimeout(PING_BOUND * 5)
            watch_until = time.monotonic() + WATCH_SECONDS
            while time.monotonic() < watch_until:
                began = time.monotonic()
                ok(neighbour.request("Ping"))
                worst = max(worst, time.monotonic() - began)
            assert worst < PING_BOUND, f"a neighbour's Ping waited {worst:.3f}s"
            # The one waiter whose pattern matches got its job all the same.
            assert worker.read_reply().json["name"] == "target/1"
    finally:
        worker.close()
        for sock in waiters:
            sock.close()


SCANNING_WAITERS = 100
BACKLOG = 3000
WRITE_BOUND = 5.0


def test_trying_every_hostile_waiter_over_a_backlog_does_not_hold_the_event_loop(
    server: ThreadServer,
) -> None:
    """When the clock fires, every waiter is tried; each try of a GLOB scans
    the due jobs. Before, 500 such waiters over 10,000 due jobs that none
    of them matched held the event loop for 68 seconds: the tries now run
    off the event loop, a few patterns per transaction, with other
    requests between them."""
    with server.client() as creator:
        for start in range(0, BACKLOG, 1000):
            jobs = [{"name": "a" * 240 + f"c{i:05d}"} for i in range(start, start + 1000)]
            ok(creator.request("CreateJobs", jobs=json.dumps(jobs)))
    waiters = [wait_for(server.port, hostile_pattern(i)) for i in range(SCANNING_WAITERS)]
    try:
        with server.client() as neighbour, server.client() as writer:
            deadline = time.monotonic() + 60
            while ok(neighbour.request("Status")).json["waitingGetJobs"] < SCANNING_WAITERS:
                assert time.monotonic() < deadline, "the waiters did not all arrive"
            # A job due in a second: the clock fires then, and tries everyone.
            ok(writer.request("CreateJob", name="later", firstRun=_in_a_second()))
            neighbour.sock.settimeout(PING_BOUND * 5)
            writer.sock.settimeout(WRITE_BOUND * 2)
            worst_ping = worst_write = 0.0
            watch_until = time.monotonic() + WATCH_SECONDS + 1
            while time.monotonic() < watch_until:
                began = time.monotonic()
                ok(neighbour.request("Ping"))
                worst_ping = max(worst_ping, time.monotonic() - began)
                began = time.monotonic()
                ok(writer.request("CreateJob", name="probe"))
                worst_write = max(worst_write, time.monotonic() - began)
            assert worst_ping < PING_BOUND, f"a neighbour's Ping waited {worst_ping:.3f}s"
            assert worst_write < WRITE_BOUND, f"a neighbour's CreateJob waited {worst_write:.3f}s"
    finally:
        for sock in waiters:
            sock.close()


def _in_a_second() -> str:
    return (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%d %H:%M:%S")


HOSTILE_CLIENTS = 100


def test_getjobs_with_hostile_patterns_over_a_backlog_do_not_hold_the_event_loop(
    server: ThreadServer,
) -> None:
    """A GetJob with a GLOB tries it against every due job's name, which
    for a long queue and a pattern of many wildcards takes tens of
    milliseconds; a hundred of them arriving together made batches that held
    the event loop for seconds. Such a search now runs off the event loop."""
    with server.client() as creator:
        for start in range(0, BACKLOG, 1000):
            jobs = [{"name": "a" * 240 + f"c{i:05d}"} for i in range(start, start + 1000)]
            ok(creator.request("CreateJobs", jobs=json.dumps(jobs)))
    clients = [Client(server.port, timeout=60) for _ in range(HOSTILE_CLIENTS)]
    try:
        with server.client() as neighbour:
            neighbour.sock.settimeout(PING_BOUND * 5)
            worst = 0.0
            for _ in range(2):
                for i, client in enumerate(clients):
                    client.send(f"GetJob\r\nname: {hostile_pattern(i)}\r\n\r\n".encode())
                for _ in range(10):
                    began = time.monotonic()
                    ok(neighbour.request("Ping"))
                    worst = max(worst, time.monotonic() - began)
                for client in clients:
                    assert client.read_reply().status == "404 No job found"
            assert worst < PING_BOUND, f"a neighbour's Ping waited {worst:.3f}s"
    finally:
        for client in clients:
            client.close()
