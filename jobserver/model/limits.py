"""What a limit is (protocol.md 14.7, 14.23): a GLOB pattern's concurrency
capacity, its rate, and whether it holds each key apart and rotates its
hand-outs between keys. Plain data, shared by the core, the storage
backends and the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from jobserver.model import times

# A rate counts at most this many hand-outs in a window: each search that
# meets a rate-limited job reads the hand-outs of its window (an index
# range), so the count bounds that read.
MAX_RATE = 10_000
# The longest window: hand-outs older than it are of no use to any rate
# and are deleted (storage's prune_handouts).
MAX_RATE_WINDOW_MS = 86_400_000
MIN_RATE_WINDOW_MS = 1_000
MAX_KEY = 255
# SetLimit's `max` (wire.limits.MAX_CAPACITY).
MAX_CAPACITY = 1_000_000_000

_RATE = re.compile(r"([0-9]{1,5})/([0-9]{1,5})(s|m|h|d)")
_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


@dataclass(frozen=True)
class Rate:
    """At most `count` hand-outs in any window of `window_ms`."""

    count: int
    window_ms: int

    def __str__(self) -> str:
        for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000)):
            if self.window_ms % size == 0:
                return f"{self.count}/{self.window_ms // size}{unit}"
        return f"{self.count}/{self.window_ms // 1000}s"


@dataclass(frozen=True)
class Limit:
    """What holds the jobs a pattern matches. `max` is a concurrency
    capacity in cost units (0: none), `rate` a number of hand-outs per
    window (None: none); with `per_key` both count each job key apart;
    with `fair` hand-outs rotate between keys."""

    max: int = 0
    rate: Rate | None = None
    per_key: bool = False
    fair: bool = False

    @property
    def is_set(self) -> bool:
        """False for a limit that holds nothing: setting it removes one."""
        return bool(self.max or self.rate or self.fair)

    def describe(self) -> dict[str, object]:
        """What Status and the JSON API show of it: `max` always (0 for
        none), the rest when set."""
        shown: dict[str, object] = {"max": self.max}
        if self.rate is not None:
            shown["rate"] = str(self.rate)
        if self.per_key:
            shown["perKey"] = True
        if self.fair:
            shown["fair"] = True
        return shown


def parse_rate(text: str) -> Rate:
    """`5/1s`, `100/1m`, `1000/1h`, `10/1d`: ValueError outside the bounds."""
    found = _RATE.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"not a rate (N/DURATION, as 100/1m): {text!r}")
    count = int(found.group(1))
    window_ms = int(found.group(2)) * _UNIT_MS[found.group(3)]
    if not 1 <= count <= MAX_RATE:
        raise ValueError(f"a rate counts 1 to {MAX_RATE} hand-outs")
    if not MIN_RATE_WINDOW_MS <= window_ms <= MAX_RATE_WINDOW_MS:
        raise ValueError("a rate's window is 1s to 1d")
    return Rate(count, window_ms)


def handouts_cutoff(now: str) -> str:
    """Hand-outs before this moment are outside every rate's window."""
    moment = times.parse_stored(now) - timedelta(milliseconds=MAX_RATE_WINDOW_MS)
    return times.to_millis(moment)


def parse_spec(spec: str) -> Limit:
    """`--limit`'s side after `=`: a comma list of a capacity (`10`),
    `rate:N/DURATION`, `perKey` and `fair`, in any order
    (`2,rate:5/1s,perKey`); ValueError for anything else or a limit that
    holds nothing."""
    most, rate, per_key, fair = 0, None, False, False
    for item in (part.strip() for part in spec.split(",")):
        if item.isdigit() and len(item) <= 10 and 1 <= int(item) <= MAX_CAPACITY:
            most = int(item)
        elif item.startswith("rate:"):
            rate = parse_rate(item.removeprefix("rate:"))
        elif item == "perKey":
            per_key = True
        elif item == "fair":
            fair = True
        else:
            raise ValueError(
                f"not a limit: {item!r} (MAX 1 to {MAX_CAPACITY:,}, rate:N/DURATION, perKey, fair)"
            )
    limit = Limit(max=most, rate=rate, per_key=per_key, fair=fair)
    if not limit.is_set:
        raise ValueError("a limit needs MAX, rate:N/DURATION or fair")
    return limit
