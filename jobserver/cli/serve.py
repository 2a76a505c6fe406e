"""The `serve` subcommand: its options, and running the server with them."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import stat
import sys

import trio

from jobserver import web
from jobserver.cli import collector, serve_values
from jobserver.cli.options import LOG_LEVELS, duration, log_level, number
from jobserver.core.commands import backup
from jobserver.core.engine import history
from jobserver.core.engine.context import DEFAULT_REPLY_GRACE, DEFAULT_STALE_AFTER
from jobserver.core.rules import flow
from jobserver.model.times import duration_text
from jobserver.server.app import Config, HttpListenError, Server
from jobserver.storage import sqlite_backup
from jobserver.storage.backends import DEFAULT_WRITERS, MAX_WRITERS, is_postgres
from jobserver.storage.backup_types import BackupDirectoryUnusable
from jobserver.storage.sqlite import SYNCHRONOUS_MODES
from jobserver.storage.sqlite_schema import StoreError
from jobserver.wire.counts import counted
from jobserver.wire.limits import (
    DEFAULT_HOST,
    DEFAULT_IDEMPOTENCY_KEEP,
    DEFAULT_KEEP_OUTCOMES,
    DEFAULT_PORT,
    MAX_IDEMPOTENCY_KEEP,
    MAX_KEEP_OUTCOMES,
    MAX_MAX_LIMITS,
    MAX_MAX_REPLY_BYTES,
    MIN_IDEMPOTENCY_KEEP,
    MIN_MAX_REPLY_BYTES,
)

log = logging.getLogger("jobserver")


# The ranges of the serve options; docs/server.md's serve table lists them.
MAX_PORT = 65535
# One file descriptor each, and the kernel's usual ceiling is 1,048,576.
MAX_CONNECTIONS = 1_000_000
# A Query holds a reader thread and a snapshot of the database.
MAX_QUERY_SECONDS = 3600.0
# A worker between jobs is idle; longer than a day, it is gone.
MAX_IDLE_SECONDS = 86400.0
# The largest request (4 MiB of head, 1 MiB of body) arrives within this
# over any link still worth serving.
MAX_REQUEST_SECONDS = 3600.0
# Ten years: for retention, longer is an archive, not a queue; for the
# stale-job net, longer is the same as never.
MAX_DURATION_SECONDS = 3650 * 86400.0
# A dashboard session: long enough to act during an incident, at most a
# month.
MIN_SESSION_SECONDS = 60.0
MAX_SESSION_SECONDS = 30 * 86400.0
# An early reply waits at most as long as an AwaitReply may (30 days).
MIN_REPLY_GRACE_SECONDS = 1.0
MAX_REPLY_GRACE_SECONDS = 30 * 86400.0


DESCRIPTION = (
    "Run the job server in the foreground. Jobs are kept in one SQLite "
    "file; a write is acknowledged only once it is on disk. SIGINT or "
    f"SIGTERM stop it cleanly. Try it with: nc {DEFAULT_HOST} {DEFAULT_PORT}"
)


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """The serve subcommand's options."""
    _add_storage_options(serve)
    _add_client_options(serve)
    _add_job_options(serve)
    _add_security_and_log_options(serve)


def _add_storage_options(serve: argparse.ArgumentParser) -> None:
    """Where it listens and where it keeps jobs."""
    serve.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})"
    )
    serve.add_argument(
        "--port",
        type=number(int, 0, MAX_PORT),
        default=DEFAULT_PORT,
        help=f"TCP port, 0 to {MAX_PORT}; 0 picks a free one (default: {DEFAULT_PORT})",
    )
    serve.add_argument(
        "--http-port",
        type=number(int, 0, MAX_PORT),
        default=None,
        metavar="PORT",
        help=(
            f"also serve HTTP (POST /queue, POST /api/COMMAND, GET /metrics, GET "
            f"/healthz) on this TCP port of --host, "
            f"0 to {MAX_PORT}; 0 picks a free one, which the log names. Needs "
            "jobserverd[web] (default: no HTTP)"
        ),
    )
    serve.add_argument(
        "--http-host",
        action="append",
        type=serve_values.http_host,
        default=[],
        metavar="NAME",
        help="a host name the HTTP side answers to, besides IP addresses, localhost and "
        "--host; a request naming another host is refused with 421, so that no web page "
        "reaches it through a name of its own (DNS rebinding); repeatable (default: none)",
    )
    serve.add_argument(
        "--db",
        type=serve_values.database,
        default="jobs.db",
        metavar="DB",
        help=(
            "where jobs are kept: a SQLite file, created if missing in a directory that "
            "exists and this server may write (beside it go its -wal, -shm and .lock), or a "
            "PostgreSQL URL (postgresql://USER@HOST:PORT/DBNAME, libpq's "
            "parameters allowed; needs jobserverd[postgres]), which any number "
            "of servers may share (default: jobs.db)"
        ),
    )
    serve.add_argument(
        "--synchronous",
        choices=SYNCHRONOUS_MODES,
        default="FULL",
        help=(
            "SQLite synchronous mode. FULL syncs every commit to disk before "
            "its reply. NORMAL is faster, but a power loss or OS crash (not a "
            "server crash) can lose the last acknowledged writes (default: FULL). "
            "PostgreSQL follows its own synchronous_commit instead"
        ),
    )
    serve.add_argument(
        "--backup-dir",
        metavar="DIR",
        help=(
            "where Backup writes the files it is asked for, by name: an existing "
            "directory, not a symbolic link, that only the server's user may write "
            "(default: DB.backups beside a SQLite database, made at the first Backup)"
        ),
    )
    serve.add_argument(
        "--max-connections",
        type=number(int, 1, MAX_CONNECTIONS),
        default=Config.max_connections,
        metavar="N",
        help=f"connections beyond this, 1 to {MAX_CONNECTIONS:,}, are answered "
        f"'503 Too many connections' (default: {Config.max_connections})",
    )
    serve.add_argument(
        "--max-http-connections",
        type=number(int, 1, MAX_CONNECTIONS),
        default=Config.max_http_connections,
        metavar="N",
        help=f"HTTP connections beyond this, 1 to {MAX_CONNECTIONS:,}, are answered 503 "
        f"and closed (default: {Config.max_http_connections})",
    )


def _add_client_options(serve: argparse.ArgumentParser) -> None:
    """What clients may do and how long they may take."""
    serve.add_argument(
        "--allow-remote-query",
        action="store_true",
        help="accept the read-only Query command from non-loopback clients (default: off)",
    )
    serve.add_argument(
        "--query-timeout",
        type=number(float, 0, MAX_QUERY_SECONDS, above=True, unit="seconds"),
        default=Config.query_seconds,
        metavar="SECONDS",
        help=f"a Query running longer, above 0 and at most {MAX_QUERY_SECONDS:g}, is "
        f"stopped with '555 Timeout' (default: {Config.query_seconds:g})",
    )
    serve.add_argument(
        "--query-db-url",
        metavar="URL",
        help="on PostgreSQL, log Query in as the role of this libpq URL, which may only read "
        "the queue's tables (checked at start); needed when the --db user may not create "
        "Query's own role, else Query answers 501 (default: the queue's own role, created "
        "by the server)",
    )
    serve.add_argument(
        "--writers",
        type=number(int, 1, MAX_WRITERS),
        default=None,
        metavar="N",
        help="on PostgreSQL, transactions this node runs at once, each on a connection of "
        f"its own, 1 to {MAX_WRITERS}: while one waits for the database another's requests "
        "run (a drain is faster); a SQLite file has one writer "
        f"(default: {DEFAULT_WRITERS} on PostgreSQL)",
    )
    serve.add_argument(
        "--max-reply-bytes",
        type=number(int, MIN_MAX_REPLY_BYTES, MAX_MAX_REPLY_BYTES),
        default=Config.max_reply_bytes,
        metavar="BYTES",
        help=f"the largest reply the server builds, {MIN_MAX_REPLY_BYTES:,} to "
        f"{MAX_MAX_REPLY_BYTES:,}: a Query past it is refused, a GetJobs hands out fewer "
        f"jobs (default: {Config.max_reply_bytes:,})",
    )
    serve.add_argument(
        "--idle-timeout",
        type=number(float, 0, MAX_IDLE_SECONDS, above=True, unit="seconds"),
        default=Config.idle_timeout,
        metavar="SECONDS",
        help=f"close a connection with no request under way for this long, above 0 and "
        f"at most {MAX_IDLE_SECONDS:g} (default: {Config.idle_timeout:g})",
    )
    serve.add_argument(
        "--request-timeout",
        type=number(float, 0, MAX_REQUEST_SECONDS, above=True, unit="seconds"),
        default=Config.request_timeout,
        metavar="SECONDS",
        help=f"a request must arrive whole within this of its first byte, above 0 and "
        f"at most {MAX_REQUEST_SECONDS:g}, else '408 Request timeout' and the "
        f"connection is closed (default: {Config.request_timeout:g})",
    )
    serve.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="require every request to carry the token in this file in an "
        "'authToken' header; others get '401 Unauthorized' (default: no token)",
    )
    serve.add_argument(
        "--session-lifetime",
        type=duration(MIN_SESSION_SECONDS, MAX_SESSION_SECONDS),
        default=Config.session_seconds,
        metavar="DURATION",
        help="how long a sign-in to the dashboard lasts: "
        f"{duration_text(MIN_SESSION_SECONDS)} to {duration_text(MAX_SESSION_SECONDS)} "
        f"(default: {duration_text(Config.session_seconds)})",
    )


def _add_job_options(serve: argparse.ArgumentParser) -> None:
    """Concurrency limits, retention, replies and stale jobs."""
    serve.add_argument(
        "--limit",
        action="append",
        type=serve_values.limit,
        default=[],
        metavar="PATTERN=MAX",
        help="a limit: jobs whose name matches the GLOB PATTERN may together cost at "
        "most MAX (1 or more) while running; after the '=' a comma list of MAX, "
        "rate:N/DURATION (at most N hand-outs in any window: 5/1s, 100/1m, 1000/1h), "
        "perKey (each job key counted apart) and fair (hand-outs rotate between keys), "
        "as 'tenant/*=2,rate:10/1m,perKey,fair'; repeatable; "
        "PATTERN bounded as SetLimit bounds it (255 bytes, 32 wildcards, 64 characters "
        "in sets); SetLimit changes them at run time (default: none)",
    )
    serve.add_argument(
        "--max-limits",
        type=number(int, 1, MAX_MAX_LIMITS),
        default=Config.max_limits,
        metavar="N",
        help=f"the most concurrency limits (--limit ones included), and the most paused "
        f"patterns, 1 to {MAX_MAX_LIMITS:,}: SetLimit and PauseJobs past it are "
        f"answered '413 Too many limits' or '413 Too many paused patterns' "
        f"(default: {Config.max_limits:,})",
    )
    serve.add_argument(
        "--keep-finished",
        type=duration(0.0, MAX_DURATION_SECONDS),
        default=0.0,
        metavar="DURATION",
        help="keep finished jobs, with their final data, this long: 0 to "
        f"{duration_text(MAX_DURATION_SECONDS)}, such as 90s, 30m, 12h or 7d "
        "(default: 0, deleted at once, as Bedrock does)",
    )
    serve.add_argument(
        "--keep-failed",
        type=duration(0.0, MAX_DURATION_SECONDS),
        metavar="DURATION",
        help="delete FAILED jobs this long after they failed: 0 to "
        f"{duration_text(MAX_DURATION_SECONDS)} (default: kept until deleted or requeued)",
    )
    serve.add_argument(
        "--reply-grace",
        type=duration(MIN_REPLY_GRACE_SECONDS, MAX_REPLY_GRACE_SECONDS),
        default=DEFAULT_REPLY_GRACE,
        metavar="DURATION",
        help="keep a reply that comes before its AwaitReply this long, and remember a "
        "delivered one as long to refuse a second delivery: "
        f"{duration_text(MIN_REPLY_GRACE_SECONDS)} to "
        f"{duration_text(MAX_REPLY_GRACE_SECONDS)} "
        f"(default: {duration_text(DEFAULT_REPLY_GRACE)})",
    )
    serve.add_argument(
        "--idempotency-keep",
        type=duration(MIN_IDEMPOTENCY_KEEP, MAX_IDEMPOTENCY_KEEP),
        default=DEFAULT_IDEMPOTENCY_KEEP,
        metavar="DURATION",
        help="keep a CreateJob's or CreateJobs' idempotencyKey and its reply this long: "
        "sent again with the key meanwhile, the request creates nothing and gets the same "
        f"reply; {duration_text(MIN_IDEMPOTENCY_KEEP)} to {duration_text(MAX_IDEMPOTENCY_KEEP)} "
        f"(default: {duration_text(DEFAULT_IDEMPOTENCY_KEEP)})",
    )
    serve.add_argument(
        "--keep-outcomes",
        type=duration(0.0, MAX_KEEP_OUTCOMES),
        default=DEFAULT_KEEP_OUTCOMES,
        metavar="DURATION",
        help="keep each ended job's outcome (final state, data, lastError) this long for "
        f"AwaitJob: 0 to {duration_text(MAX_KEEP_OUTCOMES)}; 0 keeps only those of jobs an "
        "AwaitJob waits for, a minute (default: "
        f"{duration_text(DEFAULT_KEEP_OUTCOMES)})",
    )
    serve.add_argument(
        "--stale-after",
        type=duration(0.0, MAX_DURATION_SECONDS),
        default=DEFAULT_STALE_AFTER,
        metavar="DURATION",
        help="a RUNNING job with no report (FinishJob, FailJob, RetryJob, UpdateJob, "
        "TouchJob) for this long counts as a failed attempt: retried by its retry policy, "
        f"else FAILED; 0 (never, as Bedrock) or 1s to {duration_text(MAX_DURATION_SECONDS)} "
        f"(default: {duration_text(DEFAULT_STALE_AFTER)})",
    )
    serve.add_argument(
        "--history-minutes",
        type=number(int, 0, history.MAX_MINUTES),
        default=Config.history_minutes,
        metavar="N",
        help="keep, in memory, per minute for the last N minutes, the jobs created, handed "
        "out, finished, failed and retried and the queues' depths (History, the dashboard's "
        f"graphs; lost on restart): 0 (none) to {history.MAX_MINUTES:,} "
        f"(default: {Config.history_minutes:,}, a day)",
    )


def _add_security_and_log_options(serve: argparse.ArgumentParser) -> None:
    """TLS and the log."""
    serve.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve TLS with this certificate, PEM (default: plain TCP)",
    )
    serve.add_argument(
        "--tls-key", metavar="FILE", help="the private key for --tls-cert, PEM (default: none)"
    )
    serve.add_argument(
        "--log-level",
        type=log_level,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR, in any case (default: INFO)",
    )


# A shorter token is warned of at start.
MIN_TOKEN_CHARACTERS = 16


def _read_token(path: str) -> str:
    with open(path, encoding="utf-8") as token_file:
        token = token_file.read().strip()
        shared = os.fstat(token_file.fileno()).st_mode & 0o077
    if not token:
        raise ValueError(f"{path} is empty")
    if len(token) < MIN_TOKEN_CHARACTERS:
        # Wrong tokens are not slowed down on the wire: its length is its strength.
        log.warning(
            "the token in --auth-token-file %s has %s: use a long random one "
            "(openssl rand -hex 32)", path, counted(len(token), "character"),
        )
    if shared:
        # Other users who can read the token can do anything with the queue.
        log.warning(
            "--auth-token-file %s can be read by other users of this machine "
            "(mode %o): chmod 600 it", path, stat.S_IMODE(os.stat(path).st_mode),
        )
    return token


def _unusable_backup_dir(path: str) -> str | None:
    """Why the operator's backup directory would refuse every Backup, or
    None: said at start rather than at the first Backup."""
    try:
        os.close(sqlite_backup.open_directory(backup.directory("", path)))
    except BackupDirectoryUnusable as error:
        return str(error)
    return None


def run(args: argparse.Namespace) -> int:
    """Run the server until it is stopped; the exit status."""
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("--tls-cert and --tls-key go together")
        return 2
    for path in filter(None, (args.tls_cert, args.tls_key)):
        if not os.path.isfile(path):
            log.error("no such TLS file: %s", path)
            return 2
    try:
        token = _read_token(args.auth_token_file) if args.auth_token_file else None
    except (OSError, ValueError) as error:
        log.error("cannot use --auth-token-file: %s", error)
        return 2
    if args.backup_dir is not None:
        problem = _unusable_backup_dir(args.backup_dir)
        if problem:
            log.error("cannot use --backup-dir: %s", problem)
            return 2
    if args.query_db_url is not None and not (
        is_postgres(args.db) and is_postgres(args.query_db_url)
    ):
        log.error("--query-db-url takes a PostgreSQL URL, and is for a PostgreSQL --db")
        return 2
    if args.writers not in (None, 1) and not is_postgres(args.db):
        log.error("--writers is for a PostgreSQL --db: a SQLite file has one writer")
        return 2
    if len(dict(args.limit)) > args.max_limits:
        log.error("more --limit patterns than --max-limits %d", args.max_limits)
        return 2
    if flow.patterns_cost(dict(args.limit)) > flow.MAX_PATTERNS_COST:
        log.error(
            "the --limit patterns cost more than %d units a name to match (protocol.md 3)",
            flow.MAX_PATTERNS_COST,
        )
        return 2
    if args.http_port is not None and not web.available():
        log.error("%s", web.MISSING)
        return 2
    config = Config(
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        http_hosts=tuple(args.http_host),
        query_db_url=args.query_db_url,
        writers=args.writers or DEFAULT_WRITERS,
        db=args.db,
        synchronous=args.synchronous,
        max_connections=args.max_connections,
        max_http_connections=args.max_http_connections,
        allow_remote_query=args.allow_remote_query,
        query_seconds=args.query_timeout,
        max_reply_bytes=args.max_reply_bytes,
        idle_timeout=args.idle_timeout,
        request_timeout=args.request_timeout,
        auth_token=token,
        session_seconds=args.session_lifetime,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        limits=dict(args.limit),
        max_limits=args.max_limits,
        keep_finished=args.keep_finished,
        keep_failed=args.keep_failed,
        reply_grace=args.reply_grace,
        idempotency_keep=args.idempotency_keep,
        keep_outcomes=args.keep_outcomes,
        stale_after=args.stale_after,
        history_minutes=args.history_minutes,
        backup_dir=args.backup_dir,
    )
    collector.tune_for_a_server()
    try:
        trio.run(Server(config).run)
    except StoreError as error:
        log.error("%s", error)
        return 2
    except ssl.SSLError as error:
        log.error("cannot use the TLS certificate or key: %s", error)
        return 2
    except HttpListenError as error:
        log.error("cannot serve HTTP: %s", error)
        return 1
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, error)
        return 1
    return 0
