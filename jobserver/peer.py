"""What the operating system knows about the client's end of a connection.

A reply written to a socket has only reached the kernel's send buffer. If
the client closed its socket before the reply arrived (a worker killed after
sending GetJob), the write still succeeds: the client's kernel answers the
data with a reset. For a reply that hands out jobs that matters, since jobs
in a reply nobody will read must go back to the queue. `took_reply` tells
the two apart from the TCP state, on Linux; elsewhere it assumes the reply
was taken, and leases and the stale-job safety net recover the jobs.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
from typing import Any

import trio

# How long to wait for the client's kernel to acknowledge a reply with jobs,
# once the client has closed its sending side: several round trips on any
# real network. Past it the reply counts as taken (no job runs twice).
ACK_PATIENCE = 5.0

# Linux TCP states (include/net/tcp_states.h).
_TCP_CLOSE = 7
_TCP_CLOSE_WAIT = 8
# struct tcp_info (include/uapi/linux/tcp.h) starts with the state byte.
# Its byte counters, which a reset leaves as they were, are at these
# offsets; kernels before 4.19 return a shorter struct without them.
_TCP_INFO_SIZE = 216
_BYTES_ACKED = 120
_BYTES_SENT = 200
_BYTES_RETRANS = 208
_LINUX = sys.platform.startswith("linux")


def transport_socket(stream: trio.abc.Stream) -> Any:
    """The trio socket under a plain or TLS stream, or None."""
    transport = getattr(stream, "transport_stream", stream)
    return getattr(transport, "socket", None)


def address(stream: trio.abc.Stream) -> str:
    """The client's address, or "" when the socket no longer knows it."""
    sock = transport_socket(stream)
    try:
        return str(sock.getpeername()[0]) if sock is not None else ""
    except OSError:
        return ""


def describe(stream: trio.abc.Stream) -> str:
    """`host:port` of the client, for the log."""
    sock = transport_socket(stream)
    try:
        host, port = sock.getpeername()[:2]
    except (AttributeError, OSError):
        return "?"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1", "localhost")


def _state_and_unacked(sock: Any) -> tuple[int, int, bytes]:
    """The TCP state, the bytes written that the client's kernel has not
    acknowledged, and the whole tcp_info. Read in this order: a reset
    empties the send queue, and it changes the state before that, so an
    empty queue seen before a state that is not CLOSE really was
    acknowledged."""
    buffer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    unacked = struct.unpack("i", buffer)[0]
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    return info[0], unacked, info


def _acknowledged_all(info: bytes) -> bool:
    """Whether, by the connection's byte counters, the client's kernel had
    acknowledged every byte sent to it (before a reset that came later: a
    client that read its reply and then closed with unread data or
    SO_LINGER 0). False where the kernel does not keep the counters."""
    if len(info) < _TCP_INFO_SIZE:
        return False
    (acked,) = struct.unpack_from("=Q", info, _BYTES_ACKED)
    sent, retransmitted = struct.unpack_from("=QQ", info, _BYTES_SENT)
    return acked >= sent - retransmitted


async def took_reply(stream: trio.abc.Stream, patience: float = ACK_PATIENCE) -> bool:
    """Whether the client can have received what was just written to it.

    False only when the client had closed its end before the reply reached
    it: its kernel answered with a reset. A client that merely closed its
    sending side (`nc -N`) still reads, and its kernel acknowledges the
    reply, which is enough.
    """
    sock = transport_socket(stream)
    if not _LINUX or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return True
    pause = 0.001
    with trio.move_on_after(patience):
        while True:
            try:
                state, unacked, info = _state_and_unacked(sock)
            except OSError:
                return False
            if state == _TCP_CLOSE:
                return _acknowledged_all(info)
            if state != _TCP_CLOSE_WAIT or unacked == 0:
                # Still open both ways (the client reads, or its later death
                # is the lease's business), or all of it acknowledged.
                return True
            await trio.sleep(pause)
            pause = min(pause * 2, 0.05)
    return True
