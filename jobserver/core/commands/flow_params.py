"""The parameters of flow control (protocol.md 14.7, 14.8, 14.23): a
job's cost, time windows, time zone and key, and SetLimit's limit.

Apart from params.py because they are read together, into a job's
FlowOptions or a Limit, and checked against the flow model's own bounds
(model/limits.py, model/windows.py), not the wire's.
"""

from __future__ import annotations

from jobserver.core.commands.params import flag, parse_job_id, present, require, too_large
from jobserver.core.errors import CommandError
from jobserver.model import cron, windows
from jobserver.model.jobs import PLAIN, FlowOptions
from jobserver.model.limits import MAX_KEY, MAX_RATE, Limit, parse_rate
from jobserver.model.names import has_control
from jobserver.wire.framing import Request
from jobserver.wire.limits import MAX_CAPACITY, MAX_COST


def flow_options(request: Request) -> FlowOptions:
    """CreateJob's cost, timeWindows and timeZone (protocol.md 14.7, 14.8)."""
    key = job_key(request)
    cost_text = present(request, "cost")
    cost = 1 if cost_text is None else parse_job_id(cost_text, "cost")
    if cost > MAX_COST:
        raise CommandError("402 Malformed cost")
    windows_text = present(request, "timeWindows")
    zone_text = present(request, "timeZone")
    if windows_text is None:
        # A CRON repeat is read in the zone too (protocol.md 6.1).
        if zone_text is None:
            return PLAIN if cost == 1 and not key else FlowOptions(cost=cost, key=key)
        if not cron.is_cron(request.get("repeat") or ""):
            raise CommandError("402 Missing timeWindows")
        return FlowOptions(cost=cost, zone=_zone(zone_text), key=key)
    try:
        parsed = windows.format_windows(windows.parse_windows(windows_text))
    except ValueError:
        raise CommandError("402 Malformed timeWindows") from None
    zone = _zone(zone_text) if zone_text is not None else "UTC"
    return FlowOptions(cost=cost, windows=parsed, zone=zone, key=key)


def time_zone(request: Request) -> str | None:
    """UpdateJob's timeZone, checked as CreateJob's; None when absent."""
    text = present(request, "timeZone")
    return None if text is None else _zone(text)


def _zone(text: str) -> str:
    zone = text.strip()
    try:
        windows.parse_zone(zone)
    except ValueError:
        raise CommandError("402 Malformed timeZone") from None
    return zone


def capacity(request: Request) -> int:
    """SetLimit's `max`: 0 (none, or remove the limit) or a positive
    capacity; required unless a `rate` or `fair` is given."""
    if not request.has("max") and (request.has("rate") or request.has("fair")):
        return 0
    text = require(request, "max")
    if text == "0":
        return 0
    number = parse_job_id(text, "max")
    if number > MAX_CAPACITY:
        raise CommandError("402 Malformed max")
    return number


def set_limit(request: Request) -> Limit:
    """SetLimit's limit (protocol.md 14.7, 14.23): `max`, `rate`, `perKey`
    and `fair`."""
    rate = None
    text = present(request, "rate")
    if text is not None:
        try:
            rate = parse_rate(text)
        except ValueError:
            raise CommandError(
                f"402 Malformed rate (N/DURATION: 1 to {MAX_RATE} per 1s to 1d, as 100/1m)"
            ) from None
    return Limit(
        max=capacity(request),
        rate=rate,
        per_key=flag(request, "perKey"),
        fair=flag(request, "fair"),
    )


def job_key(request: Request) -> str:
    """CreateJob's `key` (protocol.md 14.23): whose job it is, for per-key
    and fair limits; "" for none."""
    text = present(request, "key")
    if text is None:
        return ""
    if len(text.encode("utf-8")) > MAX_KEY:
        raise too_large("key", MAX_KEY)
    if has_control(text):
        raise CommandError("402 Malformed key")
    return text
