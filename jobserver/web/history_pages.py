"""The dashboard's graphs: what the queues did, minute by minute.

- `GET /history.json?queue=NAME&minutes=N`: the History command's reply
  (protocol.md 14.20), for the graphs' script (static/graphs.js), which
  draws it with the vendored uPlot and asks again every few seconds;
- `GET /queues/{queue}`: one queue's page, its jobs by state (Queues) and
  its own graphs.

Both only read, through the dispatcher, as the rest of the dashboard
does. The JSON is refused to a request another site's page sent (the
same rule as the dashboard's forms, access.cross_site): a read must not
reach another site's script, whatever the browser would let it see.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobserver.core.commands import params
from jobserver.web import access
from jobserver.wire.framing import Response as WireResponse
from jobserver.wire.limits import MAX_QUEUES

# The graphs' span when the page asks for none: an hour shows a trend
# at a glance; `minutes` asks for up to the server's whole window.
GRAPH_MINUTES = 60
# Seconds between the graphs' refreshes: a minute's bar grows as you look.
GRAPH_REFRESH_SECONDS = 5
JSON_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}

Call = Callable[..., Awaitable[WireResponse]]


class Pages(Protocol):
    """What the dashboard lends these handlers to render a page."""

    def __call__(
        self, request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> Response: ...


class HistoryPages:
    def __init__(
        self, call: Call, page: Pages, message: Callable[[Request, int, str, str], Response]
    ) -> None:
        self._call = call
        self._page = page
        self._message = message

    def routes(self) -> list[Route]:
        return [
            Route("/history.json", self.history, methods=["GET"]),
            Route("/queues/{queue}", self.queue, methods=["GET"]),
        ]

    async def history(self, request: Request) -> Response:
        why = access.cross_site(request)
        if why:
            return JSONResponse({"error": f"refused: {why}"}, 403, headers=JSON_HEADERS)
        query = request.query_params
        wanted = {"name": query.get("queue", ""), "minutes": query.get("minutes", "")}
        reply = await self._call(request, "History", **{k: v for k, v in wanted.items() if v})
        if reply.code == 200:
            return Response(reply.body, media_type="application/json", headers=JSON_HEADERS)
        # A bad parameter is the asker's (400); history turned off is 404.
        status = 400 if reply.code == 402 else reply.code if reply.code == 404 else 503
        return JSONResponse({"error": reply.status}, status, headers=JSON_HEADERS)

    async def queue(self, request: Request) -> Response:
        name = request.path_params["queue"]
        if len(name.encode()) > params.MAX_NAME or params.has_control(name) or "/" in name:
            return self._message(request, 404, "No such queue", "That is not a queue's name.")
        reply = await self._call(request, "Queues", limit=str(MAX_QUEUES))
        found, error = None, ""
        if reply.code == 200:
            listed = json.loads(reply.body)["queues"]
            found = next((q for q in listed if q["queue"] == name), None)
        else:
            error = reply.status
        return self._page(
            request,
            "queue.html",
            {
                "queue": name,
                "found": found,
                "queues_error": error,
                "graph_minutes": GRAPH_MINUTES,
                "graph_refresh": GRAPH_REFRESH_SECONDS,
            },
        )
