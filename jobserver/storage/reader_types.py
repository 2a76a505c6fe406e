"""What is read outside the writer, on connections of their own: the
`Readers` part of the Storage interface (interface.py), and what its
reads return (QueueStats, RunningJob, LaterJobs) or raise (a Query's
errors, and where its rows go, QueryRows).

Apart from interface.py because none of it is the writer's: a reader runs
in a thread while the writer goes on, and its types are those of Status,
Queues, RunningJobs, Query, Backup and the dashboard, not those of a
job's life.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from jobserver.model.jobs import Job
from jobserver.storage.backup_types import BackupCopy, BackupDirectory

# What metrics show of each queue (a name up to its first `/`): jobs by
# (queue, state); the nextRun of each queue's oldest job due now that no
# paused pattern holds; and how many jobs due now paused patterns hold.
QueueStats = tuple[dict[tuple[str, str], int], dict[str, str], dict[str, int]]


@dataclass(frozen=True)
class RunningJob:
    """What RunningJobs shows of a job handed out: never its data."""

    jobID: int
    name: str
    state: str
    # When it was handed out (lastRun), its nextRun (a RUNQUEUED job's
    # lease end), when it was handed out or last reported on (a RUNNING
    # job's, the stale-job net counts from it), and who took it.
    started: str | None
    next_run: str
    last_report: str
    worker: str
    node: str


# Jobs handed out, the longest running first, and how many there are in all.
RunningStats = tuple[list[RunningJob], int]


@dataclass(frozen=True)
class LaterJobs:
    """The dashboard's Scheduled or Retries: the soonest jobs, and how many
    there are, counted up to a bound."""

    jobs: list[Job]
    # How many there are; past the bound, the bound and `complete` false.
    matched: int
    complete: bool


class QueryRows(Protocol):
    """Where a backend puts what the Query command's SQL returns (its
    dialect is the backend's), a row at a time as it reads them, so that a
    reply past its bounds is refused before it is built: `add` raises
    OverflowError past `max_rows` rows and ReplyTooLarge past `max_bytes`."""

    max_rows: int
    max_bytes: int

    def start(self, headers: list[str]) -> None: ...

    def add(self, row: tuple[object, ...]) -> None: ...


class QueryTimeout(Exception):
    """A Query ran past its time."""


class BadQuery(Exception):
    """A Query's SQL cannot run: not valid, or not a read. Its text says why."""


class ReplyTooLarge(Exception):
    """A Query's reply would pass its byte bound (--max-reply-bytes)."""


class QueryUnavailable(Exception):
    """This backend cannot run Query as it is set up; the text is the
    status line's, after the code, and says how to enable it."""


class Readers(Protocol):
    """What is read outside the writer, each on a connection of its own
    (from another thread)."""

    def keep_statistics(self) -> bool:
        """Bring the planner's statistics of the jobs table up to date
        when they describe a table far smaller than it is (PostgreSQL);
        whether it did."""

    def prune_pending(self, before: Mapping[str, str], now: str) -> bool:
        """Whether the pruner has work, so that an idle server opens no
        transaction."""

    def run_query(self, sql: str, seconds: float, rows: QueryRows) -> None:
        """Run a client's read-only SQL, one statement, giving `rows` its
        column names and then each row as it is read. Raises QueryTimeout
        past `seconds`, BadQuery for SQL that is not one read,
        QueryUnavailable when the backend is not set up for Query, and lets
        what `rows` raises (the reply's bounds) through; one of `errors`
        when the database cannot be reached."""

    def queue_stats(self, now: str) -> QueueStats:
        """Jobs by queue and state, each queue's oldest due nextRun that no
        paused pattern holds, and the due jobs they hold: it reads every job."""

    def running_by_name(self, now: str) -> list[tuple[str, str, int]]:
        """The cost of the running jobs, as `usage` counts it, by name and
        key, for Status: (name, key, cost)."""

    def handouts_in_windows(self, windows: Mapping[str, str]) -> dict[str, int]:
        """For each rate's pattern, given where its window starts, the most
        hand-outs in the window of any one key (of the one, '', of a rate
        that counts keys together), for Status; a pattern with none in its
        window is left out."""

    def ready_by_queue(self) -> dict[str, int]:
        """The jobs QUEUED or RUNQUEUED (due or not) by queue, for the
        history's depth: only the jobs waiting to run are read, through an
        index of them."""

    def find_matching(self, pattern: str, limit: int) -> list[Job]:
        """Jobs in any state whose name matches a GLOB `pattern`, newest
        first: the dashboard's search. It may read every job."""

    def later_jobs(self, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
        """QUEUED jobs due after `now` (with `retrying`, only those with
        failed attempts), the soonest `limit`, and how many there are,
        counted up to `most` (sql.later_jobs)."""

    def running_jobs(
        self, now: str, pattern: str | None, limit: int, newest: bool = False
    ) -> RunningStats:
        """Up to `limit` jobs handed out now (RUNNING, and RUNQUEUED with a
        lease that has not ended) whose name matches a GLOB `pattern` (any
        with None), the longest running first (`newest`: the last handed
        out first), and how many match in all: RunningJobs. It reads the
        jobs handed out, through an index."""

    def backup(
        self, directory: BackupDirectory, name: str, stopped: Callable[[], bool]
    ) -> BackupCopy:
        """Copy the database as it is at one moment into a new file `name`
        (a plain file name, checked by the caller) in `directory`, while the
        writer goes on; check the copy and count its jobs. `stopped` is
        asked now and then: once it says True the copy is abandoned
        (BackupFailed). Raises BackupNameTaken (nothing is ever
        overwritten), BackupDirectoryUnusable, BackupFailed when the copy
        fails or fails its check (the partial file removed),
        BackupUnsupported on a backend that has other means (checked first)."""
