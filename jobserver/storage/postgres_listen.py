"""Hearing the other nodes: LISTEN on the queue's channel, on the event loop.

Every transaction that makes jobs due, or writes a future time, sends a
notice (PostgresStore.announce, and jobserver_create_job for jobs made in
an application's own transaction); PostgreSQL delivers it when that
transaction commits, and never if it rolls back. The listener's
connection is watched with trio's wait_readable, so a notice wakes the
waiting GetJobs it concerns with no thread and no polling.

A notice can be lost (this node was reconnecting, or the payload was
dropped), so every FALLBACK_SECONDS, and after every reconnection, the
listener says "anything may have changed": the wait queue then tries all
its waiters and asks the store when the clock must next fire.

A notice is an untrusted hint: any role that may connect to the database
may send anything on the channel (protocol.md, "Several nodes"). So a
payload is bounded in size and nesting before it is parsed, its shape is
checked strictly (`read_notice`), a bad one is ignored and logged at most
once a minute, the hints of many notices are merged into one bounded
delivery, and nothing a notice holds, nor any exception while handling
one, ends the listener: at worst the wait queue looks at everything once
more.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import trio

from jobserver.model import times
from jobserver.model.names import has_control
from jobserver.storage.postgres_alone import SETTLE_SECONDS
from jobserver.wire.limits import MAX_NAME

log = logging.getLogger("jobserver")

# How often a node looks for itself, whatever it heard.
FALLBACK_SECONDS = 1.0
# After losing the listening connection, the pause before the next attempt.
RECONNECT_SECONDS = 0.5

# PostgreSQL takes payloads under 8000 bytes; anything longer is not ours.
MAX_PAYLOAD_BYTES = 8000
# A notice is an object holding one list: more JSON arrays and objects than
# this (outside strings) are refused before parsing, which bounds the
# parser's nesting far below Python's recursion limit.
MAX_PAYLOAD_BRACKETS = 16
# The names one notice may list (ours list at most 7000 bytes of them).
MAX_READY_NAMES = 7000
# The awaited jobs one notice may say ended (ours: under 7000 bytes of
# jobIDs), and one delivery may carry, past which it says "any of them".
MAX_ENDED_JOBS = 3000
MAX_HEARD_ENDED = 1024
# The names one delivery to the wait queue may carry, merged from every
# notice read in one round; past it the round becomes a recheck.
MAX_HEARD_NAMES = 256
# Notices read before the event loop runs something else.
NOTICES_PER_ROUND = 64
# A recheck asked for by notices (not the fallback) comes at most this often.
MIN_RECHECK_SECONDS = 0.1
# A bad notice is logged at most once per this many seconds, with a count.
BAD_NOTICE_LOG_SECONDS = 60.0

# heard(ready names, earliest future time, awaited jobs that ended): ready
# None means "anything", ended None "any awaited job may have ended".
Heard = Callable[["set[str] | None", "str | None", "frozenset[int] | None"], None]

# A stored time (model/times.py): seconds, optionally with a fraction.
_STORED_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?")
# A backslash and the character it escapes.
_ESCAPE = re.compile(r"\\.", re.DOTALL)


@dataclass(frozen=True)
class Hint:
    """What a notice says: names made due (None: anything may be), and the
    earliest future time its commit wrote."""

    ready: frozenset[str] | None
    due: str | None
    # Awaited jobs its commit ended (AwaitJob); None: any may have.
    ended: frozenset[int] | None = frozenset()


@dataclass(frozen=True)
class BadNotice:
    """A payload that is not a notice of jobserver's, and why."""

    reason: str


# A node's own notice: its commit already woke its own waiters.
NOTHING = Hint(frozenset(), None)


def read_notice(payload: bytes, node: str) -> Hint | BadNotice:
    """The hint a payload gives, or why it gives none. Never raises: the
    payload comes from anyone who may connect to the database."""
    try:
        return _read(payload, node)
    except _Refused as refused:
        return BadNotice(str(refused))
    except (ValueError, TypeError, RecursionError, MemoryError) as error:
        # Left over for what the checks above missed: still a bad notice.
        return BadNotice(f"unreadable: {type(error).__name__}")


class _Refused(Exception):
    pass


def _read(payload: bytes, node: str) -> Hint:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise _Refused(f"{len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise _Refused("not UTF-8") from None
    if _nesting(text) > MAX_PAYLOAD_BRACKETS:
        raise _Refused(f"more than {MAX_PAYLOAD_BRACKETS} arrays and objects")
    try:
        notice = json.loads(text)
    except ValueError:
        raise _Refused("not JSON") from None
    if not isinstance(notice, dict):
        raise _Refused("not a JSON object")
    sender = notice.get("node")
    if sender is not None and not isinstance(sender, str):
        raise _Refused("node is not a string")
    if sender == node:
        return NOTHING
    ended = _ended(notice["ended"]) if "ended" in notice else frozenset()
    return Hint(_ready(notice.get("ready")), _due(notice.get("due")), ended)


def _nesting(text: str) -> int:
    """An upper bound of the nesting depth: the arrays and objects opened
    outside strings, all counted in C, in time linear in the text.

    Without escapes, the parts between quotes alternate outside and inside
    strings. In valid JSON a backslash only escapes within a string, so
    dropping each escape with its character keeps that true; where the
    text is not valid JSON, the parser stops at the first fault, and up to
    it the count is exact.
    """
    brackets = text.count("[") + text.count("{")
    if brackets <= MAX_PAYLOAD_BRACKETS or '"' not in text:
        return brackets
    outside = _ESCAPE.sub("", text).split('"')[::2]
    return sum(part.count("[") + part.count("{") for part in outside)


def _ready(value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _Refused("ready is not a list")
    if len(value) > MAX_READY_NAMES:
        raise _Refused(f"ready lists over {MAX_READY_NAMES} names")
    for name in value:
        if not _is_job_name(name):
            raise _Refused("ready holds something that is not a job name")
    return frozenset(value)


def _ended(value: object) -> frozenset[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _Refused("ended is not a list")
    if len(value) > MAX_ENDED_JOBS:
        raise _Refused(f"ended lists over {MAX_ENDED_JOBS} jobs")
    for job_id in value:
        if not isinstance(job_id, int) or isinstance(job_id, bool) or not 0 < job_id < 2**63:
            raise _Refused("ended holds something that is not a jobID")
    return frozenset(value)


def _is_job_name(value: object) -> bool:
    """As CreateJob checks a name (core/commands/params.name)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return size <= MAX_NAME and not has_control(value)


def _due(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _STORED_TIME.fullmatch(value):
        raise _Refused("due is not a stored time")
    try:
        times.parse_stored(value)
    except ValueError:
        raise _Refused("due is not a stored time") from None
    return value


class _Round:
    """The hints of the notices read in one round, merged into one bounded
    delivery: names up to MAX_HEARD_NAMES, else "anything"."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.anything = False
        self.due: str | None = None
        # Awaited jobs that ended; None: any may have.
        self.ended: set[int] | None = set()

    def add(self, hint: Hint) -> None:
        if hint.due is not None and (self.due is None or hint.due < self.due):
            self.due = hint.due
        if self.ended is not None:
            if hint.ended is None or len(self.ended) + len(hint.ended) > MAX_HEARD_ENDED:
                self.ended = None
            else:
                self.ended |= hint.ended
        if self.anything:
            return
        if hint.ready is None or len(self.names) + len(hint.ready) > MAX_HEARD_NAMES:
            self.anything = True
            self.names = set()
        else:
            self.names |= hint.ready


class _Quiet:
    """Says a thing once, then at most once per BAD_NOTICE_LOG_SECONDS with
    how many more there were: a flood of bad notices is a few log lines."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.next_at = 0.0
        self.unsaid = 0

    def say(self, describe: Callable[[], str]) -> None:
        """`describe` is called only when the line is logged."""
        now = trio.current_time()
        if now < self.next_at:
            self.unsaid += 1
            return
        detail = describe()
        more = f" ({self.unsaid} more since the last said)" if self.unsaid else ""
        log.warning("%s: %s%s", self.what, detail, more)
        self.unsaid = 0
        self.next_at = now + BAD_NOTICE_LOG_SECONDS


async def listen(
    connect: Callable[[], psycopg.Connection[Any]], channel: str, node: str, heard: Heard
) -> None:
    """Forever, until cancelled."""
    listener = _Listener(node, heard)
    lost = False
    while True:
        try:
            db = await trio.to_thread.run_sync(connect)
        except Exception as error:  # noqa: BLE001 - tried again, never the node's end
            if not lost:
                log.error("cannot listen for other nodes: %s", error)
            lost = True
            listener.recheck(lost=True)
            await trio.sleep(RECONNECT_SECONDS)
            continue
        try:
            db.execute(f'LISTEN "{channel}"'.encode())
            if lost:
                log.info("listening for other nodes again")
            lost = False
            # What happened while nobody listened; and again once every node
            # has seen this one (postgres_alone.py: a node alone sends no
            # notices, until its next look).
            listener.recheck(lost=True)
            listener.settle_at = trio.current_time() + SETTLE_SECONDS
            await listener.hear(db)
        except Exception as error:  # noqa: BLE001 - the boundary of the listener
            # psycopg's, the socket's, or a bug: this connection ends, the
            # listener does not.
            listener.lost_connection.say(partial(_describe, error))
            lost = True
        finally:
            _close(db)
        await trio.sleep(RECONNECT_SECONDS)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _close(db: psycopg.Connection[Any]) -> None:
    try:
        db.close()
    except Exception as error:  # noqa: BLE001 - the connection is dropped anyway
        log.debug("closing the listening connection: %s", error)


class _Listener:
    def __init__(self, node: str, heard: Heard) -> None:
        self.node = node
        self.heard = heard
        self.bad_notice = _Quiet("ignored a notice on the jobs channel that is not jobserver's")
        self.failed = _Quiet("handling a notice from another node failed")
        self.lost_connection = _Quiet("lost the connection that listens for other nodes")
        # When the wait queue last looked at everything, and whether a
        # notice asked it to again.
        self.rechecked_at = -FALLBACK_SECONDS
        self.recheck_owed = False
        # When to look at everything, the awaiters too, once more.
        self.settle_at = math.inf

    async def hear(self, db: psycopg.Connection[Any]) -> None:
        pgconn = db.pgconn
        fd = pgconn.socket
        while True:
            with trio.move_on_at(self._next_recheck_at()) as idle:
                await trio.lowlevel.wait_readable(fd)
            if not idle.cancelled_caught:
                pgconn.consume_input()
                if pgconn.status != psycopg.pq.ConnStatus.OK:
                    raise psycopg.OperationalError("the connection is closed")
                # Outside the timeout: what libpq holds must all be read
                # now, since the socket will not say so again.
                await self._read_all(pgconn)
            now = trio.current_time()
            if now >= self.settle_at:
                self.settle_at = math.inf
                self.recheck(lost=True)
            elif now >= self._next_recheck_at():
                self.recheck()

    def _next_recheck_at(self) -> float:
        if self.recheck_owed:
            return min(self.rechecked_at + MIN_RECHECK_SECONDS, self.settle_at)
        return min(self.rechecked_at + FALLBACK_SECONDS, self.settle_at)

    async def _read_all(self, pgconn: Any) -> None:
        """Every notice libpq has read, NOTICES_PER_ROUND at a time, with
        the event loop free between rounds."""
        while True:
            gathered = _Round()
            for _ in range(NOTICES_PER_ROUND):
                notice = pgconn.notifies()
                if notice is None:
                    self._deliver(gathered)
                    return
                self._add(gathered, notice.extra)
            self._deliver(gathered)
            await trio.lowlevel.checkpoint()

    def _add(self, gathered: _Round, payload: bytes) -> None:
        found = read_notice(payload, self.node)
        if isinstance(found, BadNotice):
            self.bad_notice.say(lambda: f"{found.reason}: {payload[:100]!r}")
        else:
            gathered.add(found)

    def _deliver(self, gathered: _Round) -> None:
        due = gathered.due
        if due is not None and due <= times.to_millis(times.utcnow()):
            # A time already past would fire the clock at once, a recheck
            # by another name: it waits its turn like one.
            self.recheck_owed, due = True, None
        ended = None if gathered.ended is None else frozenset(gathered.ended)
        if gathered.anything:
            self.recheck_owed = True
            if ended != frozenset():
                # The awaiters hear at once all the same.
                self._call(set(), None, ended)
        elif gathered.names or due is not None or ended != frozenset():
            self._call(set(gathered.names), due, ended)

    def recheck(self, lost: bool = False) -> None:
        """Tell the wait queue to look at everything; after notices may
        have been lost (no connection listened), the awaiters too, once:
        an awaited job may have ended unheard."""
        self.recheck_owed = False
        self.rechecked_at = trio.current_time()
        self._call(None, None, None if lost else frozenset())

    def _call(
        self, ready: set[str] | None, due: str | None, ended: frozenset[int] | None
    ) -> None:
        try:
            self.heard(ready, due, ended)
        except Exception as error:  # noqa: BLE001 - a hint that failed is a recheck later
            # The wait queue's state is its own; the next recheck (within a
            # second) tries every waiter again.
            self.failed.say(partial(_describe, error))
            if ready is not None:
                self.recheck_owed = True
