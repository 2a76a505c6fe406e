"""Ping and Status: what the server says of itself.

Status reads its counts in the writer, one consistent look, and what
running jobs use of each limit, and the hand-outs in each rate's window,
in a thread, on connections of the store's own: matching every running
job's name against every limit, and counting every key's hand-outs, must
hold up neither the writer nor the event loop.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import trio

from jobserver import __version__
from jobserver.core.commands import waiting
from jobserver.core.commands.route import Answer, Services
from jobserver.core.commands.views import ok
from jobserver.core.engine.context import Context
from jobserver.core.rules import flow
from jobserver.model import times
from jobserver.model.jobs import State
from jobserver.model.limits import Limit
from jobserver.wire.framing import Request, Response


async def ping(services: Services, request: Request, peer: str) -> Answer:
    return Answer(Response("200 OK"))


async def status(services: Services, request: Request, peer: str) -> Answer:
    engine = services.engine
    counts, limits, paused, early, size = await engine.call(_snapshot)
    try:
        in_use = await _limits_in_use(services, limits)
    except services.store.errors as error:
        return Answer(Response(f"503 Database unavailable: {error}"))
    body = {
        "version": __version__,
        "uptime": round(time.monotonic() - services.started, 3),
        "database": {"path": services.store.path, "bytes": size},
        "jobs": counts,
        "waitingGetJobs": len(engine.waits),
        "connections": services.gauges.open_connections,
        "commandsServed": services.gauges.commands_served,
        "transactions": engine.batches,
        "limits": in_use,
        "paused": sorted(paused),
        "replies": {"waiting": counts.get(State.WAITING, 0), "early": early},
        # This node's waiting GetJobs: who, since when, for what.
        **waiting.waiting(engine.waits, engine.now()),
    }
    return Answer(ok(body))


async def _limits_in_use(services: Services, limits: dict[str, Limit]) -> dict[str, Any]:
    """Each limit and what is used of it, one Status at a time."""
    if not limits:
        return {}
    now = times.utcnow()
    at = times.to_millis(now)
    # Where each rate's window starts, as the hand-outs count it (selection.py).
    windows = {
        pattern: times.to_millis(now - timedelta(milliseconds=limit.rate.window_ms))
        for pattern, limit in limits.items()
        if limit.rate is not None
    }
    store = services.store

    def read() -> tuple[dict[str, flow.Use], dict[str, int]]:
        used = flow.running_under(limits, store.running_by_name(at))
        return used, store.handouts_in_windows(windows) if windows else {}

    used, handed = await trio.to_thread.run_sync(read, limiter=services.status_thread)
    return {
        pattern: _shown(limit, used[pattern], handed.get(pattern, 0))
        for pattern, limit in sorted(limits.items())
    }


def _shown(limit: Limit, use: flow.Use, handed: int) -> dict[str, object]:
    """A limit as set, and what is used of it: the cost of its running
    jobs; for a rate, the hand-outs in its window (of its busiest key, for
    a per-key rate: how near the key nearest its rate is); for a per-key
    limit, how many keys have jobs running under it."""
    shown = {**limit.describe(), "running": use.running}
    if limit.rate is not None:
        shown["inWindow"] = handed
    if limit.per_key:
        shown["keys"] = use.keys
    return shown


def _snapshot(
    ctx: Context,
) -> tuple[dict[str, int], dict[str, Limit], frozenset[str], int, int]:
    """Job counts, the concurrency limits, the paused patterns, the early
    replies not yet awaited, and the database's size (a query, on PostgreSQL)."""
    store = ctx.store
    return (
        store.count_by_state(), dict(store.limits), store.paused,
        store.early_replies(ctx.now_ms), store.size_bytes(),
    )
