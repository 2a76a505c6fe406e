"""`Settings`: how a worker runs, as `jobserver worker`'s options set it
(arguments.py checks each) or an application passes it to Worker.run."""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """How a worker runs; `jobserver worker --help` says what each does."""

    host: str = "127.0.0.1"
    port: int = 8888
    token: str | None = None
    tls: ssl.SSLContext | None = None
    concurrency: int = 8
    timeout: float = 3600.0  # a handler's, unless it has its own
    grace: float = 30.0
    touch_interval: float = 30.0
    jobs: str | None = None  # the GetJobs name; None: the worker's
    signals: bool = True  # SIGTERM and SIGINT stop it (main thread only)
