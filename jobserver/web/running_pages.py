"""The dashboard's "Running now": the jobs handed out, with the workers that
took them, and the idle workers by the name they wait for.

Part of the live part of `/` (refreshed from `/live`): RunningJobs for
the jobs, the longest running first unless the page asks `?running=newest`
(the refresh asks with the page's own query, so the order stays), and
Status' waiting GetJobs (this node's) for the idle workers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from jobserver.wire.framing import Response as WireResponse

# Jobs listed: a screen's worth, at a glance; the total says how many more.
RUNNING_SHOWN = 50
# Peers named per waited-for name: the rest are counted.
PEERS_SHOWN = 10
# The page's query parameter, and the orders it may ask.
ORDER_PARAMETER = "running"
ORDERS = ("oldest", "newest")

# The dashboard's way of asking a wire command (Dashboard._call).
Call = Callable[..., Awaitable[WireResponse]]


async def running_now(
    call: Call, request: Request, status: dict[str, Any] | None
) -> dict[str, Any]:
    """The live context's "running" entry."""
    order = request.query_params.get(ORDER_PARAMETER, ORDERS[0])
    if order not in ORDERS:
        order = ORDERS[0]
    reply = await call(request, "RunningJobs", limit=str(RUNNING_SHOWN), order=order)
    listed = json.loads(reply.body) if reply.code == 200 else None
    jobs: list[dict[str, Any]] = listed["jobs"] if listed else []
    return {
        "running": {
            "order": order,
            "other_order": ORDERS[1] if order == ORDERS[0] else ORDERS[0],
            "jobs": jobs,
            "oldest": _oldest(jobs, order, listed),
            "total": listed["total"] if listed else 0,
            "error": "" if listed else reply.status,
            "waiting": _waiting_by_name(status or {}),
        }
    }


def _oldest(jobs: list[dict[str, Any]], order: str, listed: dict[str, Any] | None) -> int | None:
    """The jobID of the longest running job, if the list shows it."""
    if not jobs or listed is None:
        return None
    if order == ORDERS[0]:
        return int(jobs[0]["jobID"])
    # Newest first: the oldest is the last row only when none are left out.
    return int(jobs[-1]["jobID"]) if not listed.get("more") else None


def _waiting_by_name(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each name waited for, with how many GetJobs wait for it and the
    peers of those Status lists (the oldest waiters)."""
    peers: dict[str, list[str]] = {}
    for waiter in status.get("waiting") or []:
        peers.setdefault(waiter.get("name", ""), []).append(waiter.get("peer", ""))
    return [
        {
            "name": entry["name"],
            "waiting": entry["waiting"],
            "peers": peers.get(entry["name"], [])[:PEERS_SHOWN],
            "unnamed": entry["waiting"] - len(peers.get(entry["name"], [])[:PEERS_SHOWN]),
        }
        for entry in status.get("waitingByName") or []
    ]
