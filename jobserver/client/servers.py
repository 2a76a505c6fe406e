"""Which server a client connects to: one address, or the nodes of a queue
served by several (docs/nodes.md), and the order in
which a client tries them.

Each client starts at a node of its own: clients made one after another
in a process start one node further each time, from a random node, so
that the connections of many workers spread evenly over the nodes. A new
connection goes to that node first, then to each other in turn, once; a
client that leaves a node (its connection broke, or it answered 5xx)
starts its next connection at another node picked at random, so that the
clients of a node that died spread over the others instead of all moving
to its neighbour.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Iterator, Sequence
from typing import TypeAlias

from jobserver.wire.limits import DEFAULT_HOST, DEFAULT_PORT

# (host, port).
Address: TypeAlias = tuple[str, int]
# What a client is told to connect to: a host (its port given apart), one
# string of HOST:PORT addresses separated by commas (one of them alone
# too), or a list of them (each "HOST:PORT" or (host, port)).
ServersArgument: TypeAlias = "str | Sequence[str | Address]"

# A queue worth several nodes has a handful: a list longer than this is a
# mistake (a file of hosts pasted in), and each address costs a connection
# attempt when all are down.
MAX_SERVERS = 16


def _random_below(bound: int) -> int:
    """A random number from 0 to `bound` - 1 (`bound` at most 65536): not
    the random module, whose import would cost every command's start-up
    more than this whole module."""
    return int.from_bytes(os.urandom(2), "big") % bound


# Where the next client made in this process starts (modulo its count of
# servers); from a random place, so that processes spread too.
_spread = itertools.count(_random_below(1 << 16))

_ADDRESS = re.compile(r"(?:\[(?P<ipv6>[^\[\]]+)\]|(?P<host>[^:\[\]\s]+))(?::(?P<port>[0-9]{1,5}))?")


def parse_address(address: str, default_port: int | None = DEFAULT_PORT) -> Address:
    """`host:port`, `host`, `[ipv6]:port` or `[ipv6]` -> (host, port); the
    port is `default_port` (8888) when not given. With `default_port`
    None, an address without a port is refused (the command line's rule)."""
    match = _ADDRESS.fullmatch(address.strip())
    if match is not None and match["port"] is None and default_port is None:
        raise ValueError(
            f"a server address needs its port, HOST:PORT or [IPV6]:PORT (such as "
            f"{DEFAULT_HOST}:{DEFAULT_PORT}), not {address!r}"
        )
    port = int(match["port"] or default_port or 0) if match else 0
    if match is None or not 0 < port < 65536:
        forms = "HOST, HOST:PORT or [IPV6]:PORT" if default_port else "HOST:PORT or [IPV6]:PORT"
        raise ValueError(f"not a server address ({forms}, PORT 1 to 65535): {address!r}")
    return match["ipv6"] or match["host"], port


def is_bare_ipv6(host: str) -> bool:
    """Whether `host` is an IPv6 address without brackets ("::1",
    "fe80::1%eth0"): a host, not "HOST:PORT", though it holds colons."""
    address, _, zone = host.strip().partition("%")
    if address.count(":") < 2 or (zone and not zone.isprintable()):
        return False
    try:
        socket.inet_pton(socket.AF_INET6, address)
    except OSError:
        return False
    return True


def format_address(address: Address) -> str:
    """`host:port`, an IPv6 host in brackets, as parse_address reads it."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_servers(addresses: Sequence[Address]) -> str:
    """The addresses as --server and $JOBSERVER_SERVER take them: HOST:PORT,
    separated by commas."""
    return ",".join(format_address(address) for address in addresses)


def parse_servers(
    servers: ServersArgument, default_port: int | None = DEFAULT_PORT
) -> tuple[Address, ...]:
    """The addresses of `servers`: one string of addresses separated by
    commas, or a list of "HOST:PORT" strings or (host, port) pairs; a
    port left out is `default_port` (refused if None, as on the command
    line). ValueError, saying what is wrong, for no address, more than
    MAX_SERVERS, one that is not an address, or one listed twice."""
    items: Sequence[str | Address] = servers.split(",") if isinstance(servers, str) else servers
    if not items or (isinstance(servers, str) and not servers.strip()):
        raise ValueError("no server address given: give HOST:PORT, or several separated by commas")
    if len(items) > MAX_SERVERS:
        raise ValueError(f"{len(items)} server addresses given: a client takes 1 to {MAX_SERVERS}")
    addresses: list[Address] = []
    for item in items:
        address = _pair(item) if isinstance(item, tuple) else parse_address(item, default_port)
        if address in addresses:
            raise ValueError(f"server address {format_address(address)} is listed twice")
        addresses.append(address)
    return tuple(addresses)


def _pair(item: tuple[object, ...]) -> Address:
    """A (host, port) pair given as it is, checked as an address would be."""
    if not (
        len(item) == 2
        and isinstance(item[0], str)
        and item[0]
        and type(item[1]) is int
        and 0 < item[1] < 65536
    ):
        raise ValueError(f"not a server address ((host, port), port 1 to 65535): {item!r}")
    return item[0], item[1]


class Servers:
    """The addresses a client connects to, and where it is among them."""

    def __init__(self, addresses: tuple[Address, ...]) -> None:
        self.addresses = addresses
        # The server of the current (or last tried) connection.
        self.current = next(_spread) % len(addresses)
        # The server the next connection tries first.
        self.first = self.current
        # The server the client last moved away from: tried last.
        self.left: int | None = None

    @property
    def now(self) -> Address:
        return self.addresses[self.current]

    def rotation(self) -> Iterator[Address]:
        """Each server once, from the one to try first, the one last moved
        away from at the end; `current` follows. A caller that stops at a
        server that answered keeps it for the next connections; one that
        tried them all starts where it did."""
        start, count = self.first, len(self.addresses)
        order = sorted(((start + step) % count for step in range(count)), key=self._left_last)
        for index in order:
            self.current = self.first = index
            yield self.now
        self.first = start

    def move_on(self) -> None:
        """Start the next connection at another server than the current
        one, picked at random, and come back to this one last. Does
        nothing with one server."""
        count = len(self.addresses)
        if count > 1:
            self.left = self.current
            self.first = (self.current + 1 + _random_below(count - 1)) % count

    def _left_last(self, index: int) -> bool:
        return index == self.left
