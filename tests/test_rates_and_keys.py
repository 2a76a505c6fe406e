"""Rate limits, per-key limits and fair limits (issue 35, items 3, 4 and 7;
protocol.md 14.23).

A rate holds a pattern's hand-outs to N in any window; `perKey` counts a
limit's capacity and rate for each job key apart; `fair` rotates a
pattern's hand-outs between keys. Real servers on loopback: SQLite,
PostgreSQL, and three PostgreSQL nodes sharing one queue (each client a
test opens goes to the next node).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from conformance_helpers import query
from harness import Nodes, ThreadServer
from helpers import ok
from wire import Client, encode

pytestmark = pytest.mark.backends(nodes=True)

# How long a waiting GetJob may take to be woken once its window allows:
# generous, the machines are shared.
WAKE_BOUND = 20.0


def create_jobs(client: Client, jobs: list[dict[str, Any]]) -> list[int]:
    return list(ok(client.request("CreateJobs", jobs=json.dumps(jobs))).json["jobIDs"])


def take(client: Client, name: str, count: int) -> list[dict[str, Any]]:
    reply = client.request("GetJobs", name=name, numResults=count)
    if reply.status == "404 No job found":
        return []
    return list(ok(reply).json["jobs"])


def finish(client: Client, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        ok(client.request("FinishJob", jobID=job["jobID"]))


# Rates.


def test_a_rate_hands_out_n_per_window_and_wakes_a_waiter_when_it_allows(
    server: ThreadServer,
) -> None:
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="api/*", rate="3/1s"))
        create_jobs(client, [{"name": "api/call", "maxAttempts": 1}] * 10)
        other = create_jobs(client, [{"name": "mail/x"}])[0]
        began = time.monotonic()
        assert len(take(client, "api/*", 10)) == 3
        # Jobs a rate holds hide no other job, and are no failed attempt.
        assert ok(client.request("GetJob", name="*")).json["jobID"] == other
        assert client.request("GetJob", name="api/*").status == "404 No job found"
        counts = query(client, "SELECT state, attempts, COUNT(*) AS n FROM jobs "
                       "WHERE name = 'api/call' GROUP BY state, attempts ORDER BY state;")
        assert counts == [{"state": "QUEUED", "attempts": 0, "n": 7},
                          {"state": "RUNNING", "attempts": 1, "n": 3}], counts
        # A waiting GetJob is answered once the window allows, not before.
        reply = client.request("GetJobs", name="api/*", numResults=10,
                               Connection="wait", timeout=int(WAKE_BOUND * 1000))
        waited = time.monotonic() - began
        assert len(ok(reply).json["jobs"]) == 3
        assert 0.95 <= waited < WAKE_BOUND, waited


def test_a_rate_counts_hand_outs_not_running_jobs(server: ThreadServer) -> None:
    """Finishing a job gives no hand-out back: the window does."""
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="r/*", rate="2/1h"))
        create_jobs(client, [{"name": "r/x"}] * 5)
        jobs = take(client, "r/*", 5)
        assert len(jobs) == 2
        finish(client, jobs)
        assert client.request("GetJob", name="r/*").status == "404 No job found"
        # A concurrency limit beside it still counts running jobs alone.
        ok(client.request("SetLimit", name="r/*", rate="2/1h", max=1))
        assert client.request("GetJob", name="r/*").status == "404 No job found"
        # Removed, nothing holds them.
        ok(client.request("SetLimit", name="r/*", max=0))
        assert len(take(client, "r/*", 5)) == 3


def test_a_new_max_leaves_a_spent_window_spent_and_a_new_rate_starts_afresh(
    server: ThreadServer,
) -> None:
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="w/*", rate="1/1h"))
        create_jobs(client, [{"name": "w/x"}] * 4)
        assert len(take(client, "w/*", 4)) == 1
        ok(client.request("SetLimit", name="w/*", rate="1/1h", max=10))
        assert take(client, "w/*", 4) == []
        ok(client.request("SetLimit", name="w/*", rate="2/1h", max=10))
        assert len(take(client, "w/*", 4)) == 2


# Per-key limits.


def test_a_per_key_limit_holds_each_key_apart(server: ThreadServer) -> None:
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="t/*", max=2, perKey="true"))
        jobs = [{"name": f"t/{n}", "key": key} for key in ("acme", "globex", "") for n in range(5)]
        create_jobs(client, jobs)
        taken = take(client, "t/*", 100)
        by_key: dict[str, int] = {}
        for job in taken:
            by_key[job.get("key", "")] = by_key.get(job.get("key", ""), 0) + 1
        assert by_key == {"acme": 2, "globex": 2, "": 2}, by_key
        assert take(client, "t/*", 100) == []
        # One of acme's ends: acme's next job goes, and no one else's.
        finish(client, [next(job for job in taken if job.get("key") == "acme")])
        [again] = take(client, "t/*", 100)
        assert again["key"] == "acme"
        query = ok(client.request("QueryJob", jobID=again["jobID"])).json
        assert query["key"] == "acme"


def test_a_per_key_rate_holds_each_key_apart(server: ThreadServer) -> None:
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="k/*", rate="1/1h", perKey="true"))
        create_jobs(client, [{"name": "k/x", "key": key} for key in "abcabc"])
        assert sorted(job["key"] for job in take(client, "k/*", 10)) == ["a", "b", "c"]
        assert take(client, "k/*", 10) == []


def test_a_key_holding_many_names_hides_no_other_key(server: ThreadServer) -> None:
    """A full key's jobs of 3,000 names of their own are passed over by
    pattern and key, not one by one: the free key's job is found."""
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="*", max=1, perKey="true"))
        for start in range(0, 3000, 1000):
            create_jobs(client, [{"name": f"n/{i}", "key": "busy"}
                                 for i in range(start, start + 1000)])
        assert len(take(client, "*", 10)) == 1
        free = create_jobs(client, [{"name": "n/last", "key": "idle"}])[0]
        assert [job["jobID"] for job in take(client, "*", 10)] == [free]


# Fairness.


def test_a_fair_limit_rotates_between_keys(server: ThreadServer) -> None:
    """A key's 5 jobs are not stuck behind another key's 50 created first."""
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="f/*", fair="true"))
        create_jobs(client, [{"name": "f/x", "key": "big"}] * 50)
        create_jobs(client, [{"name": "f/x", "key": "small"}] * 5)
        one_by_one = [ok(client.request("GetJob", name="f/*")).json["key"] for _ in range(6)]
        assert one_by_one == ["big", "small"] * 3, one_by_one
        many = [job["key"] for job in take(client, "f/*", 8)]
        assert sorted(many[:4]) == ["big", "big", "small", "small"], many
        assert many[4:] == ["big"] * 4, many
        # One key alone: a GetJobs takes all it asks for at once.
        assert len(take(client, "f/*", 30)) == 30


def test_a_fair_limit_rotates_among_three_keys_without_a_key(server: ThreadServer) -> None:
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="*", fair="true", max=100))
        for key in ("a", "b", ""):
            create_jobs(client, [{"name": "g", "key": key}] * 4)
        keys = [ok(client.request("GetJob", name="*")).json.get("key", "") for _ in range(12)]
        for turn in range(0, 12, 3):
            assert sorted(keys[turn : turn + 3]) == ["", "a", "b"], keys


# What Status shows of them.


def test_status_shows_each_rates_window_and_the_keys_running_under_a_limit(
    server: ThreadServer | Nodes,
) -> None:
    """Read on any node: the busiest key's hand-outs in a per-key rate's
    window, and how many keys run under a per-key limit."""
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="t/*", max=5, rate="3/1h", perKey="true"))
        ok(client.request("SetLimit", name="all/*", rate="10/1h"))
        ok(client.request("SetLimit", name="cap/*", max=2))
        create_jobs(client, [{"name": "t/x", "key": "a"}] * 4 + [{"name": "t/x", "key": "b"}])
        create_jobs(client, [{"name": "all/x"}] * 2)
        taken = take(client, "t/*", 10)
        assert sorted(job["key"] for job in taken) == ["a", "a", "a", "b"]
        # b's job ends: its hand-out stays in the window, its key runs no more.
        finish(client, [job for job in taken if job["key"] == "b"])
        assert len(take(client, "all/*", 10)) == 2
    with server.client(timeout=60) as other:
        limits = ok(other.request("Status")).json["limits"]
    assert limits == {
        "t/*": {"max": 5, "rate": "3/1h", "perKey": True, "running": 3, "inWindow": 3,
                "keys": 1},
        "all/*": {"max": 0, "rate": "10/1h", "running": 2, "inWindow": 2},
        "cap/*": {"max": 2, "running": 0},
    }, limits


# Several nodes (and connections) at once.


def test_racing_takers_never_pass_a_rate_or_a_per_key_limit(
    server: ThreadServer | Nodes,
) -> None:
    """Eight connections (on three nodes, for the nodes' backend) take at
    once: the rate's window and each key's capacity hold across them."""
    with server.client(timeout=60) as client:
        ok(client.request("SetLimit", name="rate/*", rate="25/1h"))
        ok(client.request("SetLimit", name="keyed/*", max=2, perKey="true"))
        create_jobs(client, [{"name": f"rate/{n % 3}"} for n in range(100)])
        create_jobs(client, [{"name": f"keyed/{n % 3}", "key": f"c{n % 4}"} for n in range(100)])
    for pattern in ("rate/*", "keyed/*"):
        taken = _race(server, pattern)
        if pattern == "rate/*":
            assert len(taken) == 25
        else:
            # No job finished: each key holds 2 running.
            keys = [job["key"] for job in taken]
            assert sorted(keys) == sorted(f"c{n}" for n in range(4) for _ in range(2)), keys


def _race(server: ThreadServer | Nodes, pattern: str) -> list[dict[str, Any]]:
    """What eight connections took, each taking 3 at a time until it gets
    nothing twice."""
    taken: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[str] = []
    start = threading.Barrier(8)

    def taker() -> None:
        try:
            with server.client(timeout=60) as mine:
                start.wait(30)
                empty = 0
                while empty < 2:
                    jobs = take(mine, pattern, 3)
                    empty = 0 if jobs else empty + 1
                    with lock:
                        taken.extend(jobs)
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(repr(error))

    threads = [threading.Thread(target=taker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len({job["jobID"] for job in taken}) == len(taken)
    return taken


# Bad input.


def test_bad_rates_keys_and_switches_are_refused_with_a_status_line(server: ThreadServer) -> None:
    with server.client(timeout=60) as client:
        for rate in ("5", "0/1s", "5/1w", "10001/1h", "1/2d", "1/500ms", "-1/1s", "5 / 1s"):
            status = client.request("SetLimit", name="x", rate=rate).status
            assert status.startswith("402 Malformed rate"), (rate, status)
        assert client.request("SetLimit", name="x", max=1, perKey="yes").status == (
            "402 Malformed perKey (true or false)")
        assert client.request("SetLimit", name="x", fair="1").status == (
            "402 Malformed fair (true or false)")
        assert client.request("SetLimit", name="x").status == "402 Missing max"
        assert client.request("CreateJob", name="x", key="k" * 256).status == (
            "402 Key too large (255 bytes at most)")
        assert client.request("CreateJob", name="x", key="a\tb").status == "402 Malformed key"
        client.send(encode("CreateJob", {"name": "x", "key": "é" * 127}))
        assert client.read_reply().code == 200
        # Shown in Status as set.
        ok(client.request("SetLimit", name="s/*", rate="100/1m", max=3, perKey="true",
                          fair="true"))
        limits = ok(client.request("Status")).json["limits"]
        assert limits["s/*"] == {"max": 3, "rate": "100/1m", "perKey": True, "fair": True,
                                 "running": 0, "inWindow": 0, "keys": 0}
