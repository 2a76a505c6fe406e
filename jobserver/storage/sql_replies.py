"""Replies kept under a client's key, in the SQL both backends speak:
DeliverReply's for the job that awaits it (AwaitReply, protocol.md 14.11
and 14.12), and a request's own reply under its idempotency key (14.22),
for the writer's connection.

Both are rows of their own tables (replies, idempotency) keyed by what a
client chose, kept until they expire and pruned then; where other nodes
write, a key is what two nodes' requests wait on each other by. Apart
from the jobs' own operations (sql_store.py), which they touch only to
find the job WAITING on a key.
"""

from __future__ import annotations

from jobserver.model.jobs import Job
from jobserver.storage import sql
from jobserver.storage.sql import JOB
from jobserver.storage.sql_statements import Statements


class ReplyStatements(Statements):
    """The named operations on replies and idempotency keys."""

    # Replies (protocol.md 14.11). A key's lock orders a DeliverReply and
    # an AwaitReply on two nodes.

    def waiting_on(self, key: str) -> Job | None:
        d = self.dialect
        self._lock("reply", key)
        return self._job(
            f"SELECT {JOB} FROM jobs WHERE state = {sql.WAITING_SQL} AND replyKey = {d.mark}"
            f"{d.lock}",
            (key,),
        )

    def overdue(self, now: str, limit: int) -> list[Job]:
        """WAITING jobs whose reply deadline has passed, earliest first."""
        d = self.dialect
        return self._jobs(
            f"SELECT {JOB} FROM jobs {d.indexed_by('jobsWaiting')} "
            f"WHERE state = {sql.WAITING_SQL} AND nextRun <= {d.mark} "
            f"ORDER BY nextRun LIMIT {d.mark}{d.skip_locked}",
            (now, limit),
        )

    def reply(self, key: str, now: str) -> tuple[str, int] | None:
        """A kept reply's data and the job it went to (0: none yet); None
        if there is none, or it expired (and is deleted here)."""
        m = self.dialect.mark
        self._lock("reply", key)
        row = self._one(f"SELECT data, jobID, expires FROM replies WHERE replyKey = {m}", (key,))
        if row is None:
            return None
        if row[2] <= now:
            self._execute(f"DELETE FROM replies WHERE replyKey = {m}", (key,))
            return None
        return row[0], int(row[1])

    def keep_reply(self, key: str, data: str, received: str, expires: str, job_id: int) -> None:
        marks = ", ".join(self.dialect.mark for _ in range(5))
        self._execute(
            f"INSERT INTO replies (replyKey, data, received, expires, jobID) VALUES ({marks}) "
            "ON CONFLICT (replyKey) DO UPDATE SET data = excluded.data, "
            "received = excluded.received, expires = excluded.expires, jobID = excluded.jobID",
            (key, data, received, expires, job_id),
        )

    def claim_reply(self, key: str, job_id: int) -> None:
        m = self.dialect.mark
        self._execute(f"UPDATE replies SET jobID = {m} WHERE replyKey = {m}", (job_id, key))

    def early_replies(self, now: str) -> int:
        """Unexpired replies that no job has claimed yet."""
        row = self._one(
            f"SELECT COUNT(*) FROM replies WHERE jobID = 0 AND expires > {self.dialect.mark}",
            (now,),
        )
        return int(row[0])

    # Idempotency keys (protocol.md 14.22). A key is claimed by inserting
    # its row: a second transaction with the same key waits on that row
    # (its primary key) until the first ends, then finds its reply; other
    # keys wait on nothing (a lock slot shared by hash made unrelated
    # creates on two nodes wait on each other, and deadlock).

    def idempotent(self, key: str, now: str) -> tuple[str, str] | None:
        m = self.dialect.mark
        claimed = self._execute(
            "INSERT INTO idempotency (idempotencyKey, request, reply, expires) "
            f"VALUES ({m}, '', '', '') ON CONFLICT (idempotencyKey) DO NOTHING",
            (key,),
        )
        if claimed.rowcount == 1:
            return None
        row = self._one(
            f"SELECT request, reply, expires FROM idempotency WHERE idempotencyKey = {m}"
            f"{self.dialect.lock}",
            (key,),
        )
        if row is None or row[2] <= now:
            # Expired (or pruned just now): the request is done anew, and
            # keep_idempotent writes over it.
            return None
        return str(row[0]), str(row[1])

    def keep_idempotent(self, key: str, request: str, reply: str, expires: str) -> None:
        marks = ", ".join(self.dialect.mark for _ in range(4))
        self._execute(
            f"INSERT INTO idempotency (idempotencyKey, request, reply, expires) VALUES ({marks}) "
            "ON CONFLICT (idempotencyKey) DO UPDATE SET request = excluded.request, "
            "reply = excluded.reply, expires = excluded.expires",
            (key, request, reply, expires),
        )

    # Retention (protocol.md 14.10).

    def prune_replies(self, now: str, batch: int) -> int:
        """Delete up to `batch` expired replies; how many went."""
        d = self.dialect
        rows = self._execute(
            "DELETE FROM replies WHERE replyKey IN (SELECT replyKey FROM replies "
            f"WHERE expires <= {d.mark} ORDER BY expires LIMIT {d.mark}{d.skip_locked})",
            (now, batch),
        )
        return max(rows.rowcount, 0)

    def prune_idempotency(self, now: str, batch: int) -> int:
        """Delete up to `batch` expired idempotency keys; how many went."""
        d = self.dialect
        rows = self._execute(
            "DELETE FROM idempotency WHERE idempotencyKey IN (SELECT idempotencyKey "
            f"FROM idempotency WHERE expires <= {d.mark} ORDER BY expires "
            f"LIMIT {d.mark}{d.skip_locked})",
            (now, batch),
        )
        return max(rows.rowcount, 0)
