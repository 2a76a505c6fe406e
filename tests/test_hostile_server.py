"""A server that is broken or hostile cannot end a client, a worker or the
worker manager (issue 34, item 4): a reply that means nothing or is too
large to read is a broken connection, closed and replaced, whatever else
runs meanwhile; and a job handed out again while it runs is never run
twice at once.

The bad replies come from tests/hostile_front.py, a front on a real
loopback socket before a real server: every other request reaches the
real server. Nothing sleeps for a fixed time: tests wait for the server's
state or a log line, each with a deadline."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
from test_worker_python import REPEAT, in_process, job
from test_workers import python_worker

from harness import ThreadServer
from helpers import create, until
from hostile_front import FLOOD, FLOOD_HEAD, HostileFront, reply
from jobserver.client import AsyncClient, Client, ConnectionFailed, MalformedReply, TrioClient
from jobserver.wire.client_framing import ReplyReader
from jobserver.wire.limits import (
    DEFAULT_CLIENT_MAX_REPLY_BYTES,
    MAX_CLIENT_MAX_REPLY_BYTES,
    MIN_MAX_REPLY_BYTES,
)
from jobserver.worker import Job, Worker

DEADLINE = 15.0
PATTERN = "hostile/*"
# What a client may have taken of a flood before it closed the connection:
# the head, and what the socket buffers between held.
FLOOD_READ = 32 * 1024 * 1024

# Framed replies to GetJobs that mean nothing.
MEANINGLESS = {
    "not JSON": reply("200 OK", b"<html>Service Unavailable</html>"),
    "a job without a name": reply("200 OK", b'{"jobs":[{"jobID":7,"data":{}}]}'),
    "a list as jobID": reply("200 OK", b'{"jobs":[{"jobID":[7],"name":"hostile/x"}]}'),
    "a text as jobID": reply("200 OK", b'{"jobs":[{"jobID":"7","name":"hostile/x"}]}'),
    "jobs not a list": reply("200 OK", b'{"jobs":{"jobID":7,"name":"hostile/x"}}'),
}


@pytest.fixture
def front(server: Any) -> Iterator[HostileFront]:
    hostile = HostileFront(server.port)
    yield hostile
    hostile.close()


# The clients: one reply reader, one reading of replies, for all three.

CLIENTS = ("sync", "asyncio", "trio")


def get_jobs_twice(kind: str, port: int) -> list[object]:
    """Two GetJobs on one client of `kind`: what each returned or raised."""
    if kind == "sync":
        results: list[object] = []
        with Client("127.0.0.1", port) as client:
            for _ in range(2):
                try:
                    results.append(client.get_jobs(PATTERN, 5))
                except ConnectionFailed as error:
                    results.append(error)
        return results
    if kind == "asyncio":
        return anyio.run(_get_jobs_twice, AsyncClient("127.0.0.1", port), backend="asyncio")
    return trio.run(_get_jobs_twice, TrioClient("127.0.0.1", port))


async def _get_jobs_twice(client: AsyncClient | TrioClient) -> list[object]:
    results: list[object] = []
    async with client:
        for _ in range(2):
            try:
                results.append(await client.get_jobs(PATTERN, 5))
            except ConnectionFailed as error:
                results.append(error)
    return results


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("bad", MEANINGLESS.values(), ids=MEANINGLESS.keys())
def test_a_client_closes_a_connection_whose_reply_means_nothing(server, front, kind, bad):
    with server.client() as c:
        job_id = c.request("CreateJob", name="hostile/a").json["jobID"]
    front.answer_get_jobs_with(bad)

    first, second = get_jobs_twice(kind, front.port)

    assert isinstance(first, MalformedReply), first
    assert first.sent  # the server may have handed jobs out
    assert [job["jobID"] for job in second] == [job_id]  # type: ignore[attr-defined]
    assert front.connections == 2  # the first was closed, not read on


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_client_reads_no_reply_past_its_max_reply_bytes(server, front, kind):
    with server.client() as c:
        job_id = c.request("CreateJob", name="hostile/a").json["jobID"]
    # GetJobs is sent once more after a connection that broke: both floods.
    front.answer_get_jobs_with(FLOOD, FLOOD)

    first, second = get_jobs_twice(kind, front.port)

    assert isinstance(first, ConnectionFailed) and not isinstance(first, MalformedReply)
    assert "more than the 134,217,728 this client reads" in str(first)
    # The front counts a flood once it notices the client has closed.
    until(lambda: len(front.flooded) == 2, DEADLINE, "both floods to end")
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded
    assert [job["jobID"] for job in second] == [job_id]  # type: ignore[attr-defined]


def test_the_reply_reader_refuses_a_body_past_its_bound_before_reading_it():
    at_bound = ReplyReader(MIN_MAX_REPLY_BYTES)
    at_bound.feed(f"200 OK\r\nContent-Length: {MIN_MAX_REPLY_BYTES}\r\n\r\n".encode())
    assert at_bound.reply() is None  # waits for the body
    past = ReplyReader(MIN_MAX_REPLY_BYTES)
    past.feed(f"200 OK\r\nContent-Length: {MIN_MAX_REPLY_BYTES + 1}\r\n\r\n".encode())
    with pytest.raises(ValueError, match="more than the 4,194,304 this client reads"):
        past.reply()
    flood = ReplyReader()
    flood.feed(FLOOD_HEAD)
    with pytest.raises(ValueError, match="100,000,000,000 bytes announced"):
        flood.reply()


@pytest.mark.parametrize(
    "value", [MIN_MAX_REPLY_BYTES - 1, MAX_CLIENT_MAX_REPLY_BYTES + 1, 2**20 * 8.0, True]
)
def test_a_clients_max_reply_bytes_is_range_checked(value):
    with pytest.raises(ValueError, match="max_reply_bytes must be 4,194,304 to 2,147,483,648"):
        Client(max_reply_bytes=value)
    assert Client().max_reply_bytes == DEFAULT_CLIENT_MAX_REPLY_BYTES
    assert Client(max_reply_bytes=MAX_CLIENT_MAX_REPLY_BYTES).max_reply_bytes > 0


# The Python worker (jobserver worker), in this process.

WORKER_BAD = {**MEANINGLESS, "100 GB announced": FLOOD}


def bad_replies(bad: bytes | str) -> list[bytes | str]:
    """What to answer GetJobs with for `bad` to reach the worker: a
    GetJobs whose connection broke is sent once more by the client. Of
    two, each of the worker's two fetchers could take one and its retry
    be served (the worker saw nothing, once in CI); of three, the third
    goes to a retry, as each fetcher asks again at once."""
    return [bad] * 3 if bad == FLOOD else [bad]


def holding_python_worker() -> tuple[Worker, threading.Event, threading.Event]:
    """A Python worker whose jobs with `wait` set hold their slot until
    released: the worker, and the events `started` and `release`."""
    started, release = threading.Event(), threading.Event()
    worker = Worker()

    @worker.handler("hostile/*")
    def handle(data: dict[str, Any]) -> dict[str, Any]:
        if data.get("wait"):
            started.set()
            release.wait(DEADLINE)
        return {"done": True}

    return worker, started, release


@pytest.mark.parametrize("bad", WORKER_BAD.values(), ids=WORKER_BAD.keys())
def test_the_python_worker_keeps_its_jobs_across_a_reply_that_means_nothing(
    server, front, bad, caplog
):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker, started, release = holding_python_worker()

    with server.client() as c:
        running = create(c, "hostile/running", data='{"wait": true}', repeat=REPEAT)
        with in_process(worker, front.port, "asyncio", concurrency=4) as process:
            assert started.wait(DEADLINE)
            front.answer_get_jobs_with(*bad_replies(bad))
            # A job the fetchers' waiting GetJobs take; the next GetJobs is answered badly.
            before = create(c, "hostile/before", repeat=REPEAT)
            until(lambda: front.answered == len(bad_replies(bad)), DEADLINE, "the bad reply")
            after = create(c, "hostile/after", repeat=REPEAT)
            for job_id in (before, after):
                until(lambda j=job_id: job(c, j)["data"] == {"done": True}, DEADLINE, "a job")
            until(lambda: "reachable again; taking jobs" in caplog.text, DEADLINE, "a reconnect")
            release.set()
            until(lambda: job(c, running)["data"] == {"done": True}, DEADLINE, "the running job")
            assert process.stop() == 0
    assert "cannot get jobs" in caplog.text
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded


def test_the_python_worker_runs_a_job_handed_out_again_only_once(tmp_path, caplog):
    # The case: the job runs longer than --stale-after, so the
    # server counts the run lost and hands the job out again, to the same
    # worker (the only one), while it runs.
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    runs, release = [], threading.Event()
    worker = Worker()

    @worker.handler("dup/*")
    def handle(data: dict[str, Any], job: Job) -> dict[str, Any]:
        if data.get("long"):
            runs.append(job.lease_id)
            release.wait(DEADLINE)
            return {"ran": len(runs), "lease": job.lease_id}
        return {"ran": 1}

    server = ThreadServer(tmp_path / "jobs.db", stale_after=1.0)
    try:
        with server.client() as c:
            long = create(
                c, "dup/long", data='{"long": true}', repeat=REPEAT, maxAttempts=10,
                retryBackoff="fixed", retryDelay=0,
            )
            # Without a lease (--lease 0), which would keep the run alive.
            with in_process(worker, server.port, "trio", concurrency=4, lease=0) as process:
                until(lambda: "handed out again while it runs here" in caplog.text, DEADLINE,
                      "the second hand-out")
                other = create(c, "dup/other", repeat=REPEAT)
                until(lambda: job(c, other)["data"] == {"ran": 1}, DEADLINE, "another job")
                release.set()
                until(lambda: job(c, long)["data"].get("ran") == 1, DEADLINE, "the report")
                assert process.stop() == 0
            # Reported under the newest hand-out's lease: taken, not 409.
            assert job(c, long)["data"]["lease"] != runs[0]
    finally:
        server.stop()
    assert len(runs) == 1
    assert "Lease expired" not in caplog.text


# The worker manager (jobserver worker-manager), as its own process.

MANAGER_BAD = {
    "not JSON": MEANINGLESS["not JSON"],
    "a job without a name": MEANINGLESS["a job without a name"],
    "a list as jobID": MEANINGLESS["a list as jobID"],
    "100 GB announced": FLOOD,
}


def holding_worker(workers: Path, name: str) -> Path:
    """A worker that notes each start, then holds its job until `release`
    exists (within the deadline) if its data asks; its data: done."""
    python_worker(workers, name, f"""
job = json.load(sys.stdin)
here = {str(workers)!r}
open(os.path.join(here, f"started-{{job['jobID']}}-{{time.time_ns()}}"), "w").close()
deadline = time.monotonic() + {DEADLINE}
while job["data"].get("hold") and not os.path.exists(os.path.join(here, "release")):
    assert time.monotonic() < deadline
    time.sleep(0.02)
print(json.dumps({{"done": True}}))
""")
    return workers / "release"


def starts(workers: Path, job_id: int) -> int:
    return len(list(workers.glob(f"started-{job_id}-*")))


@pytest.mark.parametrize("bad", MANAGER_BAD.values(), ids=MANAGER_BAD.keys())
def test_the_manager_keeps_its_workers_across_a_reply_that_means_nothing(
    server, front, manager, workers, bad
):
    release = holding_worker(workers, "hold")
    with server.client() as c:
        running = create(c, "hostile/hold", data='{"hold": true}', repeat=REPEAT)
        process = manager(front.port, "--job-name", "hostile/*")
        until(lambda: starts(workers, running), DEADLINE, "the running worker")
        front.answer_get_jobs_with(*bad_replies(bad))
        before = create(c, "hostile/hold", repeat=REPEAT)
        until(lambda: front.answered == len(bad_replies(bad)), DEADLINE, "the bad reply")
        process.wait_for("cannot get jobs")
        process.wait_for("reachable again; taking jobs")
        after = create(c, "hostile/hold", repeat=REPEAT)
        for job_id in (before, after):
            until(lambda j=job_id: job(c, j)["data"] == {"done": True}, DEADLINE, "a job")
        release.touch()
        until(lambda: job(c, running)["data"] == {"done": True}, DEADLINE, "the running job")
        assert process.proc.poll() is None  # still serving
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded


def test_the_manager_runs_a_job_handed_out_again_only_once(tmp_path, manager, workers):
    release = holding_worker(workers, "hold")
    server = ThreadServer(tmp_path / "jobs.db", stale_after=1.0)
    try:
        with server.client() as c:
            long = create(
                c, "dup/hold", data='{"hold": true}', repeat=REPEAT, maxAttempts=10,
                retryBackoff="fixed", retryDelay=0,
            )
            # Without a lease, which would keep the run alive.
            process = manager(server.port, "--job-name", "dup/*", "--lease", "0")
            process.wait_for("handed out again while its worker runs")
            other = create(c, "dup/hold", repeat=REPEAT)
            until(lambda: job(c, other)["data"] == {"done": True}, DEADLINE, "another job")
            release.touch()
            until(lambda: job(c, long)["data"] == {"done": True}, DEADLINE, "the report")
            assert process.proc.poll() is None
            assert "Lease expired" not in process.log
    finally:
        server.stop()
    assert starts(workers, long) == 1


# A job listed twice in one GetJobs reply: run once, and the worker goes on.


def test_the_python_worker_runs_a_job_listed_twice_in_one_reply_once(server, front, caplog):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    runs: list[int] = []
    worker = Worker()

    @worker.handler("hostile/*")
    def handle(data: dict[str, Any], job: Job) -> dict[str, Any]:
        runs.append(job.id)
        return {"done": True}

    with server.client() as c:
        doubled = create(c, "hostile/doubled", repeat=REPEAT)
        front.double_jobs()
        with in_process(worker, front.port, "asyncio", concurrency=4) as process:
            until(lambda: front.answered, DEADLINE, "the doubled reply")
            until(lambda: job(c, doubled)["data"] == {"done": True}, DEADLINE, "the doubled job")
            after = create(c, "hostile/after", repeat=REPEAT)
            until(lambda: job(c, after)["data"] == {"done": True}, DEADLINE, "a later job")
            assert process.stop() == 0
    assert runs.count(doubled) == 1, runs
    assert "handed out again while it runs here" in caplog.text


def test_the_manager_runs_a_job_listed_twice_in_one_reply_once(server, front, manager, workers):
    holding_worker(workers, "hold")
    with server.client() as c:
        doubled = create(c, "hostile/hold", repeat=REPEAT)
        front.double_jobs()
        process = manager(front.port, "--job-name", "hostile/*")
        process.wait_for("handed out again while its worker runs")
        assert front.answered
        until(lambda: job(c, doubled)["data"] == {"done": True}, DEADLINE, "the doubled job")
        after = create(c, "hostile/hold", repeat=REPEAT)
        until(lambda: job(c, after)["data"] == {"done": True}, DEADLINE, "a later job")
        assert process.proc.poll() is None
    assert starts(workers, doubled) == 1


# A reply to a report (FinishJob) or a lease renewal (TouchJob) that means
# nothing is a broken connection: the report is sent again, the renewal
# tried again, and the other running jobs go on.

NOT_A_REPLY = b"<html>Service Unavailable</html>\r\n\r\n"
FINISH_BAD = {"not a status line": NOT_A_REPLY, "100 GB announced": FLOOD}
TOUCH_BAD = {
    "not JSON": MEANINGLESS["not JSON"],
    "a list": reply("200 OK", b"[]"),
    "null": reply("200 OK", b"null"),
    "a number": reply("200 OK", b"7"),
    "not a status line": NOT_A_REPLY,
}
# What each bad reply answers, and what the worker logs of it.
BAD_ANSWERS = [("FinishJob", bad, "cannot report job") for bad in FINISH_BAD.values()] + [
    ("TouchJob", bad, "cannot renew the lease") for bad in TOUCH_BAD.values()
]
BAD_IDS = [f"FinishJob, {name}" for name in FINISH_BAD] + [
    f"TouchJob, {name}" for name in TOUCH_BAD
]


@pytest.mark.parametrize(("command", "bad", "logged"), BAD_ANSWERS, ids=BAD_IDS)
def test_the_python_worker_keeps_its_jobs_across_a_bad_answer_to_a_report_or_renewal(
    server, front, command, bad, logged, caplog
):
    caplog.set_level(logging.INFO, logger="jobserver.worker")
    worker, started, release = holding_python_worker()

    with server.client() as c:
        running = create(c, "hostile/running", data='{"wait": true}', repeat=REPEAT)
        with in_process(
            worker, front.port, "trio", concurrency=4, touch_interval=0.2
        ) as process:
            assert started.wait(DEADLINE)
            front.answer_with(command, bad)
            quick = create(c, "hostile/quick", repeat=REPEAT)
            until(lambda: front.answered == 1, DEADLINE, f"the bad answer to {command}")
            until(lambda: job(c, quick)["data"] == {"done": True}, DEADLINE, "the quick job")
            until(lambda: logged in caplog.text, DEADLINE, "the broken connection logged")
            release.set()
            until(lambda: job(c, running)["data"] == {"done": True}, DEADLINE, "the running job")
            assert process.stop() == 0
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded


@pytest.mark.parametrize(("command", "bad", "logged"), BAD_ANSWERS, ids=BAD_IDS)
def test_the_manager_keeps_its_workers_across_a_bad_answer_to_a_report_or_renewal(
    server, front, manager, workers, command, bad, logged
):
    release = holding_worker(workers, "hold")
    with server.client() as c:
        running = create(c, "hostile/hold", data='{"hold": true}', repeat=REPEAT)
        process = manager(front.port, "--job-name", "hostile/*", "--touch-interval", "0.2")
        until(lambda: starts(workers, running), DEADLINE, "the running worker")
        front.answer_with(command, bad)
        quick = create(c, "hostile/hold", repeat=REPEAT)
        until(lambda: front.answered == 1, DEADLINE, f"the bad answer to {command}")
        until(lambda: job(c, quick)["data"] == {"done": True}, DEADLINE, "the quick job")
        process.wait_for(logged)
        release.touch()
        until(lambda: job(c, running)["data"] == {"done": True}, DEADLINE, "the running job")
        assert process.proc.poll() is None  # still serving
    assert all(taken < FLOOD_READ for taken in front.flooded), front.flooded


# The replies to FinishJobs and TouchJob, checked by every client: a shape
# the command never answers is a MalformedReply, never another exception.

FINISH_JOBS_BAD = {
    "not JSON": MEANINGLESS["not JSON"],
    "results not a list": reply("200 OK", b'{"results":{"jobID":7,"status":"200 OK"}}'),
    "a result too few": reply("200 OK", b'{"results":[]}'),
    "a result that is a list": reply("200 OK", b'{"results":[[7,"200 OK"]]}'),
    "a status that is a number": reply("200 OK", b'{"results":[{"jobID":7,"status":200}]}'),
    "a status that is no status": reply("200 OK", b'{"results":[{"jobID":7,"status":"OK"}]}'),
}
REPORTS_BAD = [("FinishJobs", bad) for bad in FINISH_JOBS_BAD.values()] + [
    ("TouchJob", bad) for bad in TOUCH_BAD.values() if bad is not NOT_A_REPLY
]
REPORTS_IDS = [f"FinishJobs, {name}" for name in FINISH_JOBS_BAD] + [
    f"TouchJob, {name}" for name, bad in TOUCH_BAD.items() if bad is not NOT_A_REPLY
]


def report_once(kind: str, port: int, command: str) -> object:
    """One FinishJobs or TouchJob of job 7 on a client of `kind`: what it returned or raised."""
    if kind == "sync":
        with Client("127.0.0.1", port) as client:
            try:
                if command == "FinishJobs":
                    return client.finish_jobs([(7, None, None)])
                return client.touch_job(7)
            except ConnectionFailed as error:
                return error
    if kind == "asyncio":
        return anyio.run(_report_once, AsyncClient("127.0.0.1", port), command, backend="asyncio")
    return trio.run(_report_once, TrioClient("127.0.0.1", port), command)


async def _report_once(client: AsyncClient | TrioClient, command: str) -> object:
    async with client:
        try:
            if command == "FinishJobs":
                return await client.finish_jobs([(7, None, None)])
            return await client.touch_job(7)
        except ConnectionFailed as error:
            return error


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize(("command", "bad"), REPORTS_BAD, ids=REPORTS_IDS)
def test_a_client_closes_a_connection_whose_report_reply_means_nothing(
    server, front, kind, command, bad
):
    front.answer_with(command, bad)
    assert isinstance(report_once(kind, front.port, command), MalformedReply)


# Every call of a client whose reply has a body, answered with JSON that is
# no object: a MalformedReply, never the AttributeError of a `.get` on a
# list (the calls' readers are shared by the three clients).
CALLS_READING_A_BODY: dict[str, Callable[[Client], object]] = {
    "AwaitJob": lambda c: c.await_job(7, timeout=1),
    "QueryJob": lambda c: c.batch_progress(7),
    "GetJob": lambda c: c.get_job(PATTERN),
    "GetJobs": lambda c: c.get_jobs(PATTERN, 2),
    "CreateJob": lambda c: c.create_job("hostile/x"),
    "CreateJobs": lambda c: c.create_jobs([{"name": "hostile/x"}]),
    "Status": lambda c: c.status(),
    "Queues": lambda c: c.queues(),
    "RunningJobs": lambda c: c.running_jobs(),
    "History": lambda c: c.history(),
    "FailedJobs": lambda c: c.failed_jobs(),
    "CancelledJobs": lambda c: c.cancelled_jobs([7]),
    "DeliverReply": lambda c: c.deliver_reply("k", {}),
}


@pytest.mark.parametrize("body", [b"[]", b"null", b"7", b'"text"'])
@pytest.mark.parametrize("command", CALLS_READING_A_BODY)
def test_a_reply_whose_json_is_no_object_is_malformed(server, front, command, body):
    front.answer_with(command, reply("200 OK", body))
    with Client("127.0.0.1", front.port) as client, pytest.raises(MalformedReply):
        CALLS_READING_A_BODY[command](client)
