"""How the worker reaches the server: the worker manager's `Server`,
`Backoff` and reconnecting `Link`, on anyio instead of trio alone.

Fetching jobs, reporting and renewing leases each use a connection of
their own, so that none waits behind another: a waiting GetJobs may not
answer for a minute, and reports must not wait for it."""

from __future__ import annotations

import logging
from functools import partial

import anyio

from jobserver.client.async_client import AsyncClient
from jobserver.client.sync import Client
from jobserver.workers.connection import BACKOFF_MAX, Backoff, Server

__all__ = ["BACKOFF_MAX", "Backoff", "JobClient", "Link", "Server", "client", "close"]

log = logging.getLogger("jobserver.worker")


def client(server: Server) -> AsyncClient:
    """A new client for `server`; it connects on its first request."""
    return AsyncClient(
        list(server.addresses),
        auth_token=server.token,
        tls=server.tls,
        max_reply_bytes=server.max_reply_bytes,
    )


async def close(client: AsyncClient) -> None:
    """Close `client` even while the caller is being cancelled: a connection
    left mid-request tells the server nothing until it is closed."""
    with anyio.CancelScope(shield=True):
        await client.aclose()


class Link:
    """A connection that outlives its breakages: after each one, it is closed
    and replaced by a new one, to another node if there are several."""

    def __init__(self, server: Server, purpose: str) -> None:
        self.server = server
        self.client = client(server)
        # Each move to another node logged once, as the manager's links do.
        self.client.on_move = partial(server.moves.log, log, purpose)

    async def reconnect(self) -> None:
        """After a broken connection or a 5xx: the node may be gone, or
        without its database, while another serves."""
        await close(self.client)
        self.client.switch_server()

    async def aclose(self) -> None:
        await close(self.client)


class JobClient:
    """The client a job's handler enqueues with (`Job.client`): made on
    its first use, for the worker's server (its nodes, token and TLS), a
    blocking `Client` for a handler run in a thread, an `AsyncClient` for
    an async one; closed once the handler has ended (runner.py)."""

    def __init__(self, server: Server, is_async: bool) -> None:
        self.server = server
        self.is_async = is_async
        self.made: AsyncClient | Client | None = None

    def get(self) -> AsyncClient | Client:
        if self.made is None:
            if self.is_async:
                self.made = client(self.server)
            else:
                self.made = Client(
                    list(self.server.addresses),
                    auth_token=self.server.token,
                    tls=self.server.tls,
                    max_reply_bytes=self.server.max_reply_bytes,
                )
        return self.made

    async def aclose(self) -> None:
        made, self.made = self.made, None
        if isinstance(made, AsyncClient):
            await close(made)
        elif made is not None:
            made.close()
