"""Idempotency keys of CreateJob and CreateJobs (protocol.md 14.22): a
request sent again with the key of one already done creates nothing and
gets the first one's reply.

A client that lost a reply (the connection broke, or `504 Outcome
unknown`) cannot tell whether its jobs were made; sent with a key of its
choosing, the request may be sent again, to any node, as often as it
takes. The first request to commit under a key keeps the key, a
fingerprint of its parameters and its reply for `--idempotency-keep`; a
later one with the key and the same parameters is answered that reply,
and one with other parameters is refused (a key used twice by mistake
must not drop the second request's jobs unnoticed). The key is looked up
under its lock before anything is created, so two nodes given one key at
once create the jobs once.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

from jobserver.core.commands import known_headers, params
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.model import times
from jobserver.model.names import has_control
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import MAX_IDEMPOTENCY_KEY

PARAMETER = "idempotencyKey"
REUSED = "409 Idempotency key used by another request"


def key_of(request: Request) -> str | None:
    """The request's idempotency key, checked; None if it has none."""
    key = params.present(request, PARAMETER)
    if key is None:
        return None
    if len(key.encode("utf-8", "surrogatepass")) > MAX_IDEMPOTENCY_KEY:
        raise params.too_large(PARAMETER, MAX_IDEMPOTENCY_KEY)
    if has_control(key):
        raise CommandError(f"402 Malformed {PARAMETER}")
    return key


def replay(ctx: Context, request: Request, key: str | None) -> Response | None:
    """The reply of the request done under `key`, if one was and the key
    has not expired; refused if that request had other parameters."""
    if key is None:
        return None
    kept = ctx.store.idempotent(key, ctx.now_ms)
    if kept is None:
        return None
    fingerprint, reply = kept
    if fingerprint != fingerprint_of(request):
        raise CommandError(REUSED)
    return Response("200 OK", reply.encode("utf-8"))


def remember(ctx: Context, request: Request, key: str | None, response: Response) -> None:
    """Keep this request's reply under `key`, in its own transaction, for
    --idempotency-keep."""
    if key is None:
        return
    expires = times.to_millis(ctx.now + timedelta(seconds=ctx.settings.idempotency_keep))
    ctx.store.keep_idempotent(
        key, fingerprint_of(request), response.body.decode("utf-8"), expires
    )


def fingerprint_of(request: Request) -> str:
    """What makes two requests the same: the command and the parameters it
    reads, as sent (the key itself, the token and the framing's headers
    aside), hashed."""
    read = known_headers.KNOWN_HEADERS[request.verb.lower()]
    named = sorted(
        (name, value)
        for name, value in request.headers.items()
        if name in read and name != PARAMETER.lower()
    )
    text = json.dumps([request.verb.lower(), named], ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
