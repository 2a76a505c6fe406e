"""Whether a node is alone on its database: then a commit's notice
(postgres_listen.py) has nobody to tell, and is not sent.

Each commit that makes jobs due sends a notice for the other nodes, and the
node's own listener hears it as well and drops it. On a node alone, a single
CreateJob from one client spent an eighth of the node's CPU on that
(bench/pg_peers.py: 712 µs of it a request with the notice, 622 without; 821
against 910 jobs a second; docs/benchmarks.md). So a writer looks, at most
once per LOOK_SECONDS and within its BEGIN's round trip, for any session on
the database other than this node's lasting connections (its writers, its
listener, its statistics) that is a client's or whose kind it cannot see (a
background process, autovacuum's among them, counts then too):
pg_stat_activity shows every session's database and process to every role,
and its kind only to the session's own role (or pg_read_all_stats). Any such
session counts, whatever it is (another node, of any version or role; a
psql; an application listening on the channel itself; one of this node's own
short reads), and the notice is sent. A look older than LOOK_SECONDS decides
nothing: the notice is sent.

Another session can only make the node send its notices. One limit: a
connection of this node whose backend PostgreSQL ended counts as the node's
own until the node next uses it and finds it closed, so a session that a
new backend of the same process number serves meanwhile is taken for the
node's. A node that joins is seen by the others at their next look: a
commit that decided before it, on a look at most LOOK_SECONDS old, may send
nothing the joining node's listener would have heard. So a listener that
starts, or connects again, looks at everything at once and again
SETTLE_SECONDS later (postgres_listen.py), by when such a commit has
ended if its COMMIT took under two seconds: its GetJobs and AwaitJobs then
find what it missed. A COMMIT slower than that (synchronous replication
waiting on a standby, a disk that stalls) while a node joins may leave an
AwaitJob on the joining node waiting for its timeout; its GetJobs are still
found by the listener's look at everything once a second.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import psycopg

# How often a writer looks for other sessions, at most; a look older than
# this decides nothing.
LOOK_SECONDS = 1.0
# When a listener that starts looks at everything again: a look's age, and
# two seconds for a commit decided on one to end.
SETTLE_SECONDS = LOOK_SECONDS + 2.0


class Company:
    """The node's lasting connections, and what its writers' last look found;
    shared by the node's writers (each in a thread of its own) and its
    listener."""

    def __init__(self) -> None:
        self._own: dict[str, psycopg.Connection[Any]] = {}
        # Whether the last look found another session, and when it was taken
        # (time.monotonic). None seen yet: the notice is sent.
        self._last = (True, -math.inf)
        # Notices the node's commits sent (what the tests read).
        self.notices = 0
        self._counting = threading.Lock()
        # When the last of them was made (time.monotonic): a writer whose
        # attempt failed before then need not wait to try again.
        self.connected_at = -math.inf

    def own(self, role: str, db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
        """`db` is this node's connection for `role` (in place of any
        before); it counts as nobody else while it is open."""
        self._own[role] = db
        self.connected_at = time.monotonic()
        return db

    def look_due(self, now: float) -> bool:
        return now - self._last[1] >= LOOK_SECONDS

    def look(self) -> bytes:
        """The statement that looks for any other client session on this
        database: one row, true if there is one. A session of another role
        shows its database and process but not its kind (NULL without
        pg_read_all_stats): one whose kind is not known counts."""
        pids = ",".join(str(pid) for pid in self._open_pids())
        return (
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND coalesce(backend_type, 'client backend') = 'client backend' "
            f"AND pid <> ALL ('{{{pids}}}'::int[]))"
        ).encode()

    def saw(self, anyone: bool, looked_at: float) -> None:
        self._last = (anyone, looked_at)

    def must_tell(self, now: float) -> bool:
        """Whether a commit now sends its notice."""
        anyone, looked_at = self._last
        return anyone or now - looked_at > LOOK_SECONDS

    def told(self) -> None:
        """A commit sent its notice."""
        with self._counting:
            self.notices += 1

    def _open_pids(self) -> list[int]:
        pids = []
        for db in list(self._own.values()):
            # A closed connection's process may be another session's by now.
            if not db.closed:
                try:
                    pids.append(int(db.info.backend_pid))
                except psycopg.Error:
                    continue
        return pids
