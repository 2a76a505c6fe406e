"""History: what the queues did, minute by minute (protocol.md 14.20).

Read from the engine's ring (engine/history.py) on the event loop: no
database, no thread, a few thousand numbers copied at the most. A read, so
it needs no more access than Status.
"""

from __future__ import annotations

from jobserver.core.commands import params
from jobserver.core.commands.route import Answer, Services
from jobserver.core.commands.views import ok
from jobserver.core.engine import history
from jobserver.core.errors import CommandError
from jobserver.wire.framing import Request, Response
from jobserver.wire.jsonbody import Raw

OFF = "404 No history kept (--history-minutes 0)"


async def history_command(services: Services, request: Request, peer: str) -> Answer:
    ring = services.engine.history
    if not ring.enabled:
        return Answer(Response(OFF))
    queue = _queue(request)
    minutes = _minutes(request, ring.minutes)
    window = ring.read(queue, minutes)
    body = {
        "interval": history.INTERVAL_SECONDS,
        "start": history.utc_text(window.start),
        "startTime": window.start * history.INTERVAL_SECONDS,
        "minutes": minutes,
        "window": ring.minutes,
        "queue": queue,
        "tracked": window.tracked,
        # A queue that took its series while already counted in the totals
        # reads zeros before this minute: the totals have those counts.
        "trackedSince": None if window.since is None else history.utc_text(window.since),
        # Written here as JSON text: the reply's encoder, made for small
        # objects, took 16 ms for a week of six series on the event loop.
        "series": {name: Raw(_numbers(values)) for name, values in window.series.items()},
        "queues": window.queues,
        "other": window.other,
    }
    return Answer(ok(body))


def _numbers(values: list[int]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _queue(request: Request) -> str | None:
    """`name`: one queue (a job name up to its first `/`), or all."""
    if params.present(request, "name") is None:
        return None
    name = params.name(request)
    if "/" in name:
        raise CommandError("402 Malformed name: a queue has no '/'")
    return name


def _minutes(request: Request, window: int) -> int:
    """`minutes`: the last 1 to `window` minutes; all of them if absent."""
    text = params.present(request, "minutes")
    if text is None:
        return window
    if not text.isascii() or not text.isdigit() or len(text) > 6:
        raise CommandError("402 Malformed minutes")
    minutes = int(text)
    if not 1 <= minutes <= window:
        raise CommandError(f"402 Malformed minutes: 1 to {window}")
    return minutes
