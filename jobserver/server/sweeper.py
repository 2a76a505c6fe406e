"""Read deadlines: one task fires them for every connection.

A connection waiting for its next request must not wait for ever: with no
request under way it is closed after --idle-timeout, and a request begun
must arrive whole within --request-timeout (else `408 Request timeout`).
Each connection notes the deadline of the read under way (connection.py);
this task looks at them every SWEEP_SECONDS and stops the reads whose
deadline has passed. A cancel scope with a deadline on each read would
fire on time, but costs more than the rest of reading a request; a
deadline here fires up to SWEEP_SECONDS late, which protocol.md says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from jobserver.server.app import Server

# How often read deadlines are looked at: how late one may fire.
SWEEP_SECONDS = 0.5


async def sweep_reads(server: Server) -> None:
    """Stop the reads past their deadline, every SWEEP_SECONDS, until cancelled."""
    while True:
        await trio.sleep(SWEEP_SECONDS)
        now = trio.current_time()
        # A copy: a stopped read may end its connection before this is done.
        for connection in list(server.connections):
            connection.sweep(now)
