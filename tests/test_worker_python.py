"""The in-process Python worker (jobserver.worker), end to end against a
real server: handlers run in the test process on a worker whose event loop
runs in a thread of its own (asyncio or trio), or `jobserver worker
MODULE:ATTR` as its own process when signals are the point.

Nothing sleeps for a fixed time: tests wait for the server's state or the
worker's log, each with a deadline."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
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
from harness import LoggedProcess
from helpers import create, ok, until
from jobserver.cli import build_parser, main
from jobserver.client import Client as LibraryClient
from jobserver.model.globmatch import MAX_WILDCARDS
from jobserver.worker import Job, RetryLater, Worker
from jobserver.worker.arguments import settings_from
from jobserver.worker.fetching import END_WAIT_PATIENCE
from jobserver.worker.runner import Runner
from jobserver.worker.settings import Settings
from tls_certs import tls_server
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
def test_returns_exceptions_retries_and_timeouts_end_jobs_as_documented(
    server, client, loop, caplog
):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
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

    @worker.handler("fail/data")
    def not_json(data: dict[str, Any]) -> dict[str, Any]:
        return {"when": datetime.now(UTC)}

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
        "not_json": create(client, "fail/data", maxAttempts=1),
        "later": create(client, "later", repeat=REPEAT),
        "hangs": create(client, "hang/sync", **policy),
        "hangs_async": create(client, "hang/async", maxAttempts=1),
        "unhandled": create(client, "nobody/takes/this"),
    }
    try:
        with in_process(worker, server.port, loop) as running:
            for key in ("raises", "returns", "not_json", "hangs", "hangs_async", "unhandled"):
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
    assert job(client, ids["not_json"])["lastError"].startswith(
        "the handler returned data that is not JSON: Object of type datetime"
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
    assert f"worker started: server 127.0.0.1:{server.port}, jobs '*', 8 handlers" in caplog.text
    assert f"at most 8 at once, on {loop}" in caplog.text
    assert f"job {ids['hangs']} hang/sync: the thread of its handler " in caplog.text
    assert "<locals>.hang cannot be stopped; it runs on" in caplog.text
    assert re.search(
        rf"job {ids['raises']} fail/sync failed \(ValueError: boom; attempt 2 of 2, the last: "
        r"FAILED\) in ",
        caplog.text,
    )
    assert not_reported(client) == []


@pytest.mark.parametrize("loop", LOOPS)
def test_a_worker_asks_for_its_handlers_patterns_and_nothing_else(server, client, loop):
    """Handlers of two patterns, no `jobs=`: the worker takes the jobs of
    both, and leaves a job no handler takes to the workers that have one."""
    worker = Worker()
    worker.handler("thumb/*")(lambda data: {"thumb": True})
    worker.handler("email/*")(lambda data: {"email": True})
    other = create(client, "sms/1", repeat=REPEAT)
    ids = [create(client, name, repeat=REPEAT) for name in ("thumb/1", "email/1", "thumb/2")]
    with in_process(worker, server.port, loop):
        for job_id in ids:
            until(lambda j=job_id: job(client, j)["data"], DEADLINE, "a job")
        assert job(client, other) == {**job(client, other), "state": "QUEUED", "data": {}}


def test_a_paused_backlog_of_one_handlers_jobs_hides_no_job_of_another(server, client):
    """Issue 35's worker: handlers for a/noop and a/tp, 3,000 a/tp queued
    and paused. The worker's GetJobs passed over 1,000 of them and took
    nothing at all; it takes a/noop now."""
    worker = Worker()
    worker.handler("a/noop")(lambda data: {"ran": True})
    worker.handler("a/tp")(lambda data: {"ran": True})
    ok(client.request("PauseJobs", name="a/tp"))
    jobs = json.dumps([{"name": "a/tp"} for _ in range(3000)])
    ok(client.request("CreateJobs", jobs=jobs))
    free = create(client, "a/noop", repeat=REPEAT)
    with in_process(worker, server.port, "asyncio"):
        until(lambda: job(client, free)["data"], DEADLINE, "a/noop to run")
    assert job(client, free)["data"] == {"ran": True}


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
    with pytest.raises(ValueError, match="naive"):
        RetryLater(next_run=datetime(2030, 1, 1))
    worker.handler("img/*")(lambda data: None)
    assert worker.get_jobs_name() == "img/*"
    worker.handler("email/*")(lambda data: None)
    assert worker.get_jobs_name() == "img/*,email/*"
    too_many = Worker()
    for n in range(MAX_WILDCARDS + 1):
        too_many.handler(f"q{n}/*")(lambda data: None)
    with pytest.raises(ValueError, match="more than GetJobs takes at once"):
        too_many.get_jobs_name()
    names = Worker()
    for name in ("a", "b"):
        names.handler(name)(lambda data: None)
    assert names.get_jobs_name() == "a,b"

    with pytest.raises(ValueError, match="concurrency must be 1 to 10000"):
        Settings(concurrency=0)
    with pytest.raises(ValueError, match="grace must be seconds from 0 to 86400"):
        Settings(grace=math.inf)


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        (["--concurrency", "0"], "--concurrency: must be a whole number from 1 to 10000"),
        (["--concurrency", "10001"], "--concurrency: must be a whole number from 1 to 10000"),
        (["--timeout", "0"], "--timeout: must be a number above 0 and at most 604800"),
        (["--grace", "-1"], "--grace: must be a number from 0 to 86400"),
        (["--grace", "nan"], "--grace: must be a number from 0 to 86400"),
        (["--touch-interval", "3601"], "--touch-interval: must be a number above 0"),
        (["--job-name", " "], "--job-name: a job-name pattern must be a non-empty string"),
        (["--loop", "curio"], "--loop: invalid choice: 'curio'"),
        (["--server", "127.0.0.1:0"], "--server: "),
    ],
)
def test_options_out_of_range_are_usage_errors(capsys, options, complaint):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "jobs:worker", *options])
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_a_worker_that_cannot_run_is_refused_before_it_starts(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "two_patterns.py").write_text(
        "from jobserver.worker import Worker\n"
        "worker = Worker()\n"
        "worker.handler('a/*')(lambda data: None)\n"
        "worker.handler('b/*')(lambda data: None)\n"
        "too_many = Worker()\n"
        "for n in range(40):\n"
        "    too_many.handler(f'q{n}/*')(lambda data: None)\n"
        "not_a_worker = 1\n"
    )
    with pytest.raises(SystemExit) as exited:
        main(["worker", "two_patterns"])
    assert exited.value.code == 2
    assert main(["worker", "no_such_module_here:worker"]) == 2
    assert "cannot import no_such_module_here" in caplog.text
    assert main(["worker", "two_patterns:not_a_worker"]) == 2
    assert "two_patterns:not_a_worker is int, not a jobserver.worker.Worker" in caplog.text
    assert main(["worker", "two_patterns:too_many"]) == 2
    assert "more than GetJobs takes at once" in caplog.text
    assert "worker started" not in caplog.text


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
        # Idle: one fetcher's GetJobs waits at the server, the other for its
        # answer (test_worker_idle.py).
        until(lambda: client.request("Status").json["waitingGetJobs"] == 1, DEADLINE, "idle")
        # The waiting GetJobs ends at once (its connection half-closed),
        # and the other fetcher with it, not after END_WAIT_PATIENCE, when
        # they would be cut off.
        began = time.monotonic()
        assert running.stop() == 0  # once every report is delivered
        assert time.monotonic() - began < END_WAIT_PATIENCE / 2
    assert counts == {"now": 0, "peak": 8, "sync": 500, "async": 500}
    assert query(client, "SELECT count(*) AS n FROM jobs;") == [{"n": 0}]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_burst_of_failures_is_reported_in_batches_as_successes_are(server, client, loop):
    """Half the jobs fail and a quarter are put back: their reports go as
    FailJobs and RetryJobs of many jobs each, as the successes go as
    FinishJobs, not a request per job."""
    worker = Worker(jobs="burst/*")

    @worker.handler("burst/ok")
    async def fine(data: dict[str, Any]) -> None:
        return None

    @worker.handler("burst/bad")
    async def bad(data: dict[str, Any]) -> None:
        raise ValueError("no")

    @worker.handler("burst/later")
    async def later(data: dict[str, Any]) -> None:
        raise RetryLater(delay=3600)

    names = ["burst/bad", "burst/ok", "burst/bad", "burst/later"]
    jobs = [{"name": names[n % 4], "maxAttempts": 5, "retryDelay": 3600} for n in range(800)]
    ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
    answered = server.server.core.dispatcher.answered
    with in_process(worker, server.port, loop, concurrency=200) as running:
        # Every job reported: the 600 that failed or were put back are queued
        # again after a run, and the 200 that finished are gone (the search
        # hands burst/ok out last, so waiting for the 600 alone is not enough).
        until(lambda: query(client, "SELECT COUNT(*) AS n, SUM(state = 'QUEUED' "
                            "AND lastRun != '') AS reported FROM jobs;")
              == [{"n": 600, "reported": 600}],
              DEADLINE, "every job reported")
        assert running.stop() == 0
    single = ("finishjob", "failjob", "retryjob")
    one_by_one = sum(answered.get((verb, 200), 0) for verb in single)
    batches = {verb: answered.get((verb + "s", 200), 0) for verb in single}
    assert all(batches.values()), batches
    # Reports per request: far more than one.
    assert one_by_one + sum(batches.values()) <= 800 / 5, (one_by_one, batches)
    counts = query(client, "SELECT state, COUNT(*) AS n FROM jobs GROUP BY state ORDER BY state;")
    assert counts == [{"state": "QUEUED", "n": 600}], counts


# Leases.


def test_a_long_jobs_lease_is_renewed_and_a_handler_may_renew_its_own(server, client):
    ask, asked = threading.Event(), threading.Event()
    worker = Worker(jobs="lease/*")

    @worker.handler("lease/long")
    async def long(data: dict[str, Any]) -> dict[str, Any]:
        await anyio.sleep(3.5)
        return {"done": True}

    @worker.handler("lease/asks")
    def asks(data: dict[str, Any], job: Job) -> None:
        ask.wait(DEADLINE)
        job.renew_lease()
        asked.wait(DEADLINE)

    long_id = create(client, "lease/long", retryAfter="+2 SECONDS", repeat=REPEAT)
    asks_id = create(client, "lease/asks", retryAfter="+1 HOUR", repeat=REPEAT)
    with in_process(worker, server.port, "trio", touch_interval=3600) as running:
        for job_id in (long_id, asks_id):
            until(lambda j=job_id: state(client, j) == "RUNQUEUED", DEADLINE, "the hand-out")
        # A lease ends at a whole second: renewed within the second it was
        # taken, it would end at the same time.
        lease_end = utc(job(client, asks_id)["nextRun"])
        taken = lease_end - timedelta(hours=1)
        until(lambda: datetime.now(UTC) >= taken + timedelta(seconds=1), DEADLINE, "a second")
        ask.set()
        until(lambda: utc(job(client, asks_id)["nextRun"]) > lease_end, DEADLINE, "the renewal")
        asked.set()
        # The lease is two seconds (one to two, as the server counts from the
        # start of the second); the handler runs for 3.5: only renewals keep
        # the job from being handed to someone else meanwhile.
        while job(client, long_id)["data"] != {"done": True}:
            assert client.request("GetJob", name="lease/long").status == "404 No job found"
            time.sleep(0.05)
        assert running.stop() == 0
    assert state(client, long_id) == "QUEUED"


# Restarts.


def test_the_worker_carries_on_across_a_server_restart(start_server, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    started, proceed = threading.Event(), threading.Event()
    worker = Worker()

    @worker.handler("restart/*")
    def handle(data: dict[str, Any]) -> dict[str, Any]:
        if data.get("wait"):
            started.set()
            proceed.wait(DEADLINE)
        return {"done": data}

    first = start_server()
    port, db = first.port, first.db
    with first.client() as c:
        survivor = create(c, "restart/a", data='{"wait": true}', repeat=REPEAT)
    with in_process(worker, port, "asyncio") as running:
        assert started.wait(DEADLINE)
        first.kill()
        until(lambda: "cannot get jobs" in caplog.text, DEADLINE, "the fetchers to notice")
        proceed.set()
        until(lambda: f"cannot report job {survivor}" in caplog.text, DEADLINE, "a held report")

        second = start_server(db, "--port", str(port))
        with second.client() as c:
            until(
                lambda: job(c, survivor)["data"] == {"done": {"wait": True}},
                DEADLINE,
                "the held report",
            )
            after = create(c, "restart/b", repeat=REPEAT)
            until(lambda: job(c, after)["data"] == {"done": {}}, DEADLINE, "a new job")
        assert running.stop() == 0
    assert "reachable again; taking jobs" in caplog.text
    assert caplog.text.count(f"job {survivor} restart/a finished") == 1
    assert "jobs 'restart/*', 1 handler, at most" in caplog.text


# Signals: `jobserver worker` as users run it.

STOPPING = """
import time
from pathlib import Path

import anyio

from jobserver.worker import Worker

HERE = Path(__file__).parent
FINISH = HERE / "finish"  # made by the test
worker = Worker()


def started(job):
    (HERE / f"started-{job.id}").touch()


@worker.handler("stop/quick")
def quick(data, job):
    started(job)
    deadline = time.monotonic() + 15
    while not FINISH.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"finished": True}


@worker.handler("stop/stuck")
async def stuck(data, job):
    started(job)
    await anyio.sleep_forever()


@worker.handler("stop/hung")
def hung(data, job):
    started(job)
    time.sleep(3600)  # a thread nothing can stop
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_hands_back_every_job_it_does_not_let_finish(
    server, client, tmp_path, monkeypatch, signals
):
    (tmp_path / "stopping.py").write_text(STOPPING)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    running = {
        create(client, "stop/quick", repeat=REPEAT, priority=1000),
        create(client, "stop/quick", repeat=REPEAT, priority=1000),
        create(client, "stop/stuck", priority=1000),
        create(client, "stop/hung", priority=1000),
    }
    waiting = {create(client, "stop/quick", priority=0) for _ in range(3)}
    grace = "1" if signals == 1 else "60"
    proc = LoggedProcess(
        [
            sys.executable, "-m", "jobserver", "worker", "stopping:worker",
            "--server", f"127.0.0.1:{server.port}", "--concurrency", "4", "--grace", grace,
        ]
    )
    try:
        until(lambda: len(list(tmp_path.glob("started-*"))) == 4, DEADLINE, "4 handlers")
        signalled = time.monotonic()
        proc.signal(signal.SIGTERM)
        pattern = "received SIGTERM: taking no more jobs; 4 running"
        assert proc.matching(pattern, 1, DEADLINE), proc.log
        if signals == 1:
            (tmp_path / "finish").touch()
        else:
            proc.signal(signal.SIGTERM)
        status = proc.wait(DEADLINE)
    finally:
        proc.kill()
    took = time.monotonic() - signalled
    assert status == (0 if signals == 1 else 1), proc.log
    assert took < (1 + 3 if signals == 1 else 3), proc.log
    # None lost, none left RUNNING, none taken after the signal.
    assert client.request("Status").json["jobs"] == {"QUEUED": 7}
    for job_id in waiting:
        assert job(client, job_id)["lastRun"] == ""
    now = datetime.now(UTC)
    ended = {job_id: job(client, job_id) for job_id in running}
    finished = {j for j, row in ended.items() if row["data"] == {"finished": True}}
    handed_back = {j for j, row in ended.items() if utc(row["nextRun"]) <= now}
    assert len(finished) == (2 if signals == 1 else 0)
    assert handed_back == running - finished
    assert proc.log.count("handed back") == len(handed_back), proc.log
    if signals == 2:
        assert "received SIGTERM again: handing back 4 running jobs" in proc.log


# The connection options, as the command line reads them.


def test_the_worker_speaks_tls_with_tls_ca_and_sends_its_token(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker = Worker()

    @worker.handler("secure")
    async def secure(data: dict[str, Any]) -> dict[str, Any]:
        return {"secure": True}

    token = tmp_path / "token"
    token.write_text("w0rk")
    with tls_server(tmp_path / "tls", auth_token="w0rk") as (running, files):
        args = build_parser().parse_args(
            [
                "worker", "any:worker", "--server", f"127.0.0.1:{running.port}",
                "--tls-ca", str(files.ca), "--auth-token-file", str(token),
            ]
        )
        settings = settings_from(args)
        assert settings is not None
        with LibraryClient(
            "127.0.0.1", running.port, timeout=10, tls=files.ca, auth_token="w0rk"
        ) as jobs:
            job_id = jobs.create_job("secure", repeat=REPEAT)
            options = {"tls": settings.tls, "token": settings.token}
            with in_process(worker, running.port, "asyncio", **options):
                until(lambda: jobs.query_job(job_id)["data"] == {"secure": True}, DEADLINE, "it")
    assert f"server 127.0.0.1:{running.port} (TLS)" in caplog.text
