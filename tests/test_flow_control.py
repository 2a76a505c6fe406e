"""Flow control beyond Bedrock (protocol.md 14.7 to 14.10): concurrency
limits with job costs, pause and resume, time windows, retention.

Over a real server; waits poll with a deadline. Time windows across
daylight-saving changes are checked with fixed moments on the pure
window function, since nobody can wait for a DST change.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from test_failure_handling import layout, v1_file

from harness import ThreadServer
from helpers import create, ok, until
from jobserver import cli
from jobserver.model import windows
from jobserver.model.jobs import NewJob
from jobserver.model.limits import Limit, Rate
from jobserver.model.times import parse_duration, to_millis, to_seconds
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA_VERSION
from wire import Reply

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

DEADLINE = 10.0
UTC = UTC


def status(server: ThreadServer) -> dict[str, Any]:
    with server.client() as client:
        return ok(client.request("Status")).json


class Waiter:
    """A blocking GetJob on its own connection and thread."""

    def __init__(self, server: ThreadServer, name: str, timeout_ms: int = 10_000) -> None:
        self.reply: Reply | None = None
        self.client = server.client(timeout=timeout_ms / 1000 + 5)
        self.thread = threading.Thread(target=self._run, args=(name, timeout_ms), daemon=True)
        before = status(server)["waitingGetJobs"]
        self.thread.start()
        until(lambda: status(server)["waitingGetJobs"] > before, DEADLINE, "the GetJob to wait")

    def _run(self, name: str, timeout_ms: int) -> None:
        self.reply = self.client.request(
            "GetJob", name=name, Connection="wait", timeout=timeout_ms
        )

    def result(self) -> Reply:
        self.thread.join(DEADLINE)
        assert self.reply is not None, "the waiting GetJob got no reply"
        self.client.close()
        return self.reply


@pytest.fixture
def make_server(tmp_path: Path):
    started: list[ThreadServer] = []

    def start(**options: Any) -> ThreadServer:
        running = ThreadServer(tmp_path / "jobs.db", **options)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.stop()


# Pause and resume.


def test_a_paused_pattern_is_not_handed_out_and_resuming_serves_a_waiter(server, client):
    ok(client.request("PauseJobs", name="mail/*"))
    job_id = create(client, "mail/send")
    create(client, "other")
    assert client.request("GetJob", name="mail/send").status == "404 No job found"
    assert ok(client.request("GetJob", name="*")).json["name"] == "other"
    assert status(server)["paused"] == ["mail/*"]
    waiter = Waiter(server, "mail/send")
    started = time.monotonic()
    ok(client.request("ResumeJobs", name="mail/*"))
    reply = waiter.result()
    assert reply.status == "200 OK" and reply.json["jobID"] == job_id
    assert time.monotonic() - started < 2
    assert status(server)["paused"] == []


def test_pauses_survive_a_restart(make_server):
    first = make_server()
    with first.client() as client:
        ok(client.request("PauseJobs", name="report/*"))
        create(client, "report/daily")
    first.stop()
    second = make_server()
    with second.client() as client:
        assert client.request("GetJob", name="report/daily").status == "404 No job found"
        ok(client.request("ResumeJobs", name="report/*"))
        assert ok(client.request("GetJob", name="report/daily")).json["name"] == "report/daily"


def test_pause_and_resume_check_their_name(client):
    assert client.request("PauseJobs").status == "402 Missing name"
    assert client.request("ResumeJobs").status == "402 Missing name"
    assert client.request("PauseJobs", name="x" * 256).status == (
        "402 Name too large (255 bytes at most)"
    )
    ok(client.request("ResumeJobs", name="never-paused"))


# Concurrency limits.


def running_cost(server: ThreadServer, pattern: str) -> int:
    with server.client() as client:
        reply = ok(client.request(
            "Query", query=f"SELECT COALESCE(SUM(cost), 0) FROM jobs WHERE state = 'RUNNING' "
            f"AND name GLOB '{pattern}';", format="json"))
        return reply.json["rows"][0][0]


def test_costs_never_take_a_limit_over_capacity_under_eight_workers(make_server):
    capacity = 5
    server = make_server(limits={"work/*": Limit(capacity)})
    rng = random.Random(7)
    with server.client() as client:
        ids = ok(client.request("CreateJobs", jobs=[
            {"name": f"work/{i % 3}", "cost": rng.randint(1, 3)} for i in range(60)
        ])).json["jobIDs"]
    held = [0]
    peak = [0]
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        try:
            work()
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(repr(error))

    def work() -> None:
        with server.client() as client:
            while True:
                reply = client.request("GetJob", name="work/*", Connection="wait", timeout=1000)
                if reply.status != "200 OK":
                    return
                job = reply.json
                cost = ok(client.request("QueryJob", jobID=job["jobID"])).json.get("cost", 1)
                with lock:
                    held[0] += cost
                    peak[0] = max(peak[0], held[0])
                    seen.append(job["jobID"])
                counted = running_cost(server, "work/*")
                if counted > capacity:
                    errors.append(f"{counted} running")
                with lock:
                    held[0] -= cost
                ok(client.request("FinishJob", jobID=job["jobID"]))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(seen) == sorted(ids)
    assert 1 < peak[0] <= capacity


@pytest.mark.parametrize("release", ["finish", "fail", "retry", "lease"])
def test_a_freed_limit_serves_a_waiting_getjob(make_server, release):
    server = make_server(limits={"img/*": Limit(1)})
    with server.client() as client:
        # Leases run from the start of the current second, so a one-second
        # lease may already be over by the next request: two are at least one.
        params = {"retryAfter": "+2 SECONDS"} if release == "lease" else {}
        first = create(client, "img/a", **params)
        assert ok(client.request("GetJob", name="img/*")).json["jobID"] == first
        second = create(client, "img/b")
        assert client.request("GetJob", name="img/b").status == "404 No job found"
        assert status(server)["limits"] == {"img/*": {"max": 1, "running": 1}}
        waiter = Waiter(server, "img/b")
        started = time.monotonic()
        if release == "finish":
            ok(client.request("FinishJob", jobID=first))
        elif release == "fail":
            ok(client.request("FailJob", jobID=first))
        elif release == "retry":
            ok(client.request("RetryJob", jobID=first, delay=60))
        reply = waiter.result()
        assert reply.status == "200 OK" and reply.json["jobID"] == second
        assert time.monotonic() - started < (4 if release == "lease" else 1)


def test_setlimit_persists_replaces_and_removes(make_server):
    first = make_server()
    with first.client() as client:
        ok(client.request("SetLimit", name="a/*", max=1))
        create(client, "a/1")
        create(client, "a/2")
        ok(client.request("GetJob", name="a/*"))
    first.stop()
    second = make_server()
    with second.client() as client:
        assert client.request("GetJob", name="a/*").status == "404 No job found"
        assert status(second)["limits"] == {"a/*": {"max": 1, "running": 1}}
        waiter = Waiter(second, "a/*")
        ok(client.request("SetLimit", name="a/*", max=0))
        assert waiter.result().status == "200 OK"
        assert status(second)["limits"] == {}


def test_setlimit_and_cost_are_checked(client):
    assert client.request("SetLimit", max=3).status == "402 Missing name"
    assert client.request("SetLimit", name="a").status == "402 Missing max"
    for bad in ("-1", "1.5", "x", "01"):
        assert client.request("SetLimit", name="a", max=bad).status == "402 Malformed max"
    for bad in ("0", "-2", "two", "1000001"):
        assert client.request("CreateJob", name="a", cost=bad).status == "402 Malformed cost"


def test_cost_shows_only_for_jobs_that_set_it(client):
    plain = create(client, "plain")
    heavy = create(client, "heavy", cost=4)
    assert "cost" not in ok(client.request("QueryJob", jobID=plain)).json
    assert ok(client.request("QueryJob", jobID=heavy)).json["cost"] == 4
    assert ok(client.request("GetJob", name="heavy")).json["cost"] == 4


def test_a_job_costlier_than_what_is_left_is_skipped_for_a_cheaper_one(make_server):
    server = make_server(limits={"q/*": Limit(3)})
    with server.client() as client:
        create(client, "q/a", cost=2)
        ok(client.request("GetJob", name="q/*"))
        create(client, "q/big", cost=2)
        small = create(client, "q/small")
        assert ok(client.request("GetJob", name="q/*")).json["jobID"] == small
        assert client.request("GetJob", name="q/*").status == "404 No job found"


# Time windows: the pure function, at fixed moments.


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def next_start(spec: str, zone: str, now: str) -> str:
    moment = windows.next_start(windows.parse_windows(spec), windows.parse_zone(zone), at(now))
    return to_seconds(moment)


def test_a_window_that_spans_midnight():
    assert next_start("22:00-02:00", "UTC", "2026-06-01 12:00:00") == "2026-06-01 22:00:00"
    assert next_start("22:00-02:00", "UTC", "2026-06-01 23:30:00") == "2026-06-01 23:30:00"
    assert next_start("22:00-02:00", "UTC", "2026-06-02 01:59:59") == "2026-06-02 01:59:59"
    assert next_start("22:00-02:00", "UTC", "2026-06-02 02:00:00") == "2026-06-02 22:00:00"


def test_several_windows_take_the_nearest():
    spec = "05:00-07:00, 22:00-23:30"
    assert next_start(spec, "UTC", "2026-06-01 04:00:00") == "2026-06-01 05:00:00"
    assert next_start(spec, "UTC", "2026-06-01 08:00:00") == "2026-06-01 22:00:00"
    assert next_start(spec, "UTC", "2026-06-01 23:30:00") == "2026-06-02 05:00:00"


def test_windows_follow_local_time_across_both_2026_dst_changes():
    # Paris: CET (+1) until 2026-03-29 02:00, then CEST (+2) until
    # 2026-10-25 03:00, then CET again.
    paris = "Europe/Paris"
    assert next_start("09:00-10:00", paris, "2026-03-28 12:00:00") == "2026-03-29 07:00:00"
    assert next_start("09:00-10:00", paris, "2026-03-27 12:00:00") == "2026-03-28 08:00:00"
    assert next_start("09:00-10:00", paris, "2026-10-24 12:00:00") == "2026-10-25 08:00:00"
    # 02:30 does not exist on the spring night: the window opens at 03:00 CEST.
    assert next_start("02:30-04:00", paris, "2026-03-28 12:00:00") == "2026-03-29 01:00:00"
    # 02:30 happens twice on the autumn night: the first one (CEST) counts.
    assert next_start("02:30-04:00", paris, "2026-10-24 12:00:00") == "2026-10-25 00:30:00"
    # And inside that window an hour longer than usual, the job may run.
    assert next_start("02:30-04:00", paris, "2026-10-25 02:30:00") == "2026-10-25 02:30:00"
    # New York changes on other dates: 2026-03-08 and 2026-11-01.
    ny = "America/New_York"
    assert next_start("22:00-06:00", ny, "2026-03-07 12:00:00") == "2026-03-08 03:00:00"
    # That night is an hour short: 06:00 EDT is 10:00 UTC.
    assert next_start("22:00-06:00", ny, "2026-03-08 09:59:00") == "2026-03-08 09:59:00"
    assert next_start("22:00-06:00", ny, "2026-03-08 10:00:00") == "2026-03-09 02:00:00"
    # The autumn night is an hour long: 02:00 to 11:00 UTC.
    assert next_start("22:00-06:00", ny, "2026-11-01 10:30:00") == "2026-11-01 10:30:00"
    assert next_start("22:00-06:00", ny, "2026-11-01 11:00:00") == "2026-11-02 03:00:00"


def test_window_parameters_are_checked(client):
    for bad in ("5-7", "05:00-05:00", "25:00-26:00", "05:00", "05:00-07:00,"):
        reply = client.request("CreateJob", name="w", timeWindows=bad)
        assert reply.status == "402 Malformed timeWindows", bad
    for bad in ("Mars/Olympus", "/etc/localtime", "EST+5", "../UTC"):
        reply = client.request("CreateJob", name="w", timeWindows="05:00-07:00", timeZone=bad)
        assert reply.status == "402 Malformed timeZone", bad
    assert client.request("CreateJob", name="w", timeZone="UTC").status == "402 Missing timeWindows"


def window_around(now: datetime, inside: bool) -> str:
    """A one-hour UTC window containing now, or one that opened hours ago."""
    start = now - timedelta(minutes=10) if inside else now + timedelta(hours=3)
    end = start + timedelta(hours=1)
    return f"{start:%H:%M}-{end:%H:%M}"


def test_create_moves_a_job_to_its_next_window_and_getjob_respects_it(client):
    now = datetime.now(UTC)
    later = create(client, "w/later", timeWindows=window_around(now, inside=False))
    job = ok(client.request("QueryJob", jobID=later)).json
    expected = (now + timedelta(hours=3)).replace(second=0, microsecond=0)
    assert job["nextRun"] == to_millis(expected)
    assert (job["timeWindows"], job["timeZone"]) == (window_around(now, False), "UTC")
    assert client.request("GetJob", name="w/later").status == "404 No job found"
    paris = now.astimezone(windows.parse_zone("Europe/Paris"))
    open_now = create(client, "w/now", timeWindows=window_around(paris, inside=True),
                      timeZone="Europe/Paris")
    reply = ok(client.request("GetJob", name="w/*"))
    assert reply.json["jobID"] == open_now


def test_a_job_whose_window_closed_while_it_waited_is_moved_not_handed_out(client):
    now = datetime.now(UTC)
    job_id = create(client, "w/late", timeWindows=window_around(now, inside=False))
    # Due now, as if it had waited past its window.
    ok(client.request("UpdateJob", jobID=job_id, data={}, nextRun="2000-01-01 00:00:00"))
    assert client.request("GetJob", name="w/late").status == "404 No job found"
    moved = ok(client.request("QueryJob", jobID=job_id)).json["nextRun"]
    assert moved == to_millis((now + timedelta(hours=3)).replace(second=0, microsecond=0))


def test_retry_and_requeue_wait_for_the_window(client):
    now = datetime.now(UTC)
    spec = window_around(now, inside=True)
    job_id = create(client, "w/r", timeWindows=spec)
    ok(client.request("GetJob", name="w/r"))
    # Retried to a time past the window's end: the next day's window.
    ok(client.request("RetryJob", jobID=job_id, delay=7200))
    start = (now - timedelta(minutes=10)).replace(second=0, microsecond=0)
    tomorrow = to_millis(start + timedelta(days=1))
    assert ok(client.request("QueryJob", jobID=job_id)).json["nextRun"] == tomorrow


# Retention.


def test_by_default_finished_jobs_are_deleted_and_failed_ones_kept(client):
    done = create(client, "r/done")
    failed = create(client, "r/failed")
    ok(client.request("GetJob", name="r/done"))
    ok(client.request("FinishJob", jobID=done))
    ok(client.request("GetJob", name="r/failed"))
    ok(client.request("FailJob", jobID=failed))
    assert client.request("QueryJob", jobID=done).status == "404 No job with this jobID"
    assert ok(client.request("QueryJob", jobID=failed)).json["state"] == "FAILED"


def test_kept_finished_jobs_show_their_final_data_until_they_expire(make_server):
    server = make_server(keep_finished=1.0, keep_failed=1.0, prune_interval=0.05)
    with server.client() as client:
        done = create(client, "r/done", data={"step": 1}, unique=True)
        failed = create(client, "r/failed")
        ok(client.request("GetJobs", name="r/*", numResults=2))
        ok(client.request("FinishJob", jobID=done, data={"step": 2}))
        ok(client.request("FailJob", jobID=failed))
        job = ok(client.request("QueryJob", jobID=done)).json
        assert (job["state"], job["data"]) == ("FINISHED", {"step": 2})
        # A kept job is history: unique=true makes a new job.
        assert create(client, "r/done", unique=True) != done
        until(
            lambda: client.request("QueryJob", jobID=done).code == 404, DEADLINE, "pruning FINISHED"
        )
        until(
            lambda: client.request("QueryJob", jobID=failed).code == 404, DEADLINE, "pruning FAILED"
        )


def test_a_drained_database_shrinks_back(make_server, tmp_path):
    path = tmp_path / "jobs.db"
    store = Store(str(path))
    ended = "2026-01-01 00:00:00"
    store.begin()
    jobs = [
        NewJob(name=f"bulk/{i % 100}", next_run=ended,
               data='{"payload":"' + "x" * 100 + '"}', priority=500)
        for i in range(100_000)
    ]
    store.create(jobs, created=ended, state="FINISHED", ended=ended)
    store.commit()
    store.close()
    full = os.path.getsize(path)
    assert full > 10_000_000
    server = make_server(keep_finished=60.0, prune_interval=0.05)
    with server.client() as client:
        # Requests are served while the pruner works.
        create(client, "live")
        # 200 batches of deletes: generous, for a loaded machine.
        until(lambda: status(server)["jobs"] == {"QUEUED": 1}, DEADLINE * 6, "the pruner to drain")
        until(lambda: free_pages(path) < 256, DEADLINE * 6, "the pruner to reclaim the pages")
    server.stop()
    assert os.path.getsize(path) < full / 10


def free_pages(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        db.close()


# Schema version 3, parameters and the command line.


def v2_file(path: Path) -> Path:
    v1_file(path)
    db = sqlite3.connect(path)
    db.executescript(
        "ALTER TABLE jobs ADD COLUMN maxAttempts INTEGER NOT NULL DEFAULT 0;"
        "ALTER TABLE jobs ADD COLUMN retryBackoff TEXT NOT NULL DEFAULT '';"
        "ALTER TABLE jobs ADD COLUMN retryDelay REAL NOT NULL DEFAULT 0;"
        "ALTER TABLE jobs ADD COLUMN retryMaxDelay REAL NOT NULL DEFAULT 3600;"
        "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;"
        "ALTER TABLE jobs ADD COLUMN lastError TEXT NOT NULL DEFAULT '';"
        "ALTER TABLE jobs ADD COLUMN leaseID TEXT NOT NULL DEFAULT '';"
        "CREATE INDEX jobsFailedName ON jobs (name) WHERE state = 'FAILED';"
        "INSERT INTO jobs (created, state, name, nextRun, lastRun) VALUES "
        "('2026-01-01 00:00:00', 'FAILED', 'dead', '2026-01-01 00:00:00', '2026-01-02 00:00:00');"
        "PRAGMA user_version = 2;"
    )
    db.close()
    return path


def test_a_version_2_file_is_migrated_to_version_3(tmp_path):
    old = v2_file(tmp_path / "old.db")
    Store(str(old)).close()
    Store(str(tmp_path / "fresh.db")).close()
    assert SCHEMA_VERSION == 11
    assert layout(old) == layout(tmp_path / "fresh.db")
    db = sqlite3.connect(old)
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"limits", "paused"} <= tables
    assert db.execute("SELECT cost, ended FROM jobs WHERE name = 'dead'").fetchone() == (
        1, "2026-01-02 00:00:00")
    db.close()
    fresh = sqlite3.connect(tmp_path / "fresh.db")
    assert fresh.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    fresh.close()


def test_serve_options_for_flow_control():
    args = cli.build_parser().parse_args(
        ["serve", "--limit", "email/*=10", "--limit", "sms=2", "--keep-finished", "7d",
         "--keep-failed", "12h", "--limit", "api/*=rate:100/1m",
         "--limit", "t/*=2,rate:5/1s,perKey,fair"])
    assert dict(args.limit) == {
        "email/*": Limit(10), "sms": Limit(2), "api/*": Limit(rate=Rate(100, 60_000)),
        "t/*": Limit(2, Rate(5, 1000), per_key=True, fair=True),
    }
    assert (args.keep_finished, args.keep_failed) == (7 * 86400, 12 * 3600)
    bad_limits = ("email/*", "x=0", "x=perKey", "x=rate:5", "x=rate:0/1s", "x=rate:5/1w",
                  "x=rate:10001/1h", "x=rate:1/2d", "x=3,slow")
    for bad in (*(["--limit", text] for text in bad_limits), ["--keep-finished", "3w"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", *bad])
    assert [parse_duration(t) for t in ("0", "90", "90s", "30m")] == [0, 90, 90, 1800]


# A move that ends a run frees the job's capacity, whatever the move: here
# a parent that finishes and waits, PAUSED, for its children. Its child's
# name matches no waiter, so only the freed capacity can wake this one.


def test_a_parent_pausing_for_its_children_frees_its_capacity_for_waiters(server, client):
    ok(client.request("SetLimit", name="team/*", max=1))
    parent = create(client, "team/parent")
    assert client.request("GetJob", name="team/parent").code == 200
    create(client, "solo/child", parentJobID=parent)
    other = create(client, "team/other")
    waiter = Waiter(server, "team/other", timeout_ms=10_000)
    started = time.monotonic()
    ok(client.request("FinishJob", jobID=parent))
    reply = waiter.result()
    assert reply.code == 200 and reply.json["jobID"] == other
    # Woken by the freed capacity, not by the end of the wait.
    assert time.monotonic() - started < 8
