"""`Settings`: how a worker runs, as `jobserver worker`'s options set them
or an application passes them to `Worker.run`; each is range-checked here,
so a worker made in code is held to the same bounds as one on the
command line."""

from __future__ import annotations

import math
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

from jobserver.client.endpoint import check_max_reply_bytes
from jobserver.client.servers import Address, parse_servers
from jobserver.wire.limits import DEFAULT_CLIENT_MAX_REPLY_BYTES, MAX_TIMEOUT
from jobserver.workers.leases import DEFAULT_LEASE, check_lease

# Each running job is a task or a thread: more than this is a mistake.
MAX_CONCURRENCY = 10_000
# Worker processes under one `jobserver worker` (processes.py).
MAX_PROCESSES = 64
# Jobs held beyond the slots: each is RUNNING on the server while it waits.
MAX_PREFETCH = 10_000
MAX_GRACE = 86400.0
MAX_TOUCH_INTERVAL = 3600.0


@dataclass(frozen=True)
class Settings:
    """How a worker runs; `jobserver worker --help` says what each does.
    ValueError for a value out of its range."""

    host: str = "127.0.0.1"
    port: int = 8888
    token: str | None = None
    tls: ssl.SSLContext | None = None
    concurrency: int = 8
    # Jobs held beyond the free slots, at most: prefetch.py says how many.
    prefetch: int = 1000
    timeout: float = 3600.0  # a handler's, unless it has its own
    grace: float = 30.0
    touch_interval: float = 30.0
    # The lease asked for on each job without retryAfter (protocol.md
    # 14.24), renewed while it runs: a dead worker's jobs are back when it
    # ends. 0: none (RUNNING, until --stale-after).
    lease: int = DEFAULT_LEASE
    jobs: str | None = None  # the GetJobs name; None: the worker's
    signals: bool = True  # SIGTERM and SIGINT stop it (main thread only)
    # A reply announcing a larger body is a broken connection, not read.
    max_reply_bytes: int = DEFAULT_CLIENT_MAX_REPLY_BYTES
    # The nodes of one queue, instead of host and port: "HOST:PORT" strings
    # or (host, port) pairs, or one string of them separated by commas.
    servers: str | Sequence[str | Address] = ()

    # The addresses to connect to, from servers, else host and port.
    addresses: tuple[Address, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not (type(self.port) is int and 0 < self.port < 65536):
            raise ValueError(f"port must be 1 to 65535, not {self.port!r}")
        addresses = parse_servers(self.servers) if self.servers else ((self.host, self.port),)
        object.__setattr__(self, "addresses", addresses)  # frozen: set once, here
        if not (type(self.concurrency) is int and 1 <= self.concurrency <= MAX_CONCURRENCY):
            raise ValueError(
                f"concurrency must be 1 to {MAX_CONCURRENCY}, not {self.concurrency!r}"
            )
        if not (type(self.prefetch) is int and 0 <= self.prefetch <= MAX_PREFETCH):
            raise ValueError(f"prefetch must be 0 to {MAX_PREFETCH}, not {self.prefetch!r}")
        _seconds("timeout", self.timeout, MAX_TIMEOUT, zero=False)
        _seconds("grace", self.grace, MAX_GRACE, zero=True)
        _seconds("touch_interval", self.touch_interval, MAX_TOUCH_INTERVAL, zero=False)
        check_lease(self.lease)
        check_max_reply_bytes(self.max_reply_bytes)


def _seconds(name: str, value: float, high: float, zero: bool) -> None:
    low = "0" if zero else "above 0"
    if not (
        isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if zero else value > 0)
        and value <= high
    ):
        raise ValueError(f"{name} must be seconds from {low} to {high:g}, not {value!r}")
