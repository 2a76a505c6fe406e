"""Many jobs in a state, made fast for the tests of bulk actions: created
with CreateJobs, taken with GetJobs and failed with pipelined FailJobs, or,
for a hundred thousand queued, written to the table before the server
starts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg

from helpers import ok
from jobserver.storage.sqlite import Store
from jobserver.wire.limits import BULK_TEST_BUDGET, MAX_RESULTS
from wire import Client, encode

# A costly pattern, a star then a long literal, matching the names
# costly_name(i), and how many jobs a search for it examines: the budget
# over what it may cost to test a name, 1 unit and 5 for each of the 241
# bytes from its star (globmatch.match_cost).
COSTLY = ("n/*" + "x" * 240, BULK_TEST_BUDGET // (1 + 5 * 241))


def costly_name(i: int) -> str:
    return f"n/{i}" + "x" * 240


def create_many(
    client: Client, names: list[str], headers: dict[str, str] | None = None
) -> list[int]:
    """CreateJobs of one job per name; their jobIDs, in order."""
    jobs = [{"name": name} for name in names]
    ids: list[int] = ok(client.request("CreateJobs", headers, jobs=jobs)).json["jobIDs"]
    assert len(ids) == len(names)
    return ids


# When stored_queued's jobs were created and are due: long past.
STORED_AT = "2026-01-01 00:00:00"


def stored_queued(db: Path | str, names: list[str]) -> None:
    """QUEUED jobs of these names written straight to the jobs table, in
    one transaction, before a server starts on it (a SQLite file gets the
    schema a server makes first). For tests of what is done with a great
    many jobs, not of their creation: 101,000 through queue_many cost the
    bound's test 15 to 45 s of CPU and wall on PostgreSQL, 8 to 20 on
    SQLite; written here, about a second."""
    rows = [(STORED_AT, "QUEUED", name, STORED_AT) for name in names]
    columns = "created, state, name, nextRun"
    if isinstance(db, Path):
        Store(str(db)).close()
        with sqlite3.connect(db) as raw:
            raw.execute("PRAGMA synchronous = OFF")
            raw.executemany(f"INSERT INTO jobs ({columns}) VALUES (?, ?, ?, ?)", rows)
        raw.close()
        return
    with (
        psycopg.connect(db) as conn,
        conn.cursor() as cursor,
        cursor.copy(f"COPY jobs ({columns}) FROM STDIN".encode()) as copy,
    ):
        for row in rows:
            copy.write_row(row)


def failed_jobs(
    client: Client, names: list[str], headers: dict[str, str] | None = None
) -> list[int]:
    """One FAILED job per name (no other job may be due meanwhile); their jobIDs."""
    extra = headers or {}
    ids = sorted(create_many(client, names, extra))
    taken: list[int] = []
    while len(taken) < len(ids):  # GetJobs hands out at most MAX_RESULTS at once
        reply = ok(client.request("GetJobs", extra, name="*", numResults=MAX_RESULTS))
        taken += [job["jobID"] for job in reply.json["jobs"]]
    assert sorted(taken) == ids
    client.send(b"".join(encode("FailJob", {**extra, "jobID": i, "error": "boom"}) for i in ids))
    for _ in ids:
        ok(client.read_reply())
    return ids


def states(client: Client, ids: list[int], headers: dict[str, str] | None = None) -> dict[int, str]:
    """Each job's state, or "gone"."""
    found = {}
    for job_id in ids:
        reply = client.request("QueryJob", headers or {}, jobID=job_id)
        found[job_id] = reply.json["state"] if reply.code == 200 else "gone"
    return found
