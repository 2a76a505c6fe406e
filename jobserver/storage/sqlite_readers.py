"""Read-only SQLite connections of their own: the `Query` command's
sandbox, the pruner's look for work, the queues' figures and the
dashboard's search. All run in threads outside the writer, and none can
write."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Mapping
from time import monotonic
from typing import IO, Any
from urllib.parse import quote

from jobserver.model.jobs import Job
from jobserver.model.limits import handouts_cutoff
from jobserver.storage import sql, sqlite_ready
from jobserver.storage.reader_types import (
    BadQuery,
    LaterJobs,
    QueryRows,
    QueryTimeout,
    QueueStats,
    ReplyTooLarge,
    RunningJob,
    RunningStats,
)
from jobserver.storage.sql import SQLITE

# Read-only SQL for the `Query` command. It runs on its own connection,
# opened read-only, with an authorizer that allows nothing but reading and
# calling the functions below, and a progress handler that stops it at its
# deadline.

# Longest text or blob a query may build: enough for any row of the jobs
# table, small enough that a hostile zeroblob() or printf() cannot exhaust
# memory.
QUERY_MAX_LENGTH = 16 * 1024 * 1024

# Tables Query does not read, as on PostgreSQL, whose Query role may read
# the job tables alone: idempotency keys are the clients' own (an order ID,
# a customer's reference), kept with the requests they made.
QUERY_HIDDEN_TABLES = frozenset(("idempotency",))

_QUERY_ALLOWED = frozenset(
    (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE)
)

# The functions a Query may call: SQLite's core scalar, aggregate and
# window functions, its date and time, JSON and math functions, as a
# reader of the job tables needs them. Anything else is refused, whatever
# SQLite was built with: fts3_tokenizer (which reads and sets a function
# pointer), load_extension, sqlite_compileoption_*, sqlite_log, the FTS
# and R*Tree helpers, and whatever a later SQLite adds. Names missing from this
# SQLite are simply not found.
QUERY_FUNCTIONS = frozenset(
    (
        # Core scalar functions (the JSON operators -> and ->> are functions too).
        "abs", "char", "coalesce", "concat", "concat_ws", "format", "glob", "hex", "if",
        "ifnull", "iif", "instr", "length", "like", "likelihood", "likely", "lower", "ltrim",
        "max", "min", "nullif", "octet_length", "printf", "quote", "random", "randomblob",
        "replace", "round", "rtrim", "sign", "soundex", "substr", "substring", "trim",
        "typeof", "unhex", "unicode", "unistr", "unistr_quote", "unlikely", "upper",
        "zeroblob", "->", "->>",
        # What the connection and SQLite are (harmless, and read by some clients).
        "changes", "last_insert_rowid", "total_changes", "sqlite_version", "sqlite_source_id",
        # Aggregates.
        "avg", "count", "group_concat", "string_agg", "sum", "total",
        # Window functions.
        "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag",
        "lead", "first_value", "last_value", "nth_value",
        # Date and time.
        "date", "time", "datetime", "julianday", "unixepoch", "strftime", "timediff",
        "current_date", "current_time", "current_timestamp",
        # JSON.
        "json", "jsonb", "json_array", "jsonb_array", "json_array_length",
        "json_error_position", "json_extract", "jsonb_extract", "json_insert",
        "jsonb_insert", "json_object", "jsonb_object", "json_patch", "jsonb_patch",
        "json_pretty", "json_quote", "json_remove", "jsonb_remove", "json_replace",
        "jsonb_replace", "json_set", "jsonb_set", "json_type", "json_valid",
        "json_group_array", "jsonb_group_array", "json_group_object", "jsonb_group_object",
        # Math.
        "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos",
        "cosh", "degrees", "exp", "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow",
        "power", "radians", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
    )
)


def _read_only_uri(path: str) -> str:
    """A URI that opens `path` read-only. An absolute path gets an empty
    authority (`file://` + path): after a bare `file:`, a path starting with
    `//` would make its first directory the URI's authority."""
    authority = "//" if path.startswith("/") else ""
    return f"file:{authority}{quote(path)}?mode=ro"


def read_only_query(path: str, sql: str, seconds: float, rows: QueryRows) -> None:
    """Run one read-only statement, giving `rows` its column names and then
    each row as SQLite steps to it.

    Raises BadQuery for bad SQL or anything that is not a read,
    QueryTimeout when it runs past `seconds`, and what `rows` raises.
    """
    try:
        db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    except sqlite3.Error as error:
        raise BadQuery(str(error)) from error
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, QUERY_MAX_LENGTH)
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        # A sort or a DISTINCT of a large result spills to temporary files,
        # as large as the query likes (a sort of random blobs wrote 1.8 GB
        # of them before its timeout): in memory instead, within the Query
        # process's limit on its address space.
        db.execute("PRAGMA temp_store = MEMORY")
        db.set_authorizer(_authorize)
        deadline = monotonic() + seconds
        db.set_progress_handler(lambda: monotonic() > deadline, 1000)
        try:
            cursor = db.execute(sql)
            rows.start([column[0] for column in cursor.description or ()])
            for row in cursor:
                rows.add(row)
        except sqlite3.OperationalError as error:
            if monotonic() > deadline and "interrupt" in str(error):
                raise QueryTimeout() from error
            raise BadQuery(str(error)) from error
        except (sqlite3.Error, sqlite3.Warning, ValueError) as error:
            raise BadQuery(str(error)) from error
    finally:
        db.close()


# The Query process's address space: the interpreter and SQLite, and room
# for a few rows as large as a reply may be.
QUERY_MEMORY_BASE = 64 * 1024 * 1024
QUERY_MEMORY_PER_REPLY_BYTE = 4
# Past its deadline a Query's process has this long to say so itself,
# then it is killed.
QUERY_KILL_GRACE = 0.5


# The Query process runs isolated (`-I`): neither the server's working
# directory nor PYTHONPATH nor the user's site-packages is on its import
# path, so a `json.py` planted in a shared working directory is never run;
# it finds jobserver where this server found it, after the standard library.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_START_CHILD = (
    "import sys; sys.path.append(sys.argv[1]); "
    "from jobserver.storage.sqlite_query_child import main; sys.exit(main())"
)


def query_in_child(path: str, sql: str, seconds: float, rows: QueryRows) -> None:
    """read_only_query, run by a process of its own (sqlite_query_child):
    killed at its deadline and bounded in memory, which a thread cannot be.
    Blocking: call it from a worker thread."""
    request = {
        "path": path, "sql": sql, "seconds": seconds, "max_bytes": rows.max_bytes,
        "memory": QUERY_MEMORY_BASE + QUERY_MEMORY_PER_REPLY_BYTE * rows.max_bytes,
    }
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", _START_CHILD, _PACKAGE_ROOT],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        child.kill()

    timer = threading.Timer(seconds + QUERY_KILL_GRACE, expire)
    timer.start()
    try:
        assert child.stdin is not None and child.stdout is not None
        try:
            with child.stdin:
                child.stdin.write(json.dumps(request).encode("utf-8", "surrogatepass"))
        except BrokenPipeError:
            pass  # it ended at once: what it said, if anything, is read below
        answered = _read_answer(child.stdout, rows)
    finally:
        timer.cancel()
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    if not answered:
        if expired.is_set():
            raise QueryTimeout()
        raise BadQuery("the Query's process ended without an answer (out of memory or time)")


def _read_answer(out: IO[bytes], rows: QueryRows) -> bool:
    """Give `rows` what the process answers; False if it ended first."""
    # A line holds one row: as JSON, at most twice the reply's bound (a
    # blob is written in hex) and a little.
    longest = 2 * rows.max_bytes + 64 * 1024
    while line := out.readline(longest + 1):
        if not line.endswith(b"\n"):
            if len(line) > longest:
                raise ReplyTooLarge(rows.max_bytes)
            return False  # cut short: the process was killed
        try:
            message = json.loads(line)
        except ValueError as error:
            raise BadQuery("the Query's process answered what is not JSON") from error
        if isinstance(message, list):
            rows.add(tuple(_value(item) for item in message))
        elif "headers" in message:
            rows.start(message["headers"])
        elif "end" in message:
            return True
        else:
            _raise(message["error"], message["text"], rows.max_bytes)
    return False


def _raise(kind: str, text: str, max_bytes: int) -> None:
    if kind == "timeout":
        raise QueryTimeout()
    if kind == "large":
        raise ReplyTooLarge(max_bytes)
    if kind == "memory":
        raise BadQuery("the query needs more memory than a Query may use")
    raise BadQuery(text)


def _value(item: Any) -> object:
    if isinstance(item, dict):
        return bytes.fromhex(item["hex"]) if "hex" in item else float(item["float"])
    return item


def prune_pending(
    path: str, before: Mapping[str, str], min_free_pages: int, now: str
) -> bool:
    """Whether the pruner has work, asked on a connection of its own so that
    an idle server adds no transaction: a standalone job in a state of
    `before` that ended before its time there, a reply kept past its grace
    period or an idempotency key past its keep (expired at `now`), or free
    pages to reclaim."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        for state, cutoff in before.items():
            row = db.execute(sql.prunable(SQLITE), (state, cutoff)).fetchone()
            if row is not None:
                return True
        for expired in (
            sql.expired_reply(SQLITE), sql.expired_idempotency_key(SQLITE),
            sql.expired_outcome(SQLITE),
        ):
            if db.execute(expired, (now,)).fetchone() is not None:
                return True
        if db.execute(sql.expired_handout(SQLITE), (handouts_cutoff(now),)).fetchone():
            return True
        return int(db.execute("PRAGMA freelist_count").fetchone()[0]) >= min_free_pages
    finally:
        db.close()


_QUEUE = "CASE WHEN instr(name, '/') > 0 THEN substr(name, 1, instr(name, '/') - 1) ELSE name END"


def queue_stats(path: str, now: str, paused: frozenset[str]) -> QueueStats:
    """Jobs by queue and state, each queue's oldest due nextRun that no
    `paused` pattern holds, and the due jobs they hold."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        counts = {
            (queue, state): count
            for queue, state, count in db.execute(
                f"SELECT {_QUEUE} AS queue, state, COUNT(*) FROM jobs GROUP BY queue, state"
            )
        }
        oldest: dict[str, str] = {}
        held: dict[str, int] = {}
        # Each name due is matched once against the patterns, read once:
        # jobs share names, and a GLOB per job and pattern can take seconds.
        for queue, due, count in db.execute(
            "WITH paused(pattern) AS MATERIALIZED (SELECT value FROM json_each(?)), "
            "due(name, first, jobs) AS (SELECT name, MIN(nextRun), COUNT(*) FROM jobs "
            f"WHERE state IN ({sql.READY_SQL}) AND nextRun <= ? GROUP BY name) "
            "SELECT queue, MIN(CASE WHEN NOT held THEN first END), "
            "SUM(CASE WHEN held THEN jobs ELSE 0 END) FROM ("
            f"SELECT {_QUEUE} AS queue, first, jobs, "
            "EXISTS (SELECT 1 FROM paused WHERE name GLOB pattern) AS held FROM due"
            ") GROUP BY queue",
            (json.dumps(sorted(paused)), now),
        ):
            if due is not None:
                oldest[queue] = due
            if count:
                held[queue] = count
        return counts, oldest, held
    finally:
        db.close()


def ready_by_queue(path: str) -> dict[str, int]:
    """The jobs waiting to run by queue, read through an index of them."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        rows = db.execute(
            f"SELECT {_QUEUE} AS queue, COUNT(*) FROM jobs "
            f"WHERE state IN ({sql.READY_SQL}) GROUP BY queue"
        )
        return {queue: int(count) for queue, count in rows}
    finally:
        db.close()


def running_by_name(path: str, now: str) -> list[tuple[str, str, int]]:
    """The cost of the running jobs, as a limit's usage counts it, by name
    and key."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        rows = db.execute(sql.running_by_name(SQLITE), (now,))
        return [(name, key, int(cost)) for name, key, cost in rows]
    finally:
        db.close()


def handouts_in_windows(path: str, windows: Mapping[str, str]) -> dict[str, int]:
    """The most hand-outs of one key in each rate's window, in one read
    transaction: every window of the same moment."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        db.execute("BEGIN")
        return sql.read_windows(
            SQLITE, windows, lambda statement, args: db.execute(statement, args).fetchall()
        )
    finally:
        db.close()


def find_matching(path: str, pattern: str, limit: int) -> list[tuple[Any, ...]]:
    """The rows of the newest jobs whose name matches a GLOB `pattern`:
    jobID order, so a search that finds enough stops early."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        return db.execute(*sql.find_matching(SQLITE, pattern, limit)).fetchall()
    finally:
        db.close()


def later_jobs(path: str, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
    """The dashboard's Scheduled or Retries and their count, in one read
    transaction: the count is of the same moment."""
    if retrying:
        listed, counted = sql.later_jobs(SQLITE, now, retrying, limit, most)
    else:
        listed, counted = sqlite_ready.scheduled(now, limit, most)
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        db.execute("BEGIN")
        jobs = [Job(*row) for row in db.execute(*listed)]
        counted_to = int(db.execute(*counted).fetchone()[0])
        return LaterJobs(jobs, min(counted_to, most), counted_to <= most)
    finally:
        db.close()


def running_jobs(
    path: str, now: str, pattern: str | None, limit: int, newest: bool
) -> RunningStats:
    """The jobs handed out, in the order asked, and their count, in one
    read transaction: the count is of the same moment."""
    listed, counted = sql.running_jobs(SQLITE, now, pattern, limit, newest)
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        db.execute("BEGIN")
        jobs = [RunningJob(*row) for row in db.execute(*listed)]
        total = int(db.execute(*counted).fetchone()[0])
        return jobs, total
    finally:
        db.close()


def _authorize(action: int, arg1: str | None, arg2: str | None, *_: object) -> int:
    if action not in _QUERY_ALLOWED:
        return sqlite3.SQLITE_DENY
    # A read names its table as arg1.
    if action == sqlite3.SQLITE_READ and (arg1 or "").lower() in QUERY_HIDDEN_TABLES:
        return sqlite3.SQLITE_DENY
    # For a function call SQLite gives its name, lower case, as arg2.
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in QUERY_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
