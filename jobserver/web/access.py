"""Who may do what over HTTP.

Loopback is not a credential: a page on any site, open in a browser on the
server's machine, can send requests to 127.0.0.1. So, token or not:

- Every request must name this server in its `Host`: an IP address,
  `localhost`, or a name the operator gave (`--http-host`). A page on
  evil.example whose name an attacker's DNS points at 127.0.0.1 (DNS
  rebinding) sends `Host: evil.example:PORT`, and is refused (421) before
  any route runs, GETs of the dashboard and /metrics included (such a page
  could read their answers).
- The JSON API (`/api/*`, `POST /queue`) takes only
  `Content-Type: application/json`, which a browser sends to another
  origin only after a CORS preflight that this server never approves;
  and it refuses a request whose `Origin` is not this server or whose
  `Sec-Fetch-Site` says another site sent it (`403`). A program (curl with
  the header, urllib, any HTTP library) sends no Origin and passes.
- The dashboard's forms (actions, sign in, sign out) are refused the same
  way when another site sent them.

With an auth token (`--auth-token-file`) the API and the metrics want it as
`Authorization: Bearer TOKEN`. The dashboard's pages may be looked at
without it, but acting through them (requeue, delete, pause, ...) needs
the bearer header or a session from signing in with the token.

A session is a random id in a cookie (HttpOnly, SameSite=Strict, Secure
over TLS), kept by the server in memory: it ends when its lifetime does
(`--session-lifetime`), at Sign out, and when the server restarts. Wrong
sign-ins from one client address are slowed down (`SignInThrottle`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

SESSION_COOKIE = "jobserver_session"
# Sessions kept at once; past it the oldest ends. Only a holder of the
# token can open one, so this bounds a script's loop, not a stranger's.
MAX_SESSIONS = 1024
# A session id is 32 random bytes in base64url: 43 characters.
_SESSION_BYTES = 32
_MAX_SESSION_TEXT = 64

# Wrong sign-ins from one client address: this many are answered at once;
# each further one shuts that address out of signing in for a penalty that
# doubles from FIRST_PENALTY up to MAX_PENALTY (429 with Retry-After). A
# quiet FORGET_FAILURES_AFTER, or a right sign-in, starts it afresh.
FREE_FAILURES = 5
FIRST_PENALTY_SECONDS = 1.0
MAX_PENALTY_SECONDS = 60.0
FORGET_FAILURES_AFTER = 15 * 60.0
# Client addresses whose failures are remembered; past it the one that
# failed longest ago is forgotten, so memory stays bounded whatever the
# number of addresses, and an address can only lose others' penalties
# (which helps no one but them), never add to them.
MAX_THROTTLED_CLIENTS = 4096
# IPv6 clients are counted by their /64: one host usually holds a whole one.
_IPV6_CLIENT_PREFIX = 64

# Names a Host may carry besides the operator's (--http-host): these cannot
# be pointed elsewhere by anyone's DNS.
_ALWAYS_OURS = frozenset({"localhost"})
MAX_HOST_NAME = 253
# How much of a refused Host the answer repeats.
_SHOWN = 100

# Routes that answer JSON; every other path is the dashboard's.
_JSON_PATHS = ("/api/", "/queue", "/metrics", "/healthz", "/openapi.json")


# The Host header (DNS rebinding).


def host_name(header: str) -> str | None:
    """The name in a Host header (`name`, `name:port`, `[v6]:port`), lower
    case and without a trailing dot; None if it is not such a header."""
    if header.startswith("["):
        literal, bracket, port = header[1:].partition("]")
        if not bracket or (port and not (port[0] == ":" and _is_port(port[1:]))):
            return None
        return literal.lower()
    name, colon, port = header.rpartition(":")
    if not colon:
        name = port
    elif not _is_port(port) or ":" in name:
        return None
    name = name.lower().removesuffix(".")
    if not name or len(name) > MAX_HOST_NAME:
        return None
    return name


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def known_host(header: str, names: frozenset[str]) -> bool:
    """Whether a Host header names this server: an IP address, localhost,
    or one of `names` (--http-host)."""
    name = host_name(header)
    if name is None:
        return False
    return name in _ALWAYS_OURS or name in names or is_ip_literal(name)


class KnownHostsOnly:
    """ASGI middleware: a request whose Host is not one of this server's
    names is answered 421 before any route sees it. A request with no Host
    at all (HTTP/1.0) names nothing a browser could have sent, and passes."""

    def __init__(self, app: Any, names: Iterable[str]) -> None:
        self._app = app
        self._names = frozenset(names)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            hosts = [value for name, value in scope["headers"] if name == b"host"]
            shown = hosts[0].decode("latin-1") if hosts else ""
            if len(hosts) > 1 or (hosts and not known_host(shown, self._names)):
                await _misdirected(scope["path"], shown)(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _misdirected(path: str, host: str) -> Response:
    text = (
        f"This server does not answer to the Host {host[:_SHOWN]!r}: only to its IP "
        "addresses, localhost, its --host, and the names given with --http-host."
    )
    if path.startswith(_JSON_PATHS):
        return refusal(421, text)
    return PlainTextResponse(
        f"421 Misdirected Request\n\n{text}\n", 421, headers={"X-Content-Type-Options": "nosniff"}
    )


# Requests another site's page sent (CSRF).


def same_origin(request: Request) -> bool:
    """Whether every `Origin` the request carries, if any, names the host
    it was sent to. (A browser sends Origin with every POST; programs that
    send none are judged by their token alone.)"""
    host = request.headers.get("host", "").lower()
    for origin in request.headers.getlist("origin"):
        try:
            netloc = urlsplit(origin).netloc
        except ValueError:  # not a URL (a broken IPv6 address)
            return False
        if not host or netloc.lower() != host:
            return False
    return True


def cross_site(request: Request) -> str:
    """Why the request looks sent by another site's page; "" if it does not."""
    for fetch_site in request.headers.getlist("sec-fetch-site"):
        # same-site is another port or subdomain of this host: another origin.
        if fetch_site.strip().lower() in ("cross-site", "same-site"):
            return f"it was sent from another site's page (Sec-Fetch-Site: {fetch_site[:20]})"
    if not same_origin(request):
        return "it was sent from another site's page (its Origin is not this server)"
    return ""


def is_json(request: Request) -> bool:
    """Whether the body is declared JSON. Of the types a page may send to
    another origin without asking it first, none is."""
    media_type = request.headers.get("content-type", "").partition(";")[0]
    return media_type.strip().lower() == "application/json"


def api_refusal(request: Request, token: str | None) -> JSONResponse | None:
    """The answer to a request of the JSON API (`/api/*`, `POST /queue`)
    that must not run, or None if it may."""
    if not bearer(request, token):
        return refusal(401, "missing or wrong bearer token")
    why = cross_site(request)
    if why:
        return refusal(403, f"refused: {why}")
    if not is_json(request):
        return refusal(415, "the body must be sent as Content-Type: application/json")
    return None


def refusal(code: int, why: str) -> JSONResponse:
    """What the HTTP side answers when it refuses a JSON request itself,
    before any command runs: the shape of a wire refusal's answer (its
    status line in the body's `status` and in `Jobserver-Status`), the line
    being HTTP's own (`400 Bad Request`), so that a client reads every
    refusal the same way; `error` says why. The header holds no text of the
    request's: `why` may quote it, and a header cannot carry every
    character."""
    line = f"{code} {HTTPStatus(code).phrase}"
    return JSONResponse({"status": line, "error": why}, code, headers={"Jobserver-Status": line})


# The token.


def bearer(request: Request, token: str | None) -> bool:
    """Whether the request carries the token as a bearer (or none is needed)."""
    if token is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return token_matches(given.strip(), token)


def token_matches(given: str, token: str) -> bool:
    # Constant time, so the reply's timing does not reveal a prefix.
    return hmac.compare_digest(given.encode(), token.encode())


def may_act(request: Request, token: str | None, sessions: Sessions) -> bool:
    """Whether the dashboard acts for this request: no token is needed, or
    it comes as a bearer, or with a live session."""
    if token is None or bearer(request, token):
        return True
    return sessions.live(request.cookies.get(SESSION_COOKIE, ""))


# Dashboard sessions.


class Sessions:
    """The sessions signed in, in memory: a restart ends them all."""

    def __init__(
        self,
        lifetime: float,
        limit: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lifetime = lifetime
        self._limit = limit
        self._clock = clock
        # Digest of the id -> when it ends, oldest first (all live as long).
        self._ends: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def open(self) -> str:
        """A new session's id."""
        now = self._clock()
        while self._ends and next(iter(self._ends.values())) <= now:
            self._ends.popitem(last=False)
        session = secrets.token_urlsafe(_SESSION_BYTES)
        self._ends[_digest(session)] = now + self.lifetime
        while len(self._ends) > self._limit:
            self._ends.popitem(last=False)
        return session

    def live(self, session: str) -> bool:
        if not session or len(session) > _MAX_SESSION_TEXT:
            return False
        # Looked up by a digest: how long the lookup takes depends on the
        # digest of what was sent, which says nothing of any live id.
        key = _digest(session)
        end = self._ends.get(key)
        if end is None:
            return False
        if self._clock() >= end:
            del self._ends[key]
            return False
        return True

    def close(self, session: str) -> None:
        if session and len(session) <= _MAX_SESSION_TEXT:
            self._ends.pop(_digest(session), None)


def _digest(session: str) -> bytes:
    return hashlib.sha256(session.encode()).digest()


def sign_in(response: Response, session: str, lifetime: float, secure: bool) -> None:
    response.set_cookie(
        SESSION_COOKIE, session, max_age=math.ceil(lifetime),
        httponly=True, samesite="strict", secure=secure,
    )


def sign_out(response: Response, secure: bool) -> None:
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict", secure=secure)


# Wrong sign-ins.


@dataclass
class _Failures:
    count: int
    last: float  # when the last one came
    until: float  # sign-ins from the address are refused until then


class SignInThrottle:
    """Wrong sign-ins counted by client address, each one past
    FREE_FAILURES answered with a longer wait."""

    def __init__(
        self, limit: int = MAX_THROTTLED_CLIENTS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limit = limit
        self._clock = clock
        # Oldest failure first.
        self._clients: OrderedDict[str, _Failures] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def wait(self, address: str) -> float:
        """Seconds before `address` may try again; 0 if it may now."""
        failures = self._clients.get(_client(address))
        if failures is None:
            return 0.0
        return max(0.0, failures.until - self._clock())

    def failed(self, address: str) -> None:
        now = self._clock()
        self._forget_before(now - FORGET_FAILURES_AFTER)
        client = _client(address)
        failures = self._clients.pop(client, None) or _Failures(0, now, now)
        failures.count += 1
        failures.last = now
        beyond = failures.count - FREE_FAILURES
        if beyond >= 0:
            # The exponent is capped first: 2 ** count could be any size.
            penalty = FIRST_PENALTY_SECONDS * 2 ** min(beyond, 16)
            failures.until = now + min(penalty, MAX_PENALTY_SECONDS)
        self._clients[client] = failures
        while len(self._clients) > self._limit:
            self._clients.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._clients.pop(_client(address), None)

    def _forget_before(self, moment: float) -> None:
        while self._clients and next(iter(self._clients.values())).last < moment:
            self._clients.popitem(last=False)


def _client(address: str) -> str:
    """What failures are counted by: the address, or an IPv6 address's /64."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, _IPV6_CLIENT_PREFIX), strict=False))
    return str(parsed)
