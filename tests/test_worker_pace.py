"""The Python worker at speed, against a real server: jobs held beyond the
slots while handlers are fast (--prefetch), none while they are slow, held
jobs handed back at a stop; a line per finished job only at DEBUG, and a
summary of how jobs ended at INFO.

Nothing sleeps for a fixed time: tests wait for the server's state or the
worker's log, each with a deadline."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from typing import Any

import anyio
import pytest
from test_worker_python import DEADLINE, in_process

from helpers import create, ok, until
from jobserver.cli import main
from jobserver.worker import Worker
from jobserver.worker.settings import Settings
from wire import Client


def jobs(client: Client) -> dict[str, int]:
    """The server's jobs by state."""
    counts: dict[str, int] = ok(client.request("Status")).json["jobs"]
    return counts


def taken(client: Client) -> int:
    """Jobs handed out and not yet reported: running here or held."""
    counts = jobs(client)
    return counts.get("RUNNING", 0) + counts.get("RUNQUEUED", 0)


def assert_never_more_taken_than(client: Client, most: int) -> None:
    """For half a second, no more than `most` jobs are taken at a time."""
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert taken(client) <= most, jobs(client)


def fast_and_blocking(release: threading.Event) -> Worker:
    """A worker with a handler that ends at once and one that waits for
    `release` in a thread."""
    worker = Worker()

    @worker.handler("pace/fast")
    async def fast(data: dict[str, Any]) -> None:
        return None

    @worker.handler("pace/block")
    def block(data: dict[str, Any]) -> None:
        release.wait(DEADLINE)

    return worker


def warm_up(client: Client) -> None:
    """Run fast jobs to their end, so the worker knows its handlers are fast."""
    for _ in range(10):
        create(client, "pace/fast")
    until(lambda: not jobs(client), DEADLINE, "the first jobs to finish")


def test_a_fast_handler_gets_jobs_held_beyond_its_slots(server, client):
    release = threading.Event()
    worker = fast_and_blocking(release)
    with in_process(worker, server.port, "asyncio", concurrency=1, prefetch=10):
        warm_up(client)
        create(client, "pace/block", priority=1000)
        for _ in range(20):
            create(client, "pace/fast")
        # The one slot runs the blocking job; up to 10 fast ones are held
        # (topped up once 10 // 4, a fetcher's share of half, have room),
        # the rest left QUEUED for others.
        until(lambda: taken(client) >= 9, DEADLINE, "jobs held beyond the one slot")
        assert_never_more_taken_than(client, 11)
        release.set()
        until(lambda: not jobs(client), DEADLINE, "every job to finish")


def test_prefetch_0_takes_no_more_than_the_slots(server, client):
    release = threading.Event()
    worker = fast_and_blocking(release)
    with in_process(worker, server.port, "asyncio", concurrency=1, prefetch=0):
        warm_up(client)
        create(client, "pace/block", priority=1000)
        until(lambda: taken(client) == 1, DEADLINE, "the blocking job taken")
        for _ in range(5):
            create(client, "pace/fast")
        # A waiting GetJobs would take a fast job at once if it asked for one.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert taken(client) == 1
        release.set()
        until(lambda: not jobs(client), DEADLINE, "every job to finish")


def test_a_slow_handler_gets_no_jobs_held_beyond_its_slots(server, client):
    worker = Worker()

    @worker.handler("pace/slow")
    def slow(data: dict[str, Any]) -> None:
        time.sleep(0.6)  # longer than a held job may wait: prefetch.PREFETCH_HORIZON

    with in_process(worker, server.port, "asyncio", concurrency=1):
        create(client, "pace/slow")
        until(lambda: not jobs(client), DEADLINE, "the first job to finish")
        for _ in range(5):
            create(client, "pace/slow")
        most = 0
        while jobs(client):
            most = max(most, taken(client))
        # One running, and one whose report may be on its way as the next starts.
        assert most <= 2


def test_held_jobs_are_handed_back_at_a_stop_without_running(server, client, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker = Worker()
    ran: list[int] = []

    @worker.handler("pace/fast")
    async def fast(data: dict[str, Any], job: Any) -> None:
        ran.append(job.id)

    @worker.handler("pace/block")
    async def block(data: dict[str, Any]) -> None:
        await anyio.sleep_forever()

    with in_process(worker, server.port, "asyncio", concurrency=1, prefetch=10) as running:
        warm_up(client)
        ran.clear()
        create(client, "pace/block", priority=1000)
        held = {create(client, "pace/fast") for _ in range(10)}
        until(lambda: taken(client) >= 9, DEADLINE, "jobs held beyond the one slot")
        assert_never_more_taken_than(client, 11)
        assert running.stop(grace=0) == 0
    assert jobs(client) == {"QUEUED": 11}  # none run, none lost
    assert ran == []
    handed_back = [j for j in held if f"job {j} pace/fast handed back (stopping)" in caplog.text]
    assert len(handed_back) >= 8  # those held; the others were never taken


def finished_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records
        if r.levelno == level and " pace/fast finished in " in r.getMessage()
    ]


def test_finished_jobs_are_logged_ten_a_second_at_info_and_summed_up(server, client, caplog):
    caplog.set_level(logging.DEBUG, logger="jobserver.worker")
    worker = Worker()

    @worker.handler("pace/fast")
    def fast(data: dict[str, Any]) -> None:
        return None

    @worker.handler("pace/fails")
    def fails(data: dict[str, Any]) -> None:
        raise ValueError("boom")

    ids = [create(client, "pace/fast") for _ in range(100)]
    failing = create(client, "pace/fails")
    with in_process(worker, server.port, "asyncio") as running:
        until(lambda: jobs(client) == {"FAILED": 1}, DEADLINE, "the jobs to end")
        running.stop()
    # Each finished job has its line, at INFO for the first 10 of a second
    # of the worker's clock (which may straddle two of the log's).
    assert len(finished_lines(caplog, logging.INFO) + finished_lines(caplog, logging.DEBUG)) == 100
    by_second = Counter(int(r.created) for r in finished_lines(caplog, logging.INFO))
    assert 1 <= max(by_second.values()) <= 20, by_second
    if len(by_second) <= 2:  # the usual case: the 100 took at most a second or two
        assert len(finished_lines(caplog, logging.INFO)) < 100
    for job_id in ids:
        assert f"job {job_id} pace/fast finished in " in caplog.text
    failed_line = f"job {failing} pace/fails failed (ValueError: boom"
    assert any(r.levelno == logging.INFO and failed_line in r.getMessage() for r in caplog.records)
    assert re.search(r"101 jobs in the last \d+s: 100 finished, 1 failed", caplog.text)


def test_prefetch_is_range_checked(capsys):
    for wrong in (-1, 10_001, 1.5, True):
        with pytest.raises(ValueError, match="prefetch must be 0 to 10000"):
            Settings(prefetch=wrong)
    assert Settings(prefetch=0).prefetch == 0
    assert Settings(prefetch=10_000).prefetch == 10_000
    for wrong_text in ("-1", "10001", "1.5"):
        with pytest.raises(SystemExit) as exited:
            main(["worker", "jobs:worker", "--prefetch", wrong_text])
        assert exited.value.code == 2
        assert "--prefetch: must be a whole number from 0 to 10000" in capsys.readouterr().err
