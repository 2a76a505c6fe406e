"""Issue 23, findings 4 and 6 (GetJobs): what any client may send, without
a token, cannot freeze the server through concurrency limits and pauses,
nor make it build a reply of hundreds of megabytes.

- SetLimit and PauseJobs stop at --max-limits (413), and removing a limit
  or a pause always works;
- a GetJobs over 10,000 jobs, every one held back by a full limit or a
  paused pattern, with the most limits and pauses allowed, answers in
  bounded time while a neighbour's Ping stays under 500 ms;
- a GetJobs stops before the job that would take its reply past
  --max-reply-bytes; the jobs it leaves are not taken; eight such GetJobs
  at once keep the server's memory bounded.

Real servers (a subprocess where timing or memory is measured), real
sockets, SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ServerProcess, ThreadServer
from helpers import all_ok, create, ok
from jobserver.core.rules import flow
from jobserver.core.rules.flow import FlowIndex
from jobserver.model.globmatch import glob_match, match_cost
from jobserver.model.limits import Limit
from jobserver.wire.limits import DEFAULT_MAX_LIMITS, MAX_MAX_LIMITS, MIN_MAX_REPLY_BYTES
from wire import Client, encode

pytestmark = pytest.mark.backends

# What a neighbour's Ping may take while the attack runs. An idle machine
# answers within 0.1 s; two cores running three tests at once delayed one by
# 0.16 s through scheduling alone. A loop held for the GetJobs would keep a
# Ping waiting for seconds.
PING_BOUND = 0.5
# What the attacking GetJobs may take, whole: bounded, with a wide margin.
GETJOBS_BOUND = 10.0
# What one GetJob over names held by the costliest patterns may take: 0.07 s
# alone here, 0.72 and 0.87 s on PostgreSQL with four tests at once on two
# cores; without the patterns' budget it held the writer 4 to 5 s, alone.
COSTLY_GETJOB_BOUND = 2.0
# What a neighbour's CreateJob may take meanwhile: on SQLite it waits for
# the writer behind one such GetJob (0.07 s alone, 0.52 s once in a CI run
# with a build beside the suite); unbounded, the GetJob held it 4 to 5 s.
BEHIND_COSTLY_GETJOB_BOUND = 1.5
# A search judges a name against every one of the 2,000 patterns (50,900
# units of its 1,000,000: about 20 names); a search without that budget
# judged all 10,000 names and held the writer 15 to 40 s (the Ping with
# it). More jobs only made the test slower: 100,000 cost half a minute of
# creating on SQLite, 20,000 a minute on PostgreSQL.
HELD_JOBS = 10_000
BATCH = 1000
# A job's data of about a megabyte: a few fill the least reply bound.
MEGABYTE_DATA = '{"blob":"' + "x" * 1_000_000 + '"}'


def pipelined(client: Client, requests: list[tuple[str, dict[str, object]]]) -> None:
    """Send every request, then read every reply, each of which must be 200."""
    client.send(b"".join(encode(verb, params) for verb, params in requests))
    for _ in requests:
        ok(client.read_reply())


def create_many(client: Client, names: list[str]) -> None:
    pipelined(
        client,
        [
            ("CreateJobs", {"jobs": [{"name": name} for name in names[start : start + BATCH]]})
            for start in range(0, len(names), BATCH)
        ],
    )


def held(j: int, count: int) -> str:
    """The name of the j-th held job: under the limit `*-N`, or of the
    paused pattern `*+N`, a thousand of each in turn."""
    return f"held{j}{'-+'[(j // count) % 2]}{j % count}"


class Pinger:
    """Pings (or another request without parameters that must answer 200)
    on a connection of its own until stopped; the slowest answer."""

    def __init__(self, port: int, verb: str = "Ping", **params: str) -> None:
        self.client = Client(port, timeout=60)
        self.verb = verb
        self.params = params
        self.slowest = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            ok(self.client.request(self.verb, **self.params))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.count += 1
            self._stop.wait(0.005)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


# Finding 4: a cap on limits and pauses, and removal that always works.


def test_setlimit_and_pausejobs_stop_at_max_limits_and_removal_always_works(db):
    server = ThreadServer(db, max_limits=3)
    try:
        with server.client() as client:
            for pattern in ("a*", "b*", "c*"):
                ok(client.request("SetLimit", name=pattern, max=2))
            assert client.request("SetLimit", name="d*", max=2).status == (
                "413 Too many limits (max 3)"
            )
            # Changing and removing a limit are not additions.
            ok(client.request("SetLimit", name="a*", max=5))
            ok(client.request("SetLimit", name="nosuch*", max=0))
            ok(client.request("SetLimit", name="a*", max=0))
            ok(client.request("SetLimit", name="d*", max=2))
            for pattern in ("a*", "b*", "c*"):
                ok(client.request("PauseJobs", name=pattern))
            ok(client.request("PauseJobs", name="a*"))
            assert client.request("PauseJobs", name="d*").status == (
                "413 Too many paused patterns (max 3)"
            )
            ok(client.request("ResumeJobs", name="b*"))
            ok(client.request("PauseJobs", name="d*"))
            status = ok(client.request("Status")).json
            assert sorted(status["limits"]) == ["b*", "c*", "d*"]
            assert status["paused"] == ["a*", "c*", "d*"]
    finally:
        server.stop()


def test_what_the_patterns_cost_a_name_is_bounded_and_a_getjob_over_costly_ones_is_quick(
    start_server, db
):
    """Each of these patterns makes SQLite's GLOB try its 122 bytes at each
    place in a name of the letter it repeats (about 25 us): once they cost
    a name MAX_PATTERNS_COST together, another is refused, and a GetJob
    over such names, all paused, answers within its budget while a
    neighbour's CreateJob goes on. Counted as one test each, 999 of them
    held the writer 4 to 5 s for one GetJob over 300 names."""
    server = start_server(db)
    costly = [f"*[a]{'a' * 116}{i:03d}b" for i in range(999)]
    cost = match_cost(costly[0])
    fits = flow.MAX_PATTERNS_COST // cost
    with server.client(timeout=60) as client:
        ok(client.request("PauseJobs", name="a*"))
        for pattern in costly[: fits - 1]:
            ok(client.request("PauseJobs", name=pattern))
        ok(client.request("SetLimit", name=costly[fits - 1], max=1))
        refused = f"413 Patterns too costly ({flow.MAX_PATTERNS_COST} units a name at most, "
        assert client.request("PauseJobs", name=costly[fits]).status == f"{refused}this one {cost})"
        assert client.request("SetLimit", name=costly[fits], max=1).status.startswith(refused)
        # Plain patterns cost a unit each: there is room for those left.
        ok(client.request("PauseJobs", name="plain/*"))
        create_many(client, ["a" * 250 + f"{i:05d}" for i in range(300)])
        with Pinger(server.port, "CreateJob", name="neighbour") as neighbour:
            for _ in range(3):
                started = time.monotonic()
                assert client.request("GetJob", name="a*").status == "404 No job found"
                took = time.monotonic() - started
                assert took < COSTLY_GETJOB_BOUND, took
                # New patterns: what held each name is forgotten.
                ok(client.request("PauseJobs", name="zz*"))
                ok(client.request("ResumeJobs", name="zz*"))
        assert neighbour.count > 0, neighbour.count
        assert neighbour.slowest < BEHIND_COSTLY_GETJOB_BOUND, neighbour.slowest
        # Removing one is always accepted, and makes room.
        ok(client.request("ResumeJobs", name=costly[0]))
        ok(client.request("PauseJobs", name=costly[fits]))


def test_a_server_does_not_start_with_limit_options_that_cost_too_much(start_server, backend):
    if backend != "sqlite":
        pytest.skip("the command line is the same on every backend")
    costly = [f"--limit=*[a]{'a' * 116}{i:03d}b=1" for i in range(400)]
    refused = start_server(None, *costly)
    assert not refused.started and refused.wait() == 2, refused.log
    assert "the --limit patterns cost more than 200000 units a name" in refused.log


def test_max_limits_is_range_checked_and_counts_the_limit_options(start_server, backend):
    if backend != "sqlite":
        pytest.skip("the command line is the same on every backend")
    assert DEFAULT_MAX_LIMITS == 1000
    for value in ("0", str(MAX_MAX_LIMITS + 1), "many"):
        refused = start_server(None, "--max-limits", value)
        assert not refused.started and refused.wait() == 2, refused.log
    refused = start_server(None, "--max-limits", "1", "--limit", "a*=1", "--limit", "b*=1")
    assert not refused.started and refused.wait() == 2
    assert "more --limit patterns than --max-limits 1" in refused.log
    served = start_server(None, "--max-limits", "2", "--limit", "a*=1", "--limit", "b*=1")
    with served.client() as client:
        assert client.request("SetLimit", name="c*", max=1).status == (
            "413 Too many limits (max 2)"
        )


def test_getjobs_over_many_held_jobs_with_the_most_limits_keeps_ping_fast(start_server, db):
    """Every due job is held back: half by a full limit, half by a paused
    pattern, with --max-limits of each, all patterns starting with a
    wildcard (no literal prefix to narrow them)."""
    server = start_server(db)
    count = DEFAULT_MAX_LIMITS
    with server.client(timeout=120) as client:
        # One running job for each limit to come: a limit's usage is what
        # runs under it, however it began (taken under the limits, these
        # cost a search each 20 names, 14 to 30 s in all).
        create_many(client, [f"fill-{i}" for i in range(count)])
        running = ok(client.request("GetJobs", name="fill-*", numResults=count)).json["jobs"]
        assert len(running) == count
        # Over connections of their own: one connection's requests are a
        # commit each (on PostgreSQL a minute for these 2,000).
        limits = [encode("SetLimit", {"name": f"*-{i}", "max": 1}) for i in range(count)]
        all_ok(server.port, limits)
        all_ok(server.port, [encode("PauseJobs", {"name": f"*+{i}"}) for i in range(count)])
        # held0-0 .. held999-999 under limits, held1000+0 .. paused, and so on.
        create_many(client, [held(j, count) for j in range(HELD_JOBS)])
        with Pinger(server.port) as pinger:
            started = time.monotonic()
            reply = client.request("GetJobs", name="*", numResults=1000)
            took = time.monotonic() - started
            one = client.request("GetJob", name="held*")
            status = ok(client.request("Status")).json
        assert reply.status == "404 No job found" and one.status == "404 No job found"
        assert len(status["limits"]) == count and len(status["paused"]) == count
        assert all(limit == {"max": 1, "running": 1} for limit in status["limits"].values())
        assert took < GETJOBS_BOUND, took
        assert pinger.count > 0 and pinger.slowest < PING_BOUND, pinger.slowest
        # The limits still hold, and a job no pattern holds is still found.
        free = create(client, "free", jobPriority=1000)
        assert ok(client.request("GetJobs", name="*", numResults=1000)).json["jobs"][0][
            "jobID"
        ] == free
        assert client.request("GetJob", name=held(7, count)).status == "404 No job found"
        ok(client.request("SetLimit", name="*-7", max=0))
        assert ok(client.request("GetJob", name=held(7, count))).json["name"] == "held7-7"
        paused = held(count + 8, count)
        assert client.request("GetJob", name=paused).status == "404 No job found"
        ok(client.request("ResumeJobs", name="*+8"))
        assert ok(client.request("GetJob", name=paused)).json["name"] == paused


_PATTERN = st.text(st.sampled_from("*?[]^-ab]é𝄞"), min_size=1, max_size=8)
_NAME = st.text(st.sampled_from("ab-^]*?[é𝄞z\0"), min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(
    limits=st.dictionaries(_PATTERN, st.integers(1, 5), max_size=8),
    paused=st.frozensets(_PATTERN, max_size=8),
    names=st.lists(_NAME, min_size=1, max_size=5),
)
def test_the_flow_index_agrees_with_glob_matching(limits, paused, names):
    """What flow.py finds for a name, matched or remembered, is what
    matching each pattern (as SQLite's GLOB does) gives."""
    index = FlowIndex({p: Limit(c) for p, c in limits.items()}, paused)
    for name in names * 2:
        verdict = index.verdict(name)
        assert verdict.limits == tuple(p for p in limits if glob_match(p, name))
        assert set(verdict.paused) == {p for p in paused if glob_match(p, name)}


def test_the_cache_of_names_holds_a_bounded_number_of_limits(monkeypatch):
    """Patterns that all match every name make each verdict as long as the
    list of limits: the cache then keeps fewer names, not more memory."""
    monkeypatch.setattr(flow, "MAX_CACHED_LIMITS", 50)
    index = FlowIndex({"*" * (i + 1): Limit(1) for i in range(20)}, frozenset())
    verdicts = [index.verdict(f"name{k}") for k in range(10)]
    assert all(len(verdict.limits) == 20 for verdict in verdicts)
    remembered = [k for k in range(10) if index.cached(f"name{k}") is not None]
    assert remembered == [8, 9]


# Finding 6, GetJobs' part: a byte bound on the reply.


def test_getjobs_stops_before_the_reply_would_pass_max_reply_bytes(db):
    server = ThreadServer(db, max_reply_bytes=MIN_MAX_REPLY_BYTES)
    try:
        with server.client(timeout=60) as client:
            ids = [
                create(client, f"big{i}", data=MEGABYTE_DATA, maxAttempts=3) for i in range(10)
            ]
            reply = ok(client.request("GetJobs", name="big*", numResults=1000))
            first = [job["jobID"] for job in reply.json["jobs"]]
            assert 1 <= len(first) < 10
            assert len(reply.body) <= MIN_MAX_REPLY_BYTES
            # The next job would not have fitted.
            assert len(reply.body) + len(MEGABYTE_DATA) > MIN_MAX_REPLY_BYTES - 4096
            assert first == ids[: len(first)]
            # The rest were not taken: QUEUED, no attempt counted.
            for job_id in ids[len(first) :]:
                left = ok(client.request("QueryJob", jobID=job_id)).json
                assert left["state"] == "QUEUED" and left["attempt"] == 0, left
            handed = list(first)
            while len(handed) < len(ids):
                reply = ok(client.request("GetJobs", name="big*", numResults=1000))
                handed += [job["jobID"] for job in reply.json["jobs"]]
            assert handed == ids
    finally:
        server.stop()


def test_the_bound_holds_for_text_that_takes_more_bytes_than_characters(db):
    """Data of three-byte characters, and names that JSON escapes."""
    server = ThreadServer(db, max_reply_bytes=MIN_MAX_REPLY_BYTES)
    try:
        with server.client(timeout=60) as client:
            data = '{"blob":"' + "€" * 349_000 + '"}'
            for i in range(6):
                create(client, f'say "hé" {i}', data=data)
            reply = ok(client.request("GetJobs", name="say*", numResults=1000))
            assert len(reply.body) <= MIN_MAX_REPLY_BYTES
            assert 1 <= len(reply.json["jobs"]) < 6
            assert reply.json["jobs"][0]["data"] == {"blob": "€" * 349_000}
    finally:
        server.stop()


def test_the_bound_counts_the_data_of_a_jobs_dependencies(db):
    """A job handed out with `dependencies` (protocol.md 14.25) carries up to
    1 MiB of their data besides its own: counted as its own data only, a
    GetJobs of ten such jobs answered 10 MB past the least bound of 4 MiB
    (and a thousand, a gigabyte past the default)."""
    server = ThreadServer(db, max_reply_bytes=MIN_MAX_REPLY_BYTES)
    try:
        with server.client(timeout=60) as client:
            dependency = create(client, "dep")
            for i in range(10):
                create(client, f"after{i}", dependsOn=f"[{dependency}]")
            ok(client.request("GetJob", name="dep"))
            ok(client.request("FinishJob", jobID=dependency, data=MEGABYTE_DATA))
            reply = ok(client.request("GetJobs", name="after*", numResults=1000))
            assert len(reply.body) <= MIN_MAX_REPLY_BYTES
            assert 1 <= len(reply.json["jobs"]) < 10
            assert reply.json["jobs"][0]["dependencies"][0]["data"] == {"blob": "x" * 1_000_000}
    finally:
        server.stop()


def test_one_job_of_the_largest_size_fits_the_least_bound(db):
    server = ThreadServer(db, max_reply_bytes=MIN_MAX_REPLY_BYTES)
    try:
        with server.client(timeout=60) as client:
            data = '{"blob":"' + "y" * (1024 * 1024 - 11) + '"}'
            assert len(data) == 1024 * 1024
            name = "n" * 255
            job_id = create(client, name, data=data)
            reply = ok(client.request("GetJobs", name=name, numResults=1000))
            assert [job["jobID"] for job in reply.json["jobs"]] == [job_id]
    finally:
        server.stop()


def rss_peak_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc")


def test_eight_big_getjobs_at_once_keep_memory_bounded(
    start_server: Callable[..., ServerProcess], backend: str
) -> None:
    if backend != "sqlite":
        pytest.skip("the reply is built by the same code on every backend")
    # NORMAL: a memory test needs no sync per commit of its 96 MB of jobs.
    server = start_server(
        None, "--max-reply-bytes", str(MIN_MAX_REPLY_BYTES), "--synchronous", "NORMAL"
    )
    groups, per_group = 8, 12
    with server.client(timeout=120) as client:
        for group in range(groups):
            pipelined(
                client,
                [("CreateJob", {"name": f"g{group}", "data": MEGABYTE_DATA})] * per_group,
            )
    before = rss_peak_kib(server.proc.pid)
    replies: list[int] = []

    def take(group: int) -> None:
        with server.client(timeout=120) as client:
            reply = ok(client.request("GetJobs", name=f"g{group}", numResults=1000))
            replies.append(len(reply.body))

    threads = [threading.Thread(target=take, args=(group,)) for group in range(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    grown_mib = (rss_peak_kib(server.proc.pid) - before) / 1024
    # Eight replies of 4 MiB, and the copies made while building them, fit
    # easily; without the bound each reply is 12 MB, and the peak grows by
    # much more.
    assert grown_mib < 300, grown_mib
    assert len(replies) == groups and max(replies) <= MIN_MAX_REPLY_BYTES, replies
