"""Hypercorn, serving the HTTP application inside the server's trio run.

The socket is bound first, with the wire protocol's (`listen`), so that a
port in use stops the server at start with a plain error, before it says
it is listening; serving comes later, in the server's nursery (`serve`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from jobserver.core.dispatch import Dispatcher
from jobserver.web import app

log = logging.getLogger("jobserver")

# Requests in flight when the server stops get this long to finish.
GRACE_SECONDS = 3.0


@dataclass
class Listening:
    config: HypercornConfig
    sockets: Sockets
    port: int

    def close(self) -> None:
        for sock in (*self.sockets.secure_sockets, *self.sockets.insecure_sockets):
            sock.close()


def listen(host: str, port: int, tls: tuple[str, str | None] | None) -> Listening:
    """Bind the HTTP port; OSError, naming the address, if it cannot be."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = GRACE_SECONDS
    # The server's own log says what matters; Hypercorn's access log would
    # write a line per request.
    config.accesslog = None
    config.errorlog = logging.getLogger("jobserver.http")
    if tls is not None:
        config.certfile, config.keyfile = tls
    try:
        sockets = config.create_sockets()
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            sock.listen(config.backlog)
    except OSError as error:
        raise OSError(error.errno, f"{config.bind[0]}: {error.strerror}") from error
    bound = sockets.secure_sockets or sockets.insecure_sockets
    return Listening(config, sockets, bound[0].getsockname()[1])


async def serve(
    listening: Listening, dispatcher: Dispatcher, auth_token: str | None, stopping: trio.Event,
    host_names: Iterable[str], session_seconds: float,
) -> None:
    """Serve until `stopping` is set; `host_names` and `session_seconds`
    are app.build's."""
    # Starlette is an ASGI application; its type names ASGI's messages
    # differently from Hypercorn's.
    application: Any = app.build(
        dispatcher, auth_token, listening.config.ssl_enabled, host_names, session_seconds
    )
    log.info("HTTP on %s", f"{listening.config.bind[0].rsplit(':', 1)[0]}:{listening.port}")
    await worker_serve(
        wrap_app(application, listening.config.wsgi_max_body_size, "asgi"),
        listening.config,
        sockets=listening.sockets,
        shutdown_trigger=stopping.wait,
    )
