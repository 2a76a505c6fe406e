"""How the worker manager reaches the server: its address (or the nodes of
one queue, each connection going to one of them and moving to another when
it stops answering: jobserver.client), new connections in place of broken
ones, and the backoff between tries while it is down.

Fetching jobs, reporting results and renewing leases each use a connection
of their own, so that none waits behind another (a blocking GetJobs can
take a minute to answer); with several nodes the three spread over them."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from functools import partial

import trio

from jobserver.client.servers import Address, format_address, format_servers
from jobserver.client.trio_client import TrioClient
from jobserver.wire.limits import DEFAULT_CLIENT_MAX_REPLY_BYTES

# Retrying an unreachable server: quick at first (a restart takes a moment),
# then no more often than every 5 s, so a long outage costs nothing.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0

log = logging.getLogger("jobserver.workers")


class Moves:
    """The log of a worker's moves between nodes: a link's new connection
    that went to another node than its last. Links of one purpose that
    move together (the Python worker's two fetchers) make one line: a move
    is logged unless it is the last one logged for its purpose."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[Address, Address]] = {}

    def log(
        self, logger: logging.Logger, purpose: str, left: Address, now: Address
    ) -> None:
        if self.last.get(purpose) == (left, now):
            return
        self.last[purpose] = (left, now)
        logger.info(
            "%s: moved from node %s to node %s", purpose, format_address(left), format_address(now)
        )


@dataclass(frozen=True)
class Server:
    """The job server the manager works for: one address, or the nodes of
    one queue."""

    addresses: tuple[Address, ...]
    token: str | None = None
    tls: ssl.SSLContext | None = None
    # A reply announcing a larger body is a broken connection, not read.
    max_reply_bytes: int = DEFAULT_CLIENT_MAX_REPLY_BYTES
    # Its links' moves between nodes, for the log.
    moves: Moves = field(default_factory=Moves, compare=False, repr=False)

    @property
    def address(self) -> str:
        """`host:port`, IPv6 hosts in brackets, several separated by commas:
        for the log, and for workers as --server takes it."""
        return format_servers(self.addresses)

    def client(self) -> TrioClient:
        """A new client; it connects on its first request."""
        return TrioClient(
            list(self.addresses),
            auth_token=self.token,
            tls=self.tls,
            max_reply_bytes=self.max_reply_bytes,
        )


async def close(client: TrioClient) -> None:
    """Close `client` even while the caller is being cancelled: a connection
    left mid-request tells the server nothing until it is closed."""
    with trio.CancelScope(shield=True):
        await client.aclose()


class Backoff:
    """Exponential waits while the server cannot be reached."""

    def __init__(self) -> None:
        self.delay = 0.0

    @property
    def failing(self) -> bool:
        return self.delay > 0

    def next(self) -> float:
        self.delay = min(self.delay * 2, BACKOFF_MAX) if self.delay else BACKOFF_FIRST
        return self.delay

    def reset(self) -> None:
        """The server answered: the next outage starts from the first wait."""
        self.delay = 0.0


class Link:
    """A connection that outlives its breakages: after each one, it is closed
    and replaced by a new one, to another node if there are several. Each
    move to another node is logged, once, with what the link is for
    (`purpose`: "taking jobs", "reports", "lease renewals")."""

    def __init__(self, server: Server, purpose: str) -> None:
        self.server = server
        self.client = server.client()
        self.client.on_move = partial(server.moves.log, log, purpose)

    async def reconnect(self) -> None:
        """After a broken connection or a 5xx: the node may be gone, or
        without its database, while another serves."""
        await close(self.client)
        self.client.switch_server()

    async def aclose(self) -> None:
        await close(self.client)
