"""A GetJob whose GLOB is costly holds the writer only a share of each
transaction (core/rules/scan.py), and still answers right.

Ten `*[xa]x{128}z...*` patterns cost SQLite's GLOB about 1 ms a 255-byte
name: before the bound, one GetJob of them over 10,000 due jobs it matches
none of held every neighbour's request 10 s, and a waiting GetJob did so
at each try."""

from __future__ import annotations

import json
import time

import pytest
from test_security_waiting import _asking, _wait_for_waiters, heavy_name, heavy_pattern

from helpers import ok
from wire import Client

DUE = 10_000
# A neighbour's worst wait while the costly searches run (10 s before).
NEIGHBOUR_WORST = 0.5
# How long the neighbour asks while waiters search.
WATCH_SECONDS = 3.0
PATTERN = heavy_pattern(9000, 10)


def matching_name(j: int) -> str:
    """A name PATTERN matches (its piece j), after every heavy_name in
    hand-out order."""
    return f"~a{'x' * 128}z9000{j:02d}"


def _backlog(client: Client) -> None:
    for at in range(0, DUE, 1000):
        jobs = [{"name": heavy_name(i)} for i in range(at, at + 1000)]
        ok(client.request("CreateJobs", jobs=json.dumps(jobs)))


def _neighbour_asks(neighbour: Client) -> None:
    ok(neighbour.request("Ping"))
    ok(neighbour.request("CreateJob", name="neighbour/job"))


def test_a_costly_getjob_holds_no_neighbour_and_finds_the_last_job(start_server) -> None:
    running = start_server()
    with running.client(timeout=120) as taker, running.client() as neighbour:
        _backlog(taker)
        ok(taker.request("CreateJob", name=matching_name(3)))
        with _asking(lambda: _neighbour_asks(neighbour)) as waits:
            reply = taker.request("GetJob", name=PATTERN)
    assert reply.status == "200 OK", reply.status
    assert reply.json["name"] == matching_name(3)
    assert max(waits) < NEIGHBOUR_WORST, f"worst {max(waits):.3f}s of {len(waits)}"


def test_a_costly_getjob_finding_nothing_answers_404(start_server) -> None:
    running = start_server()
    with running.client(timeout=120) as taker:
        _backlog(taker)
        assert taker.request("GetJob", name=PATTERN).status == "404 No job found"


@pytest.mark.parametrize("waiters", [1, 20])
def test_costly_waiting_getjobs_hold_no_neighbour(start_server, waiters: int) -> None:
    running = start_server()
    clients = [running.client(timeout=120) for _ in range(waiters)]
    try:
        with running.client() as neighbour:
            _backlog(neighbour)
            for client in clients:
                client.send(
                    f"GetJob\r\nname: {PATTERN}\r\nConnection: wait\r\ntimeout: 60000\r\n\r\n"
                    .encode()
                )
            _wait_for_waiters(neighbour, waiters)
            with _asking(lambda: _neighbour_asks(neighbour)) as waits:
                time.sleep(WATCH_SECONDS)
        assert max(waits) < NEIGHBOUR_WORST, f"worst {max(waits):.3f}s of {len(waits)}"
    finally:
        for client in clients:
            client.close()


def test_a_waiting_getjob_is_woken_by_a_match_made_during_its_search(start_server) -> None:
    running = start_server()
    with running.client(timeout=120) as waiter, running.client() as creator:
        _backlog(creator)
        waiter.send(
            f"GetJob\r\nname: {PATTERN}\r\nConnection: wait\r\ntimeout: 120000\r\n\r\n".encode()
        )
        _wait_for_waiters(creator, 1)
        # Well within its first search of the 10,000 (about 10 s).
        time.sleep(1.0)
        ok(creator.request("CreateJob", name=matching_name(7)))
        reply = waiter.read_reply()
    assert reply.status == "200 OK", reply.status
    assert reply.json["name"] == matching_name(7)
