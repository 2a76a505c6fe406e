"""The trio server: accept connections, own the tasks, stop cleanly.

Each connection is one task (connection.py), and a failure domain: nothing
that happens on it reaches the accept loop or another connection. Only a
stop signal ends the server once it runs. Shutdown stops accepting, answers
waiting GetJobs, lets requests in flight finish, then closes the database.

What a request means is the core's business: the server opens the store,
builds the core on it (core/build.py: the engine and the dispatcher), runs
the engine's tasks in its nursery, hands the HTTP side the same core, and
hands each connection's requests to the core's dispatcher. At shutdown it
closes the engine's wait queue (waiting GetJobs are answered), lets the
connections finish, and stops the engine (what they gave back is written).
"""

from __future__ import annotations

import logging
import resource
import signal
import socket
import ssl
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from jobserver.core.build import Core, build_core
from jobserver.core.commands import backup
from jobserver.core.commands.route import DEFAULT_QUERY_SECONDS, Access, bounded, is_loopback
from jobserver.core.engine import analyzer, deadlines, depth, history, retention
from jobserver.core.engine.clock import SystemClock
from jobserver.core.engine.context import DEFAULT_REPLY_GRACE, DEFAULT_STALE_AFTER, Settings
from jobserver.model.limits import Limit
from jobserver.model.times import to_millis
from jobserver.server import sweeper
from jobserver.server.connection import Connection, serve_connection
from jobserver.storage import lockfile
from jobserver.storage.backends import DEFAULT_WRITERS, is_postgres, open_store
from jobserver.storage.interface import Storage
from jobserver.wire.limits import (
    DEFAULT_HOST,
    DEFAULT_IDEMPOTENCY_KEEP,
    DEFAULT_KEEP_OUTCOMES,
    DEFAULT_MAX_LIMITS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_PORT,
)

log = logging.getLogger("jobserver")

# How long one thread may hold the GIL while another wants it.
GIL_SWITCH_SECONDS = 0.0005
# After a failed accept (no descriptors left), the first pause before the
# next, doubling while it keeps failing: the log says so a few times a
# second at first and once every few seconds after.
ACCEPT_PAUSE = 0.1
ACCEPT_PAUSE_MAX = 5.0
# Time allowed, after SIGTERM or SIGINT, for requests in flight to finish.
SHUTDOWN_GRACE = 4.0
# File descriptors the server needs besides its connections: the database
# and its journal, the listener, Query's and the pruner's connections,
# trio's own, and connections being refused with 503.
FILE_RESERVE = 64
# Connections being refused with 503 at once, within FILE_RESERVE: enough
# for a burst of clients to be told, and leaves half the reserve.
REFUSALS_AT_ONCE = 32


@dataclass
class Config:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    db: str = "jobs.db"
    synchronous: str = "FULL"
    # One file descriptor each; the default fits ten thousand waiting workers.
    max_connections: int = 16384
    # Query reads the whole database; by default only local users may.
    allow_remote_query: bool = False
    query_seconds: float = DEFAULT_QUERY_SECONDS
    # The largest reply (Query, GetJobs) the server builds.
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    # A connection with no request under way is closed after this long:
    # long enough for a worker between jobs, short enough that abandoned
    # connections do not pile up for months.
    idle_timeout: float = 900.0
    # Once a request has begun it must be complete within this: a client
    # trickling a header byte by byte cannot hold a connection forever.
    request_timeout: float = 30.0
    # When set, every request must carry it in an `authToken` header.
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # Concurrency limits given at start (--limit): pattern -> capacity.
    # SetLimit's, stored in the database, win over these.
    limits: dict[str, Limit] = field(default_factory=dict)
    # The most limits, and the most paused patterns, there may be (--max-limits).
    max_limits: int = DEFAULT_MAX_LIMITS
    # Retention in seconds (--keep-finished, --keep-failed): 0 deletes a
    # finished job at once, as Bedrock does; None keeps failed jobs forever.
    keep_finished: float = 0.0
    keep_failed: float | None = None
    prune_interval: float = retention.PRUNE_INTERVAL
    # Seconds an early reply waits for its AwaitReply, and a delivered one
    # is remembered to refuse a second delivery (--reply-grace).
    reply_grace: float = DEFAULT_REPLY_GRACE
    # Seconds a RUNNING job may go without a report before it counts as a
    # failed attempt (--stale-after); 0 keeps Bedrock's "RUNNING forever".
    stale_after: float = DEFAULT_STALE_AFTER
    # How long an idempotency key is kept (--idempotency-keep).
    idempotency_keep: float = DEFAULT_IDEMPOTENCY_KEEP
    # How long an ended job's outcome is kept for AwaitJob (--keep-outcomes).
    keep_outcomes: float = DEFAULT_KEEP_OUTCOMES
    # Minutes of history kept in memory (--history-minutes); 0 keeps none.
    history_minutes: int = history.DEFAULT_MINUTES
    # The HTTP side's port (--http-port), on the same host; None: no HTTP.
    http_port: int | None = None
    # HTTP connections served at once (--max-http-connections): each holds
    # a file descriptor, as a wire connection does; a thousand is room for
    # any dashboard audience and API client pool.
    max_http_connections: int = 1024
    # Names the HTTP side answers to besides IP addresses, localhost and
    # `host` (--http-host); a request naming another is refused (DNS
    # rebinding).
    http_hosts: tuple[str, ...] = ()
    # How long a dashboard session lasts from sign-in (--session-lifetime):
    # a working day, so one sign-in covers a shift and a forgotten browser
    # stops acting by the next morning.
    session_seconds: float = 12 * 3600.0
    # Where Backup writes (--backup-dir); None: DB.backups beside the database.
    backup_dir: str | None = None
    # On PostgreSQL, the role Query logs in as (--query-db-url); None: the
    # queue's own, which the server creates if its database user may.
    query_db_url: str | None = None
    # On PostgreSQL, transactions run at once, each on its own connection
    # (--writers).
    writers: int = DEFAULT_WRITERS


class HttpListenError(OSError):
    """The HTTP side's address cannot be listened on (--http-port)."""


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.store: Storage | None = None
        self.core: Core
        self.connections: set[Connection] = set()
        self.closing = False
        self.port: int | None = None
        # The HTTP side's port once it listens (--http-port).
        self.http_port: int | None = None
        self._http_stopping = trio.Event()
        self.commands_served = 0
        # --max-connections, or fewer if the file-descriptor limit says so.
        self.max_connections = config.max_connections
        self._stop = trio.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        # Built once; each connection starts TLS itself, after checking that
        # the client speaks it (connection.py).
        self.tls_context: ssl.SSLContext | None = None
        self._connection_ended = trio.Event()

    def request_stop(self) -> None:
        """Shut down as if on SIGTERM."""
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        self.token = trio.lowlevel.current_trio_token()
        self.max_connections = _connections_allowed(config.max_connections)
        # Heavy batches and Query run Python in threads; by default one
        # could keep the event loop from the GIL for 5 ms at a time.
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        # Signals are caught before anything is announced, so a stop sent the
        # moment the server says it listens is still a clean stop.
        with _stop_signals() as signals:
            if config.tls_cert:
                self.tls_context = _tls_context(config.tls_cert, config.tls_key)
            # Before listening: a second server on this file must not even
            # take a port.
            # (Nodes that share PostgreSQL coordinate through it instead.)
            local = config.db != ":memory:" and not is_postgres(config.db)
            lock = lockfile.acquire(config.db) if local else None
            try:
                await self._run_locked(lock, signals, task_status)
            finally:
                if lock is not None:
                    lock.release()

    async def _run_locked(
        self,
        lock: lockfile.ServerLock | None,
        signals: AsyncIterator[int] | None,
        task_status: trio.TaskStatus[int],
    ) -> None:
        config = self.config
        listeners: list[Any] = await trio.open_tcp_listeners(config.port, host=config.host)
        port = listeners[0].socket.getsockname()[1]
        http = None
        try:
            http = self._listen_http()
            # Opening PostgreSQL waits on the network: not on the event loop.
            self.store = await trio.to_thread.run_sync(
                open_store, config.db, config.synchronous, config.limits, config.query_db_url,
                config.writers,
            )
        except BaseException:
            for listener in listeners:
                await listener.aclose()
            if http is not None:
                http.close()
            raise
        self.core = self._build_core(self.store, node_name(config.host, port))
        engine = self.core.engine
        # Reply deadlines and running jobs from before a restart still fire
        # (at once, for those that passed while the server was down).
        due = await trio.to_thread.run_sync(deadlines.at_start, self.store, engine.settings)
        # Set last: it tells an embedding program the server is ready.
        self.port = port
        address = f"{config.host}:{port}"
        if lock is not None:
            lock.announce(address)
        if not is_loopback(config.host) and config.auth_token is None:
            log.warning(
                "serving %s without --auth-token-file: anyone who can "
                "reach this address can create, take and delete jobs", config.host,
            )
        log.info(
            "listening on %s%s, database %s",
            address, " (TLS)" if config.tls_cert else "", self.store.path,
        )
        engine.start(due)
        try:
            async with trio.open_nursery() as core:
                core.start_soon(engine.run)
                core.start_soon(engine.listen)
                core.start_soon(sweeper.sweep_reads, self)
                if http is not None:
                    core.start_soon(self._serve_http, http)
                if config.db != ":memory:":
                    core.start_soon(
                        retention.run_pruner, engine, self.store, self.clock,
                        config.keep_finished, config.keep_failed, config.prune_interval,
                    )
                    core.start_soon(depth.run_sampler, self.store, engine.history, self.clock)
                if is_postgres(config.db):
                    core.start_soon(analyzer.run_analyzer, self.store)
                async with trio.open_nursery() as conns:
                    accept = trio.CancelScope()
                    conns.start_soon(self._accept, listeners, conns, accept)
                    task_status.started(self.port)
                    await self._wait_for_stop(signals)
                    await self._shut_down(accept, conns)
                core.cancel_scope.cancel()
        finally:
            # Jobs given back by the last connections are written too.
            await engine.stop()
            self.store.close()
            log.info("stopped serving %s; database %s closed", address, self.store.path)

    def _listen_http(self) -> Any:
        """The HTTP side's bound socket (web.serving.Listening), or None."""
        config = self.config
        if config.http_port is None:
            return None
        # Imported here: the web extra is optional (the CLI checks for it).
        from jobserver.web import serving

        tls = (config.tls_cert, config.tls_key) if config.tls_cert else None
        try:
            listening = serving.listen(config.host, config.http_port, tls)
        except OSError as error:
            raise HttpListenError(error.errno, error.strerror) from error
        self.http_port = listening.port
        return listening

    async def _serve_http(self, listening: Any) -> None:
        from jobserver.web import serving

        config = self.config
        # The name it was told to listen on is one of its names.
        names = {*config.http_hosts, config.host.lower()}
        await serving.serve(
            listening, self.core, config.auth_token, self._http_stopping,
            names, config.session_seconds, config.max_http_connections,
        )

    def _build_core(self, store: Storage, node: str) -> Core:
        config = self.config
        self.clock = SystemClock()
        settings = Settings(
            keep_finished=config.keep_finished > 0,
            reply_grace=config.reply_grace,
            stale_after=config.stale_after,
            idempotency_keep=config.idempotency_keep,
            keep_outcomes=config.keep_outcomes,
            serving_since=to_millis(self.clock.now()),
            max_reply_bytes=config.max_reply_bytes,
            max_limits=config.max_limits,
            node=node,
        )
        access = Access(
            config.auth_token, config.allow_remote_query, config.query_seconds,
            config.max_reply_bytes, backup.directory(config.db, config.backup_dir),
        )
        return build_core(
            store, self.clock, settings, access, self, history_minutes=config.history_minutes
        )

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    async def _wait_for_stop(self, signals: AsyncIterator[int] | None) -> None:
        async def on_signal(cancel: trio.CancelScope) -> None:
            assert signals is not None
            async for signum in signals:
                log.info("received %s, shutting down", signal.Signals(signum).name)
                break
            cancel.cancel()

        async def on_request(cancel: trio.CancelScope) -> None:
            await self._stop.wait()
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            if signals is not None:
                nursery.start_soon(on_signal, nursery.cancel_scope)
            nursery.start_soon(on_request, nursery.cancel_scope)

    async def _shut_down(self, accept: trio.CancelScope, conns: trio.Nursery) -> None:
        self.closing = True
        accept.cancel()
        self._http_stopping.set()
        self.core.engine.close()
        for connection in list(self.connections):
            connection.stop_reading()
        with trio.move_on_after(SHUTDOWN_GRACE):
            # A 10 ms poll, bounded by the grace period: cheap for a shutdown.
            while self.connections:  # noqa: ASYNC110
                await trio.sleep(0.01)
        conns.cancel_scope.cancel()

    async def _accept(
        self, listeners: list[Any], conns: trio.Nursery, scope: trio.CancelScope
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, conns)
        for listener in listeners:
            await listener.aclose()

    async def _accept_loop(self, listener: Any, conns: trio.Nursery) -> None:
        pause = ACCEPT_PAUSE
        while True:
            # Refusing takes a descriptor too: past a few refusals at once,
            # new clients wait in the listen backlog until a connection ends.
            while len(self.connections) >= self.max_connections + REFUSALS_AT_ONCE:
                await self._connection_ended.wait()
            try:
                stream = await listener.accept()
            except OSError as error:
                # Out of descriptors or memory, or stranger: the connections
                # already open are served meanwhile, and only a stop signal
                # ends the server.
                log.error("accept failed: %s; trying again in %gs", error, pause)
                await trio.sleep(pause)
                pause = min(pause * 2, ACCEPT_PAUSE_MAX)
                continue
            pause = ACCEPT_PAUSE
            refuse = len(self.connections) >= self.max_connections
            conns.start_soon(serve_connection, self, stream, refuse)

    def connection_ended(self) -> None:
        """A connection's socket is closed: its descriptor is free."""
        self._connection_ended.set()
        self._connection_ended = trio.Event()


@contextmanager
def _stop_signals() -> Iterator[AsyncIterator[int] | None]:
    """SIGINT and SIGTERM as a stream, when this thread can receive them
    (tests run servers in other threads and stop them by request)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        yield signals


def _tls_context(cert: str, key: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # A client's end without close_notify (a killed worker, a half-close)
    # is an end, as on plain TCP: OpenSSL would otherwise refuse to send
    # the replies still owed. Lengths in every message rule out truncation.
    context.options |= ssl.OP_IGNORE_UNEXPECTED_EOF
    context.load_cert_chain(cert, key)
    return context


def _connections_allowed(wanted: int) -> int:
    """Raise the file-descriptor limit for `wanted` connections; if the hard
    limit does not allow that many, as many as it does. Beyond them a client
    is refused with 503 instead of waiting in the listen backlog while
    accept fails for lack of descriptors."""
    soft = _raise_file_limit(wanted + FILE_RESERVE)
    if soft == resource.RLIM_INFINITY or soft >= wanted + FILE_RESERVE:
        return wanted
    allowed = max(1, soft - FILE_RESERVE)
    log.warning(
        "the file-descriptor limit (%d) allows %d connections, not --max-connections %d; "
        "raise it (ulimit -n) to serve more", soft, allowed, wanted,
    )
    return allowed


def _raise_file_limit(wanted: int) -> int:
    """The soft limit, raised towards `wanted` as far as the hard one allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


async def serve(config: Config) -> None:
    await Server(config).run()


def node_name(host: str, port: int) -> str:
    """This node as the jobs handed out here record it: the address it
    listens on, or the machine's name when that is every address."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return bounded(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
