"""The core on trio's MockClock: waiting GetJobs, leases and deadlines.

Hours of job time pass in milliseconds of real time. The writer runs its
batches on the event loop (threaded=False), the core's clock follows
trio's, and the autojump clock moves time on whenever every task waits.
So each moment asserted is exact: seconds since the core started, as
trio counts them, with times in the database read against EPOCH.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from jobserver.core.build import build_core
from jobserver.core.commands import create as commands
from jobserver.core.commands.dispatch import Dispatcher
from jobserver.core.commands.params import MAX_WAIT_MS
from jobserver.core.commands.replies import REPLY_TIMEOUT
from jobserver.core.commands.route import Undo
from jobserver.core.engine.context import DEFAULT_STALE_AFTER, Settings
from jobserver.core.engine.engine import Engine
from jobserver.core.engine.stale import lost_error
from jobserver.core.engine.work import Call
from jobserver.core.rules.leases import LEASE_EXPIRED, MAX_LEASES
from jobserver.model import times
from jobserver.storage.backends import open_store
from jobserver.storage.interface import Storage
from jobserver.wire.framing import Request, Response

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
HOUR = 3600.0
PEER = "127.0.0.1"
# Whole tests take a fraction of this; far more means something slept for real.
REAL_SECONDS = 20.0


def stamp(seconds: float) -> str:
    """The stored time `seconds` after EPOCH, to the millisecond."""
    return times.to_millis(EPOCH + timedelta(seconds=seconds))


class TrioClock:
    """The core's clock, following trio's (mock) clock from `epoch`."""

    def __init__(self, epoch: datetime = EPOCH) -> None:
        self._start = trio.current_time()
        self._epoch = epoch

    def now(self) -> datetime:
        return self._epoch + timedelta(seconds=self.elapsed())

    def elapsed(self) -> float:
        return trio.current_time() - self._start


@dataclass
class Waiting:
    """A GetJob with `Connection: wait`, and when and how it was answered."""

    response: Response | None = None
    undo: Undo | None = None
    at: float | None = None

    def job(self) -> dict[str, Any]:
        assert self.response is not None and self.response.code == 200, self.response
        body: dict[str, Any] = json.loads(self.response.body)
        return body


@dataclass
class Core:
    """Store, engine and dispatcher, built as the server builds them."""

    store: Storage
    engine: Engine
    dispatcher: Dispatcher
    clock: TrioClock
    nursery: trio.Nursery

    async def send(self, verb: str, **headers: object) -> Response:
        answer = await self.dispatcher.dispatch(request(verb, **headers), PEER)
        return answer.response

    async def json(self, verb: str, **headers: object) -> dict[str, Any]:
        response = await self.send(verb, **headers)
        assert response.code == 200, response.status
        body: dict[str, Any] = json.loads(response.body)
        return body

    async def create(self, **headers: object) -> int:
        job_id: int = (await self.json("CreateJob", **headers))["jobID"]
        return job_id

    async def failed(self) -> list[tuple[int, str]]:
        """FailedJobs: each job's ID and last error."""
        return [(j["jobID"], j["lastError"]) for j in (await self.json("FailedJobs"))["jobs"]]

    async def state(self, job_id: int) -> str:
        return str((await self.json("QueryJob", jobID=job_id))["state"])

    async def wait_for(self, name: str, timeout_ms: int) -> Waiting:
        """Start a waiting GetJob; it is in the wait queue when this returns."""
        waiting = Waiting()
        await self.nursery.start(self._wait, name, timeout_ms, waiting)
        return waiting

    async def _wait(
        self, name: str, timeout_ms: int, waiting: Waiting, task_status: trio.TaskStatus[None]
    ) -> None:
        # The dispatch joins the wait queue before its first checkpoint, so
        # waiters queue in the order they were started.
        task_status.started()
        answer = await self.dispatcher.dispatch(
            request("GetJob", name=name, connection="wait", timeout=timeout_ms), PEER
        )
        waiting.response, waiting.undo = answer.response, answer.undo
        waiting.at = self.clock.elapsed()

    async def at(self, seconds: float) -> None:
        """Let mock time run to `seconds`, and everything due then happen."""
        assert self.clock.elapsed() <= seconds
        await trio.sleep(seconds - self.clock.elapsed())
        await trio.testing.wait_all_tasks_blocked()


def request(verb: str, **headers: object) -> Request:
    return Request(verb, {k.lower(): str(v) for k, v in headers.items()})


@asynccontextmanager
async def running_core(
    tmp_path: Path,
    stale_after: float = DEFAULT_STALE_AFTER,
    db: str | None = None,
    epoch: datetime = EPOCH,
) -> AsyncIterator[Core]:
    """The core on `db` (a PostgreSQL URL; by default a SQLite file in
    tmp_path), its clock starting at `epoch`."""
    started = time.monotonic()
    # NORMAL: these tests are about time, not about surviving a power cut.
    store = open_store(db or str(tmp_path / "jobs.db"), "NORMAL", {})
    clock = TrioClock(epoch)
    settings = Settings(stale_after=stale_after, serving_since=stamp(0))

    # As the server builds it, with every batch on the event loop.
    core = build_core(store, clock, settings, threaded=False)
    core.engine.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.engine.run)
            yield Core(store, core.engine, core.dispatcher, clock, nursery)
            nursery.cancel_scope.cancel()
    finally:
        await core.engine.stop()
        store.close()
    assert time.monotonic() - started < REAL_SECONDS


# The wait queue.


async def test_a_waiter_is_served_when_a_future_job_becomes_due(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="report", firstRun=stamp(HOUR)[:19])
        await core.at(HOUR / 2)
        waiting = await core.wait_for("report", MAX_WAIT_MS)
        await core.at(HOUR - 0.001)
        assert waiting.at is None and await core.state(job_id) == "QUEUED"
        await core.at(HOUR)
        # Served by the clock at the job's firstRun, half an hour before
        # the wait's own timeout would have ended it.
        assert waiting.at == HOUR
        assert waiting.job()["jobID"] == job_id
        assert await core.state(job_id) == "RUNNING"


async def test_a_wait_ends_at_its_timeout_and_timeout_zero_still_gets_a_due_job(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        short = await core.wait_for("nothing", 90_000)
        # Longer than allowed: cut to MAX_WAIT_MS (an hour).
        long = await core.wait_for("nothing", 7_200_000)
        at_once = await core.wait_for("nothing", 0)
        await core.at(2 * HOUR)
        assert (short.at, long.at, at_once.at) == (90.0, MAX_WAIT_MS / 1000, 0.0)
        for waiting in (short, long, at_once):
            assert waiting.response is not None and waiting.response.status == "404 No job found"
        job_id = await core.create(name="now")
        zero = await core.wait_for("now", 0)
        await core.at(2 * HOUR)
        assert zero.at == 2 * HOUR and zero.job()["jobID"] == job_id


async def test_waiters_are_served_oldest_first_with_one_query_per_pass(
    tmp_path: Path, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_core(tmp_path) as core:
        waiters = [await core.wait_for("bulk", MAX_WAIT_MS) for _ in range(1000)]
        await core.at(10)
        assert len(core.engine.waits) == 1000
        searches = 0
        find_ready = core.store.find_ready

        def counted(**query: Any) -> Any:
            nonlocal searches
            searches += 1
            return find_ready(**query)

        monkeypatch.setattr(core.store, "find_ready", counted)
        batches = core.engine.batches
        jobs = json.dumps([{"name": "bulk"}] * 3)
        ids = (await core.json("CreateJobs", jobs=jobs))["jobIDs"]
        await trio.testing.wait_all_tasks_blocked()
        # Stored and handed to the three oldest waiters in one transaction;
        # three searches found a job, one found none, and the other 996
        # waiters on the same name were not searched for.
        assert core.engine.batches == batches + 1
        assert searches == 4
        assert [w.job()["jobID"] for w in waiters[:3]] == ids
        assert [w.at for w in waiters[:3]] == [10.0] * 3
        assert all(w.at is None for w in waiters[3:])
        await core.at(HOUR)
        assert {w.at for w in waiters[3:]} == {HOUR}


async def test_a_job_that_an_older_waiters_try_missed_is_not_handed_past_it(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        older = await core.wait_for("fifo, other", MAX_WAIT_MS)
        younger = await core.wait_for("fifo", MAX_WAIT_MS)
        await core.at(1)
        # The older waiter's try (another of its names became ready) and
        # the job's creation share a batch, the try first, so it looks
        # before the job exists; the younger waiter is idle.
        core.engine.notify({"other"}, None)
        create = request("CreateJob", name="fifo")
        core.engine.submit(Call(partial(commands.create_job, request=create)))
        await core.at(2)
        assert older.job()["name"] == "fifo"
        assert younger.at is None
        await core.create(name="fifo")
        await trio.testing.wait_all_tasks_blocked()
        assert younger.job()["name"] == "fifo"


# Leases.


async def test_an_unreported_lease_runs_out_hourly_until_out_of_leases(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="leased", retryAfter="+1 HOUR")
        first = await core.send("GetJob", name="leased")
        assert first.code == 200
        tokens = [first.headers["leaseID"]]
        job = await core.json("QueryJob", jobID=job_id)
        assert (job["state"], job["nextRun"]) == ("RUNQUEUED", stamp(HOUR)[:19])
        for hour in range(1, MAX_LEASES + 1):
            # A worker starts waiting half an hour before the lease ends.
            await core.at((hour - 0.5) * HOUR)
            waiting = await core.wait_for("leased", MAX_WAIT_MS)
            await core.at(hour * HOUR)
            if hour < MAX_LEASES:
                assert waiting.at == hour * HOUR
                assert waiting.job()["jobID"] == job_id
                assert waiting.response is not None
                tokens.append(waiting.response.headers["leaseID"])
        assert len(set(tokens)) == MAX_LEASES
        # The first worker's lease is long gone.
        gone = await core.send("FinishJob", jobID=job_id, leaseID=tokens[0])
        assert gone.status == "409 Lease expired"
        # The eleventh hand-out fails the job instead; the waiter goes on waiting.
        assert await core.state(job_id) == "FAILED"
        assert waiting.at is None
        out_of_leases = f"out of leases: handed out {MAX_LEASES} times without a report"
        assert await core.failed() == [(job_id, out_of_leases)]
        await core.at(MAX_LEASES * HOUR + HOUR / 2)
        assert waiting.at == MAX_LEASES * HOUR + HOUR / 2


async def test_a_retry_policy_counts_expired_leases_as_attempts(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="leased", retryAfter="+1 HOUR", maxAttempts=3)
        assert (await core.json("GetJob", name="leased"))["attempt"] == 1
        for hour in (1, 2, 3):
            await core.at((hour - 0.5) * HOUR)
            waiting = await core.wait_for("leased", MAX_WAIT_MS)
            await core.at(hour * HOUR)
            if hour < 3:
                assert waiting.at == hour * HOUR
                assert waiting.job()["attempt"] == hour + 1
        job = await core.json("QueryJob", jobID=job_id)
        assert (job["state"], job["attempt"], job["lastError"]) == ("FAILED", 3, LEASE_EXPIRED)
        assert waiting.at is None


async def test_touch_job_moves_the_end_of_the_lease(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="leased", retryAfter="+1 HOUR")
        lease = (await core.send("GetJob", name="leased")).headers["leaseID"]
        await core.at(HOUR / 2)
        touched = await core.json("TouchJob", jobID=job_id, leaseID=lease)
        assert touched == {"nextRun": stamp(1.5 * HOUR)[:19]}
        await core.at(0.75 * HOUR)
        waiting = await core.wait_for("leased", MAX_WAIT_MS)
        await core.at(HOUR)
        assert waiting.at is None and await core.state(job_id) == "RUNQUEUED"
        await core.at(1.5 * HOUR)
        assert waiting.at == 1.5 * HOUR
        assert waiting.response is not None and waiting.response.headers["leaseID"] != lease


# Deadlines the clock fires for with nobody waiting.


async def test_a_reply_deadline_fails_the_job_on_time(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="approval")
        await core.json("GetJob", name="approval")
        parked = await core.json("AwaitReply", jobID=job_id, key="order-1", timeout=600)
        assert parked == {"state": "WAITING", "replyDeadline": stamp(600)}
        await core.at(599.999)
        assert await core.state(job_id) == "WAITING"
        await core.at(600)
        assert await core.state(job_id) == "FAILED"
        assert await core.failed() == [(job_id, REPLY_TIMEOUT)]


async def test_a_reply_deadline_requeues_a_job_with_a_retry_policy(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(
            name="approval", maxAttempts=2, retryBackoff="fixed", retryDelay=60
        )
        await core.json("GetJob", name="approval")
        await core.json("AwaitReply", jobID=job_id, key="order-2", timeout=600)
        await core.at(600)
        job = await core.json("QueryJob", jobID=job_id)
        assert (job["state"], job["nextRun"]) == ("QUEUED", stamp(660))
        assert job["lastError"] == REPLY_TIMEOUT
        waiting = await core.wait_for("approval", MAX_WAIT_MS)
        await core.at(660)
        assert waiting.at == 660.0
        assert waiting.job()["attempt"] == 2


async def test_a_silent_running_job_goes_stale_at_its_deadline(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path, stale_after=2 * HOUR) as core:
        job_id = await core.create(name="lost")
        await core.json("GetJob", name="lost")
        await core.at(HOUR)
        # A report: the safety net counts from here.
        assert await core.json("TouchJob", jobID=job_id) == {"staleAt": stamp(3 * HOUR)}
        await core.at(2 * HOUR)
        assert await core.state(job_id) == "RUNNING"
        await core.at(3 * HOUR - 0.001)
        assert await core.state(job_id) == "RUNNING"
        await core.at(3 * HOUR)
        assert await core.state(job_id) == "FAILED"
        assert await core.failed() == [(job_id, lost_error(2 * HOUR))]


# Giving back.


async def test_a_hand_out_given_back_is_as_before_and_goes_to_a_waiter(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    async with running_core(tmp_path) as core:
        job_id = await core.create(name="gb", retryAfter="+1 HOUR", data='{"n":1}')
        before = await core.json("QueryJob", jobID=job_id)
        first = await core.wait_for("gb", 0)
        await core.at(5)
        assert first.at == 0.0 and await core.state(job_id) == "RUNQUEUED"
        second = await core.wait_for("gb", MAX_WAIT_MS)
        await core.at(10)
        assert first.undo is not None and first.undo.job_ids == (job_id,)
        first.undo.run()
        await trio.testing.wait_all_tasks_blocked()
        # Back in the queue and at once to the waiter, with the same data:
        # the hand-out that never arrived did not count as a lease.
        assert second.at == 10.0
        assert second.job() == first.job()
        await core.at(20)
        assert second.undo is not None
        second.undo.run()
        await trio.testing.wait_all_tasks_blocked()
        assert await core.json("QueryJob", jobID=job_id) == before
