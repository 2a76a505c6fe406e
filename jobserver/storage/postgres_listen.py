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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import trio

log = logging.getLogger("jobserver")

# How often a node looks for itself, whatever it heard.
FALLBACK_SECONDS = 1.0
# After losing the listening connection, the pause before the next attempt.
RECONNECT_SECONDS = 0.5

# heard(ready names, earliest future time): ready None means "anything".
Heard = Callable[["set[str] | None", "str | None"], None]


async def listen(
    connect: Callable[[], psycopg.Connection[Any]], channel: str, node: str, heard: Heard
) -> None:
    """Forever, until cancelled."""
    lost = False
    while True:
        try:
            db = await trio.to_thread.run_sync(connect)
        except psycopg.Error as error:
            if not lost:
                log.error("cannot listen for other nodes: %s", error)
            lost = True
            heard(None, None)
            await trio.sleep(RECONNECT_SECONDS)
            continue
        try:
            db.execute(f'LISTEN "{channel}"'.encode())
            if lost:
                log.info("listening for other nodes again")
            lost = False
            # What happened while nobody listened.
            heard(None, None)
            await _hear(db, node, heard)
        except (psycopg.Error, OSError) as error:
            log.error("lost the connection that listens for other nodes: %s", error)
            lost = True
        finally:
            db.close()
        await trio.sleep(RECONNECT_SECONDS)


async def _hear(db: psycopg.Connection[Any], node: str, heard: Heard) -> None:
    pgconn = db.pgconn
    fd = pgconn.socket
    while True:
        with trio.move_on_after(FALLBACK_SECONDS) as idle:
            await trio.lowlevel.wait_readable(fd)
        if idle.cancelled_caught:
            heard(None, None)
            continue
        pgconn.consume_input()
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError("the connection is closed")
        while (notice := pgconn.notifies()) is not None:
            _deliver(notice.extra.decode("utf-8", "replace"), node, heard)


def _deliver(payload: str, node: str, heard: Heard) -> None:
    try:
        notice = json.loads(payload)
        if notice.get("node") == node:
            return
        ready = notice.get("ready")
        due = notice.get("due")
        names = None if ready is None else {str(name) for name in ready}
        heard(names, str(due) if due is not None else None)
    except (ValueError, AttributeError, TypeError):
        log.warning("a notice on the jobs channel that is not jobserver's: %.100r", payload)
        heard(None, None)
