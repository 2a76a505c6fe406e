"""What every route reads of an HTTP request: its body, up to a bound,
and the client's address (for the dispatcher, which lets only loopback
clients run Query unless told otherwise)."""

from __future__ import annotations

from starlette.requests import Request

from jobserver.core.commands.route import Peer


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None past `limit` bytes (read no further than that):
    at once when its Content-Length says so, else as it arrives. A body
    declared larger was waited for, up to the body's timeout (30 s), before
    it was refused."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def peer(request: Request) -> str:
    """The client's host, with its port (a GetJob records both)."""
    client = request.client
    return Peer(client.host, client.port) if client is not None else ""
