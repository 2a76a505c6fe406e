"""Fetching: the tasks that ask the server for jobs, for the Runner
(runner.py), and the room they ask for.

FETCHERS tasks each ask with GetJobs, over a connection of their own, for
the slots (--concurrency) free when they ask and the jobs to hold beyond
them (prefetch.py), and only when there is room for one. They take turns
at waiting on the server: one waits there (a waiting GetJobs), the other
asks without waiting and, given nothing, waits for the waiting one's
answer. What a fetcher gets it hands to the Runner (`take`), which queues
it for a slot.

Apart from runner.py because it stands alone: the Runner sees only
`fetch_loop`, `slots_changed` when a job ends, and `stop`. A stop ends
each waiting GetJobs by shutting its connection's sending side, never
cutting off a reply on its way; a server that refuses our GetJobs, or
TLS with it, is told to the Runner (`on_refused`): trying again would
not help.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sized
from typing import Any

import anyio

from jobserver.client import ConnectionFailed, JobServerError, ServerError, TLSFailed
from jobserver.client.async_calls import end_wait
from jobserver.worker.connection import BACKOFF_MAX, Backoff, Link, Server
from jobserver.worker.prefetch import Prefetch
from jobserver.worker.settings import Settings
from jobserver.workers.manager import FETCH_WAIT, GetJobsRefused

log = logging.getLogger("jobserver.worker")

# GetJobs at a time: while one waits for its reply (or for jobs), another
# can ask for the slots that came free meanwhile, so that a fast handler's
# slots do not idle for a round trip.
FETCHERS = 2
# After a stop, how long a GetJobs may take to answer once its connection's
# sending side is shut (end_wait) before it is cancelled: its reply is
# on its way, or it was sent just after the stop, on a new connection.
END_WAIT_PATIENCE = 5.0
# The most one GetJobs hands out (protocol.md 5.4).
MAX_GET_JOBS = 1000


class Fetchers:
    """The fetchers of one run, the room they have reserved, and whose turn
    it is to wait on the server. Made on the event loop it runs on."""

    def __init__(
        self,
        server: Server,
        jobs_name: str,
        settings: Settings,
        prefetch: Prefetch,
        running: Sized,
        on_refused: Callable[[], None],
    ) -> None:
        self.server = server
        self.jobs_name = jobs_name
        self.settings = settings
        self.prefetch = prefetch
        self.running = running  # the Runner's jobs here: running, or waiting for a slot
        self.on_refused = on_refused
        self.reserved = 0  # slots asked for by GetJobs on their way
        self.freed = anyio.Event()  # set (and replaced) whenever slots come free
        # One fetcher at a time waits on the server (a waiting GetJobs); the
        # other asks without waiting, and, given nothing, waits here for the
        # waiting one's answer: an idle worker is one waiting GetJobs in the
        # server's Status (its idle workers), not one per fetcher.
        self.waiting_fetch = False
        self.wait_answered = anyio.Event()  # set (and replaced) at each answer
        self.stopping = False
        self.fetch_scope = anyio.CancelScope()
        self.fetch_links: list[Link] = []  # the fetchers' connections

    def stop(self) -> None:
        """Take no more jobs. From the event loop's thread."""
        self.stopping = True
        # A waiting GetJobs is ended, not cancelled: a reply already on its
        # way still arrives, and its jobs are handed back (run_job).
        for link in self.fetch_links:
            end_wait(link.client)
        self.slots_changed()  # a fetcher waiting for a slot
        self.fetch_scope.deadline = min(
            self.fetch_scope.deadline, anyio.current_time() + END_WAIT_PATIENCE
        )

    async def fetch_loop(self, take: Callable[[dict[str, Any]], bool]) -> None:
        """Take jobs and hand each to `take` (which says whether it started
        the job) until stopped or refused, with FETCHERS GetJobs at a time."""
        with self.fetch_scope:
            async with anyio.create_task_group() as fetchers:
                for _ in range(FETCHERS):
                    fetchers.start_soon(self._fetch, take)

    async def _fetch(self, take: Callable[[dict[str, Any]], bool]) -> None:
        """One fetcher: asks for the free slots, over a connection of its own."""
        link, backoff = Link(self.server, "taking jobs"), Backoff()
        self.fetch_links.append(link)
        try:
            while not self.stopping:
                if backoff.failing:
                    # Before waiting for room, which the other fetcher's
                    # waiting GetJobs may hold for a minute: is the server back?
                    await self._get_jobs(link, backoff, 0)
                    continue
                asked = await self.reserve_slots()
                waits = bool(asked) and not self.waiting_fetch
                try:
                    batch = await self._get_jobs(link, backoff, asked, waits) if asked else None
                finally:
                    self.reserved -= asked
                started = sum(take(job) for job in batch or ())
                if started < asked:
                    self.slots_changed()  # the other fetcher may ask for the rest
                if batch == [] and not waits and self.waiting_fetch:
                    await self.wait_answered.wait()  # nothing due: the waiting one will say
        except GetJobsRefused:
            self.on_refused()
        finally:
            self.fetch_links.remove(link)
            # Closing a connection left mid-request (END_WAIT_PATIENCE ran
            # out) tells the server, which puts back any job it took for us.
            await link.aclose()

    async def _get_jobs(
        self, link: Link, backoff: Backoff, free: int, waits: bool = True
    ) -> list[dict[str, Any]] | None:
        """One GetJobs for up to `free` jobs (0: none, only the Ping after a
        failure), waiting on the server for one if `waits`; None if the
        server could not be reached (after the next backoff wait)."""
        try:
            if backoff.failing:
                # A waiting GetJobs may not answer for a minute: make sure
                # the server is back, and say so, first.
                await link.client.ping()
                log.info("server %s reachable again; taking jobs", self.server.address)
                backoff.reset()
            if not free:
                return None
            if not waits:
                return await link.client.get_jobs(
                    self.jobs_name, free, lease=self.settings.lease or None
                )
            self.waiting_fetch = True
            try:
                return await link.client.get_jobs(
                    self.jobs_name, free, wait=FETCH_WAIT, lease=self.settings.lease or None
                )
            finally:
                self.waiting_fetch = False
                self.wait_answered.set()
                self.wait_answered = anyio.Event()
        except TLSFailed as error:
            log.error("cannot get jobs: %s", error)
            raise GetJobsRefused from error
        except (ConnectionFailed, ServerError) as error:
            if not backoff.failing:
                log.warning(
                    "cannot get jobs (%s); running jobs carry on, retrying with backoff up to %gs",
                    error,
                    BACKOFF_MAX,
                )
            await link.reconnect()
            if not self.stopping:
                await anyio.sleep(backoff.next())
            return None
        except JobServerError as error:
            log.error(
                "the server refused GetJobs for %r: %s %s", self.jobs_name, error.code, error.reason
            )
            raise GetJobsRefused from error

    async def reserve_slots(self) -> int:
        """Wait until a job may be taken: a slot free, or room to hold one
        beyond them (prefetch.py); reserve the room for one GetJobs (at
        most 1,000, as GetJobs takes), and return how much: 0 once the
        worker stops."""
        while (free := self._room() - len(self.running) - self.reserved) < self._worth_asking():
            if self.stopping:
                return 0
            await self.freed.wait()
        # Each fetcher asks for its share of the room: both keep a GetJobs
        # under way, so that neither waits for the other's reply.
        asked = min(free, MAX_GET_JOBS, -(-self._room() // FETCHERS))
        self.reserved += asked
        return asked

    def _worth_asking(self) -> int:
        """The least room a GetJobs asks for: a slot, or, while jobs are held
        beyond the slots, half of what may be held, so that the held jobs
        are topped up a batch at a time rather than a job at a time as
        each ends (a commit on the server each); a fetcher's share of
        that half."""
        return max(1, self.prefetch.allowed(anyio.current_time()) // (2 * FETCHERS))

    def _room(self) -> int:
        """How many jobs may be here at once: running, or waiting for a slot."""
        return self.settings.concurrency + self.prefetch.allowed(anyio.current_time())

    def slots_changed(self) -> None:
        """Wake a fetcher waiting for room: slots came free, or the stop."""
        # A new Event only when a fetcher waits on this one: at thousands of
        # jobs a second, making one per job would cost more than the job.
        if self.freed.statistics().tasks_waiting:
            self.freed.set()
            self.freed = anyio.Event()
