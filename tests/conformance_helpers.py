"""Helpers for the Bedrock::Jobs conformance tests (reference section 4).

Tests act and look only through the wire protocol (commands, QueryJob and the
read-only `Query`). States the protocol cannot reach, or that would take
minutes of waiting, are forced by writing the SQLite file directly, as
Bedrock's own tests do with `UPDATE` through Query.
"""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pg

from helpers import ok
from wire import Client, Reply

SECONDS = "%Y-%m-%d %H:%M:%S"

# Every wait in these tests polls with a deadline instead of sleeping a
# fixed time; this is the longest any single wait may take.
WAIT_SECONDS = 10.0
POLL_SECONDS = 0.1


# Replies.


def get_job(client: Client, name: str, **params: Any) -> dict[str, Any]:
    """GetJob that must hand out a job; returns the job object."""
    return ok(client.request("GetJob", name=name, **params)).json


def finish(client: Client, job_id: int, **params: Any) -> Reply:
    return ok(client.request("FinishJob", jobID=job_id, **params))


def no_job(client: Client, name: str) -> None:
    reply = client.request("GetJob", name=name)
    assert reply.status == "404 No job found", f"{reply.status} {reply.body!r}"


# Looking at the table through `Query` (a state through QueryJob).


def query(client: Client, sql: str) -> list[dict[str, Any]]:
    reply = ok(client.request("Query", query=sql, format="json"))
    body = reply.json
    return [dict(zip(body["headers"], row, strict=True)) for row in body["rows"]]


def row(client: Client, job_id: int) -> dict[str, Any] | None:
    """The job's row (NULL shows as ""), or None when there is no such row."""
    rows = query(client, f"SELECT * FROM jobs WHERE jobID = {int(job_id)};")
    assert len(rows) <= 1
    return rows[0] if rows else None


def state(client: Client, job_id: int) -> str | None:
    """The job's state as QueryJob shows it (its row's), or None when there
    is no such job: on SQLite each Query starts a process (some 0.1 s of
    CPU), and a state is most of what these tests look at."""
    reply = client.request("QueryJob", jobID=job_id)
    if reply.status == "404 No job with this jobID":
        return None
    return str(ok(reply).json["state"])


def count(client: Client, where: str = "TRUE") -> int:
    return query(client, f"SELECT COUNT(*) AS n FROM jobs WHERE {where};")[0]["n"]


# Writing the file behind the server's back.


def force(db: Path | str, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Run one write on the server's database and commit it: a SQLite file,
    or a PostgreSQL URL (`?` marks become `%s`)."""
    if isinstance(db, str) and db.startswith("postgresql://"):
        changed = pg.execute(db, sql.replace("?", "%s"), params)
        assert changed >= 1, f"forced write changed nothing: {sql}"
        return
    connection = sqlite3.connect(str(db), timeout=10)
    try:
        mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
        assert mode.lower() == "wal"
        cursor = connection.execute(sql, params)
        assert cursor.rowcount >= 1, f"forced write changed nothing: {sql}"
        connection.commit()
    finally:
        connection.close()


# Time.


def utcnow() -> datetime:
    return datetime.now(UTC)


def parse_time(text: str) -> datetime:
    """A stored time, `YYYY-MM-DD HH:MM:SS` with optional `.mmm`, as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def fmt(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(SECONDS)


def seconds_between(later: str, earlier: str) -> float:
    return (parse_time(later) - parse_time(earlier)).total_seconds()


def floor_second(moment: datetime) -> datetime:
    return moment.replace(microsecond=0)


def in_seconds(start: datetime, end: datetime, text: str) -> bool:
    """True when the stored time `text` is a second between start and end,
    both inclusive (Bedrock's isBetweenSecondsInclusive)."""
    return fmt(floor_second(start)) <= text[:19] <= fmt(floor_second(end))


def sleep_until(moment: datetime, margin: float = 0.05) -> None:
    """Sleep until the wall clock is past `moment`."""
    deadline = time.monotonic() + WAIT_SECONDS
    while utcnow() <= moment + timedelta(seconds=margin):
        assert time.monotonic() < deadline, f"{moment} is too far away"
        time.sleep(min(POLL_SECONDS, max(0.0, (moment - utcnow()).total_seconds() + margin)))


def wait_until_due(text: str) -> None:
    """Wait until a stored nextRun has come (a job is due when now >= nextRun)."""
    sleep_until(parse_time(text))


def poll(client: Client, method: str, **params: Any) -> Reply:
    """Repeat a GetJob/GetJobs until it answers 200; every other answer must
    be `404 No job found`."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        reply = client.request(method, **params)
        if reply.status == "200 OK":
            return reply
        assert reply.status == "404 No job found", f"{reply.status} {reply.body!r}"
        assert time.monotonic() < deadline, f"no job within {WAIT_SECONDS} s"
        time.sleep(POLL_SECONDS)


def raw_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
