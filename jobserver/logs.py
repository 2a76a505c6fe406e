"""Log lines that a client can cause, rate-limited.

A client that can make connections fail, or end them in a way the server
logs, must not be able to fill the disk with the server's log: such lines
go to loggers with a `RateLimit` filter.
"""

from __future__ import annotations

import logging
import time


class RateLimit(logging.Filter):
    """Lets at most `burst` records through per `window` seconds; the next
    one let through says how many were dropped before it."""

    def __init__(self, burst: int, window: float) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.window_start = -window
        self.passed = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.window_start >= self.window:
            self.window_start, self.passed = now, 0
        if self.passed >= self.burst:
            self.dropped += 1
            return False
        self.passed += 1
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} such lines dropped before this one)"
            self.dropped = 0
        return True
