"""The waiting GetJobs as Status shows them: which workers are idle, since
when, and what they wait for.

Read from this node's wait queue (waiters.py), on the event loop: the
oldest waiters merged from the groups of each name waited for (reading
MAX_WAITERS_LISTED of them), the names counted from those groups, and no
database. Another node's waiters are its own.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jobserver.core.engine.waiters import Selector, Waiter, WaitQueue
from jobserver.model import times

# Status lists at most this many waiters (the oldest) and this many
# patterns (those most waiters wait on): enough for a page, and a Status
# stays small with thousands of waiting workers.
MAX_WAITERS_LISTED = 100
MAX_PATTERNS_LISTED = 100
# A pattern may be 12,750 bytes (a list of names); Status shows its start.
MAX_PATTERN_SHOWN = 255


def waiting(waits: WaitQueue, now: datetime) -> dict[str, Any]:
    """Status' `waiting` (the oldest waiters) and `waitingByName`."""
    return {
        "waiting": [_waiter(w, now) for w in waits.oldest(MAX_WAITERS_LISTED)],
        "waitingByName": [
            {"name": _shown(selector), "waiting": count}
            for selector, count in waits.by_selector(MAX_PATTERNS_LISTED)
        ],
    }


def _waiter(waiter: Waiter, now: datetime) -> dict[str, Any]:
    since = waiter.since
    return {
        "peer": waiter.query.worker,
        "name": _shown(waiter.selector),
        "since": times.to_seconds(since) if since else None,
        "seconds": round(max(0.0, (now - since).total_seconds()), 3) if since else None,
    }


def _shown(selector: Selector) -> str:
    """A waiter's `name` as it sent it: the pattern, or its exact names."""
    text = ",".join(selector.patterns or sorted(selector.names))
    return text.encode("utf-8")[:MAX_PATTERN_SHOWN].decode("utf-8", "ignore")
