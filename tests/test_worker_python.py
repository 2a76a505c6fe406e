"""The in-process Python worker (jobserver.worker), end to end against a
real server: handlers run in the test process on a worker whose event loop
runs in a thread of its own (asyncio or trio), or `jobserver worker
MODULE:ATTR` as its own process when signals are the point.

Nothing sleeps for a fixed time: tests wait for the server's state or the
worker's log, each with a deadline."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from anyio.from_thread import start_blocking_portal

from conformance_helpers import query
from helpers import create, ok, until
from jobserver.worker import Job, RetryLater, Worker
from jobserver.worker.runner import Runner
from jobserver.worker.settings import Settings
from wire import Client

DEADLINE = 15.0
LOOPS = ("asyncio", "trio")
REPEAT = "FINISHED, +1 HOUR"  # a finished job stays, with its new data


class InProcess:
    """A worker running on an event loop in a thread of the test process."""

    def __init__(self, portal: Any, worker: Worker, settings: Settings) -> None:
        self.portal = portal
        self.runner: Runner = portal.call(Runner, worker, settings)
        self.future = portal.start_task_soon(self.runner.serve)

    def stop(self, grace: float = 0) -> int:
        if not self.future.done():
            self.portal.call(self.runner.stop, grace)
        status: int = self.future.result(timeout=DEADLINE)
        return status


@contextmanager
def in_process(worker: Worker, port: int, loop: str, **options: Any) -> Iterator[InProcess]:
    settings = Settings(port=port, signals=False, **options)
    with start_blocking_portal(backend=loop) as portal:
        running = InProcess(portal, worker, settings)
        try:
            yield running
        finally:
            running.stop()


def job(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def state(client: Client, job_id: int) -> str:
    return job(client, job_id)["state"]


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def not_reported(client: Client) -> list[dict[str, Any]]:
    return query(client, "SELECT jobID, state FROM jobs WHERE state IN ('RUNNING', 'RUNQUEUED');")


# Handlers: what each way of ending does to the job.


@pytest.mark.parametrize("loop", LOOPS)
def test_returns_exceptions_retries_and_timeouts_end_jobs_as_documented(server, client, loop):
    released = threading.Event()  # lets the timed-out thread end with the test
    worker = Worker(jobs="*")

    @worker.handler("data/sync")
    def add_one(data: dict[str, Any], job: Job) -> dict[str, Any]:
        return {"b": data["a"] + 1, "id": job.id, "attempt": job.attempt}

    @worker.handler("data/async")
    async def leave_alone(data: dict[str, Any]) -> None:
        await anyio.lowlevel.checkpoint()

    @worker.handler("fail/sync")
    def explode(data: dict[str, Any]) -> None:
        raise ValueError("boom")

    @worker.handler("fail/async")
    async def explode_later(data: dict[str, Any]) -> str:
        await anyio.lowlevel.checkpoint()
        return "not a dict"

    @worker.handler("later")
    async def later(data: dict[str, Any]) -> None:
        raise RetryLater(3600)

    @worker.handler("hang/sync", timeout=0.3)
    def hang(data: dict[str, Any]) -> None:
        released.wait(DEADLINE)

    @worker.handler("hang/async", timeout=0.3)
    async def hang_async(data: dict[str, Any]) -> None:
        await anyio.sleep_forever()

    policy = {"maxAttempts": 2, "retryBackoff": "fixed", "retryDelay": 0}
    ids = {
        "sync": create(client, "data/sync", data='{"a": 1}', repeat=REPEAT, **policy),
        "async": create(client, "data/async", data='{"keep": 1}', repeat=REPEAT),
        "raises": create(client, "fail/sync", **policy),
        "returns": create(client, "fail/async", maxAttempts=1),
        "later": create(client, "later", repeat=REPEAT),
        "hangs": create(client, "hang/sync", **policy),
        "hangs_async": create(client, "hang/async", maxAttempts=1),
        "unhandled": create(client, "nobody/takes/this"),
    }
    try:
        with in_process(worker, server.port, loop) as running:
            for key in ("raises", "returns", "hangs", "hangs_async", "unhandled"):
                until(lambda k=key: state(client, ids[k]) == "FAILED", DEADLINE, key)
            for key in ("sync", "async", "later"):
                until(lambda k=key: job(client, ids[k])["lastRun"], DEADLINE, key)
                until(lambda k=key: state(client, ids[k]) == "QUEUED", DEADLINE, key)
            assert running.stop() == 0
    finally:
        released.set()

    done = job(client, ids["sync"])
    assert done["data"] == {"b": 2, "id": ids["sync"], "attempt": 1}
    assert utc(done["nextRun"]) > datetime.now(UTC) + timedelta(minutes=59)
    assert job(client, ids["async"])["data"] == {"keep": 1}
    # An exception is a failed attempt: the retry policy ran it twice.
    raised = job(client, ids["raises"])
    assert raised["attempt"] == 2
    assert raised["lastError"].startswith("Traceback (most recent call last):")
    assert "in explode\n" in raised["lastError"]
    assert raised["lastError"].endswith("ValueError: boom\n")
    assert "calling.py" not in raised["lastError"]  # the worker's frames left out
    assert job(client, ids["returns"])["lastError"] == (
        "the handler returned str, not a dict or None"
    )
    # RetryLater is not a failure: the delay it asked for, ahead of the repeat.
    later_job = job(client, ids["later"])
    assert later_job["lastRun"] and later_job["data"] == {}
    assert utc(later_job["nextRun"]) > datetime.now(UTC) + timedelta(minutes=59)
    # A timeout is a failed attempt too; the thread cannot be stopped.
    hung = job(client, ids["hangs"])
    assert hung["attempt"] == 2
    assert hung["lastError"] == "timed out after 0.3s (its thread runs on, its result ignored)"
    assert job(client, ids["hangs_async"])["lastError"] == "timed out after 0.3s"
    assert "nobody/takes/this" in ok(client.request("FailedJobs")).body.decode()
    assert not_reported(client) == []


def test_handlers_are_checked_when_registered():
    worker = Worker()
    with pytest.raises(TypeError, match="data as its first parameter"):
        worker.handler("a")(lambda *, job: None)
    with pytest.raises(TypeError, match="cannot require extra"):
        worker.handler("a")(lambda data, extra: None)
    with pytest.raises(ValueError, match="no comma"):
        worker.handler("a,b")
    with pytest.raises(ValueError, match="timeout"):
        worker.handler("a", timeout=0)
    with pytest.raises(ValueError, match="delay"):
        RetryLater(-1)
    worker.handler("img/*")(lambda data: None)
    assert worker.get_jobs_name() == "img/*"
    worker.handler("email/*")(lambda data: None)
    with pytest.raises(ValueError, match="cannot be asked for in one GetJobs"):
        worker.get_jobs_name()
    names = Worker()
    for name in ("a", "b"):
        names.handler(name)(lambda data: None)
    assert names.get_jobs_name() == "a,b"


# Concurrency: N at once, threads and tasks together, batched.


@pytest.mark.parametrize("loop", LOOPS)
def test_a_thousand_jobs_run_eight_at_a_time_in_threads_and_tasks(server, client, loop):
    lock = threading.Lock()
    counts = {"now": 0, "peak": 0, "sync": 0, "async": 0}
    eight = threading.Event()  # eight handlers have run at once
    worker = Worker(jobs="mix/*")

    def enter(kind: str) -> None:
        with lock:
            counts["now"] += 1
            counts["peak"] = max(counts["peak"], counts["now"])
            counts[kind] += 1
            if counts["peak"] == 8:
                eight.set()

    def leave() -> None:
        with lock:
            counts["now"] -= 1

    @worker.handler("mix/sync")
    def in_thread(data: dict[str, Any]) -> None:
        enter("sync")
        eight.wait(5)  # the first ones wait until eight run together
        leave()

    @worker.handler("mix/async")
    async def in_task(data: dict[str, Any]) -> None:
        enter("async")
        if not eight.is_set():
            await anyio.to_thread.run_sync(eight.wait, 5)
        leave()

    jobs = [{"name": "mix/sync" if n % 2 else "mix/async"} for n in range(1000)]
    ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
    with in_process(worker, server.port, loop, concurrency=8) as running:
        until(lambda: counts["sync"] + counts["async"] == 1000, DEADLINE, "every handler call")
        assert running.stop() == 0  # once every report is delivered
    assert counts == {"now": 0, "peak": 8, "sync": 500, "async": 500}
    assert query(client, "SELECT count(*) AS n FROM jobs;") == [{"n": 0}]
