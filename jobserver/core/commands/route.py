"""What every route is given and what it returns: one signature for all.

A route is `async (services, request, peer) -> Answer`: `Services` holds
what a command may need besides the request (the store, the engine, the
rules of access, the server's gauges, the limits on threads), and the
`Answer` is the reply to write, with an `Undo` when it hands out jobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import trio

from jobserver.core.engine.engine import Engine
from jobserver.core.rules.selection import Taken
from jobserver.storage.backup_types import BackupDirectory
from jobserver.storage.interface import Storage
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import DEFAULT_MAX_REPLY_BYTES

# A query that runs longer than this holds a reader thread and the
# database's read snapshot; it is stopped and answered `555 Timeout`.
DEFAULT_QUERY_SECONDS = 5.0
# Query and Queues run in worker threads; a few at once is plenty for
# people typing.
QUERY_THREADS = 4


# A worker's or a node's name as a job keeps it (RunningJobs): an address
# and port is under 60 bytes; a longer host name is cut.
MAX_WORKER_BYTES = 100


class Peer(str):
    """A client's address as routes take it: the host, a plain str (what
    the rules of access read, is_loopback), with the port of its
    connection, which tells two workers on one host apart."""

    port: int | None

    def __new__(cls, host: str, port: int | None = None) -> Peer:
        peer = super().__new__(cls, host)
        peer.port = port
        return peer


def worker_name(peer: str) -> str:
    """`host:port` of a client (`[host]:port` for IPv6), as a hand-out
    records who took a job; the host alone if the port is unknown."""
    port = getattr(peer, "port", None)
    host = str(peer)
    if port is None:
        return bounded(host)
    return bounded(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


def bounded(text: str) -> str:
    """`text` cut to MAX_WORKER_BYTES of UTF-8, whole characters only."""
    return text.encode("utf-8")[:MAX_WORKER_BYTES].decode("utf-8", "ignore")


def is_loopback(host: str) -> bool:
    """Whether an address (or a --host) is this machine's own."""
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1", "localhost")


# Plain, with slots, as Answer: one per hand-out, and a frozen dataclass's
# __init__ costs several times as much. Nothing changes one once made.
@dataclass(slots=True)
class Undo:
    """The jobs a reply hands out, which go back to the queue if it never
    reaches its client (`run`)."""

    taken: tuple[Taken, ...]
    engine: Engine

    @property
    def job_ids(self) -> tuple[int, ...]:
        return tuple(t.job.jobID for t in self.taken)

    def run(self) -> None:
        self.engine.give_back(list(self.taken))


# Plain, with slots: one or two per request (dispatch._with_ignored makes
# another), and a frozen dataclass's __init__ costs several times as much.
# Nothing changes one once made.
@dataclass(slots=True)
class Answer:
    response: Response
    undo: Undo | None = None
    # A GetJob that waited: counted as it began to (code 0 in the metrics).
    waited: bool = False


class Gauges(Protocol):
    """What Status reports of the server around the core."""

    @property
    def open_connections(self) -> int: ...

    @property
    def commands_served(self) -> int: ...


@dataclass
class NoGauges:
    """The gauges of a core with no server around it (tests)."""

    open_connections: int = 0
    commands_served: int = 0


@dataclass(frozen=True)
class Access:
    """Who may do what (--auth-token-file, --allow-remote-query)."""

    auth_token: str | None = None
    allow_remote_query: bool = False
    query_seconds: float = DEFAULT_QUERY_SECONDS
    # The largest reply Query may build (--max-reply-bytes).
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    # Where Backup writes (--backup-dir); None: nowhere (no file database).
    backup_dir: BackupDirectory | None = None


@dataclass
class Services:
    """What a route may use besides its request."""

    store: Storage
    engine: Engine
    access: Access = Access()
    gauges: Gauges = field(default_factory=NoGauges)
    started: float = field(default_factory=time.monotonic)
    # Query and Queues read in threads, a few at once.
    query_threads: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(QUERY_THREADS)
    )
    # Status counts what running jobs use of each limit one at a time.
    status_thread: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    # Large JSON parameters and bodies are parsed in threads, one at a time:
    # the parse holds the GIL throughout, so more threads would only take
    # it from the event loop more often (params.parse_large_json).
    json_parsing: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    # CRON rules are checked the first time one at a time.
    rule_checks: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    # Waiting GetJobs' patterns are compiled one at a time: each thread
    # that compiles takes turns with the event loop for the interpreter,
    # and 600 at once kept a neighbour's Ping waiting up to 0.48 s.
    pattern_compiles: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(1)
    )
    # One backup at a time: each reads the whole database and holds its
    # log from being checkpointed until it is done.
    backing_up: trio.Lock = field(default_factory=trio.Lock)
    # Answers given, by (command name, status code): for metrics. A
    # waiting GetJob counts, with code 0, when it begins to wait.
    answered: dict[tuple[str, int], int] = field(default_factory=dict)

    def count(self, command: str, code: int) -> None:
        self.answered[command, code] = self.answered.get((command, code), 0) + 1


class Route(Protocol):
    async def __call__(self, services: Services, request: Request, peer: str) -> Answer: ...
