"""What the kernel holds for a TCP connection, read from /proc/net/tcp: lets a
test see that the server has read a request (nothing left in its receive
queue) or is stuck writing a reply (bytes piling up in its send queue),
without guessing with sleeps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
# An earlier connection between the same two ports may linger in TIME_WAIT
# (or other closing states); only a live one is looked at.
LIVE_STATES = (1, 8)  # ESTABLISHED, CLOSE_WAIT


@dataclass(frozen=True)
class Queues:
    state: int
    # Bytes written but not yet acknowledged by the other end.
    send: int
    # Bytes received but not yet read by the socket's owner.
    receive: int


def queues(local_port: int, remote_port: int) -> Queues | None:
    """The live loopback socket bound to `local_port` and connected to
    `remote_port`, or None if there is none (any more)."""
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, counts = fields[1], fields[2], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) != local_port:
                continue
            if int(remote.rsplit(":", 1)[1], 16) != remote_port:
                continue
            if int(state, 16) not in LIVE_STATES:
                continue
            send, receive = (int(n, 16) for n in counts.split(":"))
            return Queues(int(state, 16), send, receive)
    return None
