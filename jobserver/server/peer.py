"""What the operating system knows about the client's end of a connection.

A reply written to a socket has only reached the kernel's send buffer. For
a reply that hands out jobs that matters: jobs in a reply nobody received
must go back to the queue, and jobs a worker did receive must not, even if
that worker resets its connection a moment later.

A reply written whole while the client's socket was open counts as
received: it arrives in the client's receive buffer, and what the client
does with it then (reads it, or dies with it unread) cannot be told apart
from outside; not even by acknowledgements, since a client that reads and
at once resets its connection may never acknowledge (Linux delays ACKs, and
ignores the one a reset carries). Leases and the stale-job safety net
recover the jobs of a worker that died.

One case is clear, though: a client that had closed its side before the
reply was written (a worker killed after sending GetJob: its FIN came
first). Its kernel acknowledges the reply only if the client still reads (a
half-close, as `nc -N` does); if the client is gone, it answers with a
reset. The kernel counts the bytes the client acknowledged over the whole
connection (`tcpi_bytes_acked`, Linux 4.1 and later) and keeps the count
after a reset, so `Deliveries` notes how far into the byte stream such a
reply ends, and when the connection ends, a reply whose end was never
acknowledged gives its jobs back. Elsewhere every reply written counts as
received.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

import trio

from jobserver.core.commands.route import Peer

# How long a connection that ends waits for the client's kernel to
# acknowledge its last replies with jobs: several round trips on any real
# network, and short enough not to hold up a shutdown. Past it, a reply
# counts as received (no job runs twice).
ACK_PATIENCE = 1.0

_TCP_CLOSE = 7
_TCP_CLOSE_WAIT = 8
# struct tcp_info: tcpi_bytes_acked is the u64 at byte 120.
_BYTES_ACKED_AT = 120
_TCP_INFO_SIZE = 128
_LINUX = sys.platform.startswith("linux")

Item = TypeVar("Item")


def transport_socket(stream: trio.abc.Stream) -> Any:
    """The trio socket under a plain or TLS stream, or None."""
    transport = getattr(stream, "transport_stream", stream)
    return getattr(transport, "socket", None)


def address(stream: trio.abc.Stream) -> str:
    """The client's address (with its port: route.Peer), or "" when the
    socket no longer knows it."""
    sock = transport_socket(stream)
    try:
        name = sock.getpeername() if sock is not None else None
    except OSError:
        return ""
    if not isinstance(name, tuple) or len(name) < 2:
        return ""
    return Peer(str(name[0]), int(name[1]))


def describe(stream: trio.abc.Stream) -> str:
    """`host:port` of the client, for the log."""
    sock = transport_socket(stream)
    try:
        host, port = sock.getpeername()[:2]
    except (AttributeError, OSError):
        return "?"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class Deliveries:
    """Replies with jobs written to a client that had closed its side,
    until the client's kernel has acknowledged every byte of them."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        sock = transport_socket(stream)
        tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        self._sock = sock if _LINUX and tcp and _counts_acks(sock) else None
        # (byte mark the reply ends at, its jobs), oldest first.
        self._pending: deque[tuple[int, Sequence[Any]]] = deque()

    def client_closed(self) -> bool:
        """Whether the client has closed its side (FIN or reset). Asked just
        before a reply is written: nothing runs between this and the write,
        whereas after it the client may have read, and reset, already."""
        if self._sock is None:
            return False
        try:
            return self._counters()[1] in (_TCP_CLOSE_WAIT, _TCP_CLOSE)
        except OSError:
            return True

    def written(self, jobs: Sequence[Item]) -> None:
        """A reply with these jobs was just written whole, to a client that
        had closed its side (`client_closed`)."""
        if self._sock is None:
            return
        try:
            # Acknowledged first, then what is still queued: a byte that is
            # acknowledged in between is counted in neither, so the mark
            # can only fall short of the reply's end, never pass it.
            acked, _ = self._counters()
            queued = _queued(self._sock)
        except OSError:
            acked, queued = 0, 1 << 62
        self._forget_received(acked)
        self._pending.append((acked + queued, jobs))

    async def unreceived(self, patience: float = ACK_PATIENCE) -> list[Item]:
        """Once the connection is over: the jobs of replies the client's
        kernel never acknowledged (a reset, or a close, came first)."""
        if not self._pending:
            return []
        pause = 0.001
        with trio.move_on_after(patience):
            while True:
                try:
                    acked, state = self._counters()
                except OSError:
                    break
                self._forget_received(acked)
                if not self._pending:
                    return []
                if state == _TCP_CLOSE:
                    break
                await trio.sleep(pause)
                pause = min(pause * 2, 0.05)
        if self._sock is not None and self._still_open():
            # No answer either way within the patience: taken as received,
            # so that a slow network never makes a job run twice.
            return []
        return [job for _, jobs in self._pending for job in jobs]

    def _counters(self) -> tuple[int, int]:
        """Bytes the client acknowledged so far, and the TCP state."""
        if self._sock is None:
            raise OSError("no TCP socket")
        info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        return struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0], info[0]

    def _forget_received(self, acked: int) -> None:
        while self._pending and self._pending[0][0] <= acked:
            self._pending.popleft()

    def _still_open(self) -> bool:
        try:
            return self._counters()[1] != _TCP_CLOSE
        except OSError:
            return False


def _counts_acks(sock: Any) -> bool:
    """Whether this kernel reports tcpi_bytes_acked (Linux 4.1 and later)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except OSError:
        return False
    return len(info) >= _BYTES_ACKED_AT + 8


def _queued(sock: Any) -> int:
    """Bytes written to the socket that the client has not acknowledged."""
    buffer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", buffer)[0])
