"""Who may do what over HTTP.

With an auth token (`--auth-token-file`) the API and the metrics want it as
`Authorization: Bearer TOKEN`. The dashboard's pages may be looked at
without it, but acting through them (requeue, delete, pause, ...) needs
the bearer header or the sign-in cookie. Without a token everything is
open, as on the wire.

The cookie holds a value derived from the token, not the token itself: a
cookie that leaks lets its holder act through the dashboard, but not speak
the wire protocol. It is HttpOnly (no script reads it), SameSite=Strict (no
other site's page sends it) and Secure when the server speaks TLS. An
action's `Origin`, when the browser sends one, must be this server: a
second guard against another site's form posting here.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

SESSION_COOKIE = "jobserver_session"
# What the cookie's value is derived from, with the token as the key.
_SESSION_PURPOSE = b"jobserver dashboard session"


def bearer(request: Request, token: str | None) -> bool:
    """Whether the request carries the token as a bearer (or none is needed)."""
    if token is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Constant time, so the reply's timing does not reveal a prefix.
    return hmac.compare_digest(given.strip().encode(), token.encode())


def session_value(token: str) -> str:
    return hmac.new(token.encode(), _SESSION_PURPOSE, hashlib.sha256).hexdigest()


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def may_act(request: Request, token: str | None) -> bool:
    """Whether the dashboard acts for this request: no token is needed, or
    it comes as a bearer or as the sign-in cookie."""
    if token is None or bearer(request, token):
        return True
    cookie = request.cookies.get(SESSION_COOKIE, "")
    return hmac.compare_digest(cookie.encode(), session_value(token).encode())


def same_origin(request: Request) -> bool:
    """Whether a POST comes from this server's own pages: its `Origin`, if
    any, names the host the request was sent to. (A browser sends Origin
    with every form POST; programs that send none are judged by their
    token alone.)"""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:  # not a URL (a broken IPv6 address)
        return False
    return bool(host) and netloc.lower() == host.lower()


def sign_in(response: Response, token: str, secure: bool) -> None:
    response.set_cookie(
        SESSION_COOKIE, session_value(token), httponly=True, samesite="strict", secure=secure
    )


def sign_out(response: Response, secure: bool) -> None:
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict", secure=secure)
