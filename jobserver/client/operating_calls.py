"""An operator's commands, shared by every client: the server's state
(Ping, Status, Queues, RunningJobs, History, Query), flow control
(SetLimit, PauseJobs, ResumeJobs), the dead set (FailedJobs, RequeueJobs,
and the bulk actions RequeueFailedJobs, DeleteFailedJobs,
CancelQueuedJobs) and Backup.

Apart from calls.py, which holds the `Call` these build and the commands
of a job's life, as the command line keeps them apart (cli/operating.py,
cli/bulk.py, cli/backup.py); the docstrings are the client methods' as
there (`documented_by`).
"""

from __future__ import annotations

from typing import Any

from jobserver.client.calls import Call, _body, _field, _nothing


def ping() -> Call[None]:
    """Check that the server answers."""
    return Call("Ping", {}, _nothing)


def status() -> Call[dict[str, Any]]:
    """The server's status: jobs per state, waiting GetJobs, connections,
    database size, uptime and version (protocol.md 5.14)."""
    return Call("Status", {}, _body)


def queues(limit: int | None) -> Call[dict[str, Any]]:
    """Each queue (a name up to its first `/`), the largest first: its
    jobs by state and how long its oldest ready job has waited
    (protocol.md 14.17)."""
    return Call("Queues", {"limit": limit}, _body)


def running_jobs(
    name: str | None, limit: int | None, newest: bool
) -> Call[dict[str, Any]]:
    """The jobs handed out now (RUNNING, and RUNQUEUED under a lease), the
    longest running first (`newest` for the last handed out first), each
    with the worker that took it and the node it was taken on; at most
    `limit` (1 to 1,000; 100 if None), only those whose name matches the
    GLOB `name` if given. Returns {"jobs": [...], "total", "more", "now"}
    (protocol.md 14.21)."""
    order = "newest" if newest else None
    return Call("RunningJobs", {"name": name, "limit": limit, "order": order}, _body)


def history(queue: str | None, minutes: int | None) -> Call[dict[str, Any]]:
    """What the queues did, minute by minute: jobs created, handed out,
    finished, failed and retried, and the depth, for the last `minutes`
    (the server's whole window if None) of one queue or of all; kept in
    the server's memory since it started (protocol.md 14.20)."""
    return Call("History", {"name": queue, "minutes": minutes}, _body)


def query(sql: str) -> Call[dict[str, Any]]:
    """Run one read-only SQL statement, ending in `;` (protocol.md 5.15;
    loopback clients only, unless the server allows others). Returns
    {"headers": [column names], "rows": [[values], ...]}, integers and
    finite reals as numbers, everything else as text (NULL as "")."""
    return Call("Query", {"query": sql, "format": "json"}, _body)


def failed_jobs(pattern: str, limit: int | None) -> Call[list[dict[str, Any]]]:
    """FAILED jobs whose name matches, oldest first, with their last error."""
    return Call("FailedJobs", {"name": pattern, "limit": limit}, _field("jobs"))


def requeue_jobs(job_ids: list[int], name: str | None) -> Call[None]:
    """Put jobs back in the queue, due now, whatever their state; a job with
    a retry policy gets all its attempts back. `name` renames them all.
    IDs of jobs that do not exist are skipped."""
    params: dict[str, object] = {"jobIDs": ",".join(map(str, job_ids)), "name": name}
    return Call("RequeueJobs", params, _nothing)


def set_limit(
    pattern: str, max: int, rate: str | None, per_key: bool, fair: bool
) -> Call[None]:
    """Limit the jobs whose name matches the GLOB `pattern` (protocol.md
    14.7, 14.23): at most `max` cost units of them run at once (0: no
    capacity); with `rate` ("N/DURATION", as "100/1m": N of 1 to 10,000 per
    1s to 1d), at most N of them are handed out in any window of DURATION;
    with `per_key`, `max` and `rate` count each job's `key` (create_job)
    apart; with `fair`, hand-outs rotate between keys. Each call replaces
    the pattern's whole limit, and `max` 0 without a rate and not fair
    removes it. A malformed rate is InvalidRequest (402); `per_key` alone
    is ValueError before sending: it would remove the limit, not set one."""
    if per_key and not (max or rate or fair):
        raise ValueError("per_key needs max, rate or fair: alone it holds nothing")
    params: dict[str, object] = {
        "name": pattern,
        "max": max,
        "rate": rate,
        # Off is left out: SetLimit reads an absent switch as off.
        "perKey": per_key or None,
        "fair": fair or None,
    }
    return Call("SetLimit", params, _nothing)


def pause_jobs(pattern: str) -> Call[None]:
    """Hand out no job whose name matches until resume_jobs(pattern)."""
    return Call("PauseJobs", {"name": pattern}, _nothing)


def resume_jobs(pattern: str) -> Call[None]:
    """Hand out the jobs that pause_jobs(pattern) held back; other paused
    patterns that match the same jobs still hold them."""
    return Call("ResumeJobs", {"name": pattern}, _nothing)


def _bulk(
    method: str,
    name: str | None,
    queue: str | None,
    job_ids: list[int] | None,
    limit: int | None,
    dry_run: bool,
) -> Call[dict[str, Any]]:
    ids = ",".join(map(str, job_ids)) if job_ids is not None else None
    params: dict[str, object] = {
        "name": name, "queue": queue, "jobIDs": ids, "limit": limit,
        "dryRun": "true" if dry_run else None,
    }
    return Call(method, params, _body)


def requeue_failed_jobs(
    name: str | None, queue: str | None, job_ids: list[int] | None, limit: int | None,
    dry_run: bool,
) -> Call[dict[str, Any]]:
    """Requeue FAILED jobs, due now, in one transaction: those whose name
    matches the GLOB `name`, those of `queue`, or those of `job_ids` (give
    one); at most `limit` (1,000 if None). With `dry_run`, nothing changes.
    Returns {"matched", "acted", "remaining", "jobIDs"} (protocol.md 14.19):
    call again while "remaining" is not 0. A search examines at most
    100,000 jobs; when more could match, "complete" is False and
    "examined" says how many: the counts are of those alone."""
    return _bulk("RequeueFailedJobs", name, queue, job_ids, limit, dry_run)


def delete_failed_jobs(
    name: str | None, queue: str | None, job_ids: list[int] | None, limit: int | None,
    dry_run: bool,
) -> Call[dict[str, Any]]:
    """Delete FAILED jobs, chosen and answered as requeue_failed_jobs'
    (protocol.md 14.19)."""
    return _bulk("DeleteFailedJobs", name, queue, job_ids, limit, dry_run)


def cancel_queued_jobs(
    name: str | None, queue: str | None, job_ids: list[int] | None, limit: int | None,
    dry_run: bool,
) -> Call[dict[str, Any]]:
    """Take QUEUED jobs out of the queue (a child is cancelled, any other
    job deleted), chosen and answered as requeue_failed_jobs' (protocol.md
    14.19)."""
    return _bulk("CancelQueuedJobs", name, queue, job_ids, limit, dry_run)


# How long a backup's reply may take beyond the client's timeout: the
# server copies and checks the whole database first; an hour is room for
# many gigabytes.
BACKUP_WAIT = 3600.0


def backup(name: str) -> Call[dict[str, Any]]:
    """Have the server copy its SQLite database, as it is at one moment,
    into a new file `name` in its backup directory (--backup-dir; a name,
    not a path) while it keeps serving; returns `{"bytes", "jobs", "name",
    "path", "seconds"}` of the copy, checked with quick_check (protocol.md
    14.18), `path` being where the server wrote it. The reply is awaited
    for up to an hour more than the timeout. An existing file is never
    overwritten (InvalidRequest); on PostgreSQL the server refuses with
    ServerError (501): use pg_dump."""
    return Call("Backup", {"name": name}, _body, held=BACKUP_WAIT)
