"""Hypercorn, serving the HTTP application inside the server's trio run,
one connection per failure domain.

The socket is bound first, with the wire protocol's (`listen`), so that a
port in use stops the server at start with a plain error, before it says
it is listening; serving comes later, in the server's nursery (`serve`).

Hypercorn's own trio worker (`hypercorn.trio.run.worker_serve`) runs every
connection's tasks in one nursery with the listener, so one exception on
one connection (a bug in its WebSocket path took the whole server down)
ends them all. Here the accept loop is ours: each connection is Hypercorn's
per-connection server (`TCPServer`) run inside `_serve_connection`, whose
boundary logs whatever the connection raises and closes that connection
only; cancellation (shutdown) alone passes through.

Only HTTP/1.1 (and 1.0) is spoken. A request that asks to switch protocols
(an `Upgrade` header: WebSocket, h2c), HTTP/2's preface (`PRI * HTTP/2.0`)
and CONNECT are answered `400` and the connection closed; over TLS, ALPN
offers http/1.1 alone. Nothing here uses WebSocket or HTTP/2, and each is
a protocol engine more on the attack surface.

Time is bounded as on the wire port: the TLS handshake, the head (by
Hypercorn's keep-alive timeout), the body, each piece of a response the
client must take; at shutdown, connections still open after the grace
period are closed under their writers.

This reaches into Hypercorn below its public API (TCPServer's run,
protocol_send and _close; H11Protocol's handle, _create_stream and
_check_protocol; TaskGroup, TrioSingleTask, WorkerContext): pyproject.toml's
web extra pins the versions it was written against.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import parse_socket_addr, wrap_app
from starlette.requests import ClientDisconnect

from jobserver.core.build import Core
from jobserver.logs import RateLimit
from jobserver.web import app

log = logging.getLogger("jobserver")
# Hypercorn's error log and the connection boundary's, rate-limited.
http_log = logging.getLogger("jobserver.http")

# Requests in flight when the server stops get this long to finish.
GRACE_SECONDS = 3.0
# The HTTP side's errors (a failed connection, Hypercorn's "Error in ASGI
# Framework") are logged with their traceback at most this many times per
# LOG_WINDOW seconds; the rest are counted, and the count is logged with
# the next one that is. A client that can make connections fail must not
# be able to fill the disk with tracebacks.
LOG_BURST = 10
LOG_WINDOW = 60.0
# A TLS client gets this long to finish its handshake.
TLS_HANDSHAKE_SECONDS = 10.0
# A response is written in pieces of this size, each of which the client
# must take within SEND_PIECE_SECONDS (as the wire port's replies, with the
# default --request-timeout): a slow link that keeps reading is served, a
# client that stops reading is cut off.
SEND_PIECE = 256 * 1024
SEND_PIECE_SECONDS = 30.0
# A request's body must arrive whole within this of its head (the head
# itself within Hypercorn's keep-alive timeout, 5 seconds, of the
# connection or of the previous response), as the wire port's default
# --request-timeout.
BODY_SECONDS = 30.0

# Connections past --max-http-connections are told so, this many at once
# at the most (beyond, they are closed at once, with nothing said: a flood
# must not hold a descriptor each), and each within REFUSAL_SECONDS.
REFUSALS_AT_ONCE = 32
REFUSAL_SECONDS = 2.0

REFUSED_SWITCH = (
    "this server speaks HTTP/1.1 only: no protocol upgrade (WebSocket, h2c), "
    "no HTTP/2, no CONNECT"
)


# What the listeners accept: a socket, or TLS over one.
Accepted = trio.SocketStream | trio.SSLStream[trio.SocketStream]


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
    config.ssl_handshake_timeout = TLS_HANDSHAKE_SECONDS
    # HTTP/1.1 only: ALPN never selects h2.
    config.alpn_protocols = ["http/1.1"]
    # The server's own log says what matters; Hypercorn's access log would
    # write a line per request.
    config.accesslog = None
    config.errorlog = http_log
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


@dataclass
class _Capacity:
    """How many HTTP connections are served at once (--max-http-connections),
    and how many past it are being told so."""

    most: int
    refusing: int = 0


async def serve(
    listening: Listening, core: Core, auth_token: str | None, stopping: trio.Event,
    host_names: Iterable[str], session_seconds: float, max_connections: int,
) -> None:
    """Serve until `stopping` is set; then requests in flight get
    GRACE_SECONDS to finish, idle keep-alive connections are closed.
    `host_names` and `session_seconds` are app.build's; past
    `max_connections` open at once, a connection is answered 503."""
    config = listening.config
    # Starlette is an ASGI application; its type names ASGI's messages
    # differently from Hypercorn's.
    application: Any = _hang_ups_are_not_errors(
        app.build(core, auth_token, config.ssl_enabled, host_names, session_seconds)
    )
    # The application has no startup or shutdown of its own, so no ASGI
    # lifespan is run; each connection gets an empty state.
    wrapped = wrap_app(application, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    log.info("HTTP on %s", f"{config.bind[0].rsplit(':', 1)[0]}:{listening.port}")
    open_streams: set[Accepted] = set()
    capacity = _Capacity(max_connections)
    handler = partial(_serve_connection, wrapped, config, context, open_streams, capacity)
    async with trio.open_nursery() as connections:
        connections.start_soon(_close_what_is_left_open, open_streams, stopping)
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                partial(trio.serve_listeners, handler, _listeners(listening),
                        handler_nursery=connections)
            )
            await stopping.wait()
            accepting.cancel_scope.cancel()
        # Idle keep-alive connections see this and close; a connection in
        # the middle of a request finishes it, within the grace period.
        await context.terminated.set()
        connections.cancel_scope.deadline = trio.current_time() + GRACE_SECONDS


async def _close_what_is_left_open(open_streams: set[Accepted], stopping: trio.Event) -> None:
    """Once the server stops, wait for the connections to end, and close the
    sockets of those still open when the grace period ends or the server
    cancels its tasks: a response being written is shielded from
    cancellation, and would hold the shutdown for as long as its client
    does not read."""
    try:
        await stopping.wait()
        while open_streams:  # noqa: ASYNC110 - a shutdown's poll, GRACE_SECONDS at most
            await trio.sleep(0.05)
    finally:
        for stream in open_streams:
            transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
            transport.socket.close()


def _hang_ups_are_not_errors(application: Any) -> Any:
    """The application, for which a client that leaves in the middle of
    its request's body is a hang-up (logged at DEBUG), not a failure with
    a traceback: nobody is left to answer."""

    async def serve_request(scope: Any, receive: Any, send: Any) -> None:
        try:
            await application(scope, receive, send)
        except ClientDisconnect:
            log.debug("HTTP client left in the middle of its request to %s", scope.get("path"))

    return serve_request


def _listeners(listening: Listening) -> list[trio.abc.Listener[Any]]:
    sockets = listening.sockets
    listeners: list[trio.abc.Listener[Any]] = [
        trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        for sock in sockets.insecure_sockets
    ]
    ssl_context = listening.config.create_ssl_context()
    if ssl_context is not None:
        listeners += [
            trio.SSLListener(
                trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                ssl_context,
                https_compatible=True,
            )
            for sock in sockets.secure_sockets
        ]
    return listeners


async def _serve_connection(
    application: AppWrapper,
    config: HypercornConfig,
    context: WorkerContext,
    open_streams: set[Accepted],
    capacity: _Capacity,
    stream: Accepted,
) -> None:
    """One connection from accept to close: nothing it raises (Hypercorn,
    h11, the application) leaves here but cancellation."""
    peer = _peer_name(stream)
    if len(open_streams) >= capacity.most:
        await _refuse(stream, capacity, peer)
        return
    open_streams.add(stream)
    try:
        # TCPServer's annotation names only the TLS stream; it takes both.
        server = _HTTP11Server(
            application, config, context, ConnectionState({}), stream  # type: ignore[arg-type]
        )
        await server.run()
    except* Exception as group:  # noqa: BLE001 - the boundary of one connection
        http_log.error("HTTP connection from %s failed", peer, exc_info=_first(group))
    finally:
        open_streams.discard(stream)
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await stream.aclose()


async def _refuse(stream: Accepted, capacity: _Capacity, peer: str) -> None:
    """Tell a connection past --max-http-connections so, and close it."""
    try:
        if capacity.refusing < REFUSALS_AT_ONCE:
            capacity.refusing += 1
            try:
                http_log.warning(
                    "HTTP connection from %s refused: %d are open (--max-http-connections)",
                    peer, capacity.most,
                )
                with trio.move_on_after(REFUSAL_SECONDS):
                    # Over TLS this makes the handshake first.
                    await stream.send_all(_too_many(capacity.most))
            finally:
                capacity.refusing -= 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the client is gone: nothing to tell
    except Exception:  # noqa: BLE001 - the boundary of one connection
        http_log.exception("refusing the HTTP connection from %s failed", peer)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await stream.aclose()


def _too_many(most: int) -> bytes:
    # The shape of every refusal (access.refusal).
    line = "503 Service Unavailable"
    body = json.dumps(
        {"status": line, "error": f"too many HTTP connections: this server serves {most} at once"}
    ).encode()
    head = (
        f"HTTP/1.1 {line}\r\nContent-Type: application/json\r\nJobserver-Status: {line}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _HTTP11Server(TCPServer):
    """Hypercorn's per-connection server, speaking HTTP/1.1 alone: its own
    `run` would pick HTTP/2 by ALPN or on an h2c upgrade."""

    async def run(self) -> None:
        if isinstance(self.stream, trio.SSLStream):
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return
            socket = self.stream.transport_stream.socket
            secure = True
        else:
            socket = self.stream.socket
            secure = False
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                # Duck-typed for the ProtocolWrapper that TCPServer expects:
                # only handle() is called on it.
                self.protocol = _HTTP11Protocol(  # type: ignore[assignment]
                    self.app, self.config, self.context, task_group,
                    ConnectionState(self.state), secure, client, server, self.protocol_send,
                )
                await self.idle_task.restart(task_group, self._idle_timeout)
                await self._read_data()
                # The client has sent all it will: no request can follow, so
                # nothing is left for the idle timer to wait for (a request
                # under way is its stream's task, which still ends first).
                await self.idle_task.stop()
        except OSError:
            pass  # the client went away
        finally:
            await self._close()

    async def protocol_send(self, event: Event) -> None:
        """Hypercorn's, with a bound in time: each SEND_PIECE of a response
        must be taken by the client within SEND_PIECE_SECONDS, or the
        connection is closed. A client that stops reading would otherwise
        hold its response, and the application's task, for ever (Hypercorn
        writes shielded from cancellation, shutdown's included)."""
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    data = memoryview(event.data)
                    for start in range(0, len(data), SEND_PIECE):
                        with trio.fail_after(SEND_PIECE_SECONDS):
                            await self.stream.send_all(data[start : start + SEND_PIECE])
            except trio.TooSlowError:
                await self.stream.aclose()  # ends the connection's reading too
                await self.protocol.handle(Closed())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())

    async def _close(self) -> None:
        # Hypercorn half-closes here without its send lock: a response that
        # the application's task starts writing meanwhile fails with
        # trio.BusyResourceError. The lock is taken if it is free; if a write
        # holds it, the stream is closed at once, which ends that write.
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await super()._close()  # the writer itself, finding the client gone
            return
        try:
            self.send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self.stream.aclose()
            return
        try:
            await super()._close()
        finally:
            self.send_lock.release()


class _HTTP11Protocol(H11Protocol):
    """h11 for every request; a request that asks for another protocol is
    refused instead of switched to, and a request's body must arrive whole
    within BODY_SECONDS of its head."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.body_deadline = TrioSingleTask()

    async def handle(self, event: Event) -> None:
        if isinstance(event, Closed):
            await self.body_deadline.stop()
        await super().handle(event)

    async def _check_protocol(self, event: h11.Request) -> None:
        """Hypercorn's switch to HTTP/2 (h2c, the preface) never happens."""

    async def _create_stream(self, request: h11.Request) -> None:
        if _asks_to_switch(request):
            await self._refuse(request, 400, REFUSED_SWITCH)
            return
        await super()._create_stream(request)
        await self.body_deadline.restart(
            self.task_group, partial(self._end_a_slow_body, self.keep_alive_requests)
        )

    async def _end_a_slow_body(self, request_number: int) -> None:
        """Close the connection if request `request_number`'s body is still
        arriving after BODY_SECONDS: a client that trickles a body would
        otherwise hold the connection, and up to a body's worth of memory,
        for as long as it likes. No reply: the application may be answering."""
        await trio.sleep(BODY_SECONDS)
        if (
            request_number == self.keep_alive_requests
            and self.connection.their_state is h11.SEND_BODY
        ):
            log.info("HTTP request's body not received whole within %gs: connection closed",
                     BODY_SECONDS)
            # Shielded: closing stops this very task (handle, above).
            with trio.CancelScope(shield=True):
                await self.send(Closed())

    async def _send_h11_event(self, event: Any) -> None:
        """Hypercorn sends every status with an empty reason phrase
        (`HTTP/1.1 404 `); people and some clients read the phrase."""
        if isinstance(event, h11.Response) and not event.reason:
            event = h11.Response(
                status_code=event.status_code, headers=event.headers,
                http_version=event.http_version, reason=_reason(event.status_code),
            )
        await super()._send_h11_event(event)

    async def _refuse(self, request: h11.Request, status: int, message: str) -> None:
        # The shape of every refusal (access.refusal).
        line = f"{status} {_reason(status).decode()}"
        body = json.dumps({"status": line, "error": message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"jobserver-status", line.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status, headers=headers))
        if request.method != b"HEAD":  # a response to HEAD has no body
            await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())
        await self.send(Closed())


def _reason(code: int) -> bytes:
    try:
        return HTTPStatus(code).phrase.encode("ascii")
    except ValueError:
        return b""


def _asks_to_switch(request: h11.Request) -> bool:
    if request.method in (b"PRI", b"CONNECT") or request.http_version not in (b"1.0", b"1.1"):
        return True
    return any(name == b"upgrade" for name, _ in request.headers)


def _first(group: BaseExceptionGroup[Exception]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _peer_name(stream: Accepted) -> str:
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        host, port = transport.socket.getpeername()[:2]
    except OSError:
        return "a client that was already gone"
    return f"{host}:{port}"


# One filter for the process: the limit is the server's, not a request's.
http_log.addFilter(RateLimit(LOG_BURST, LOG_WINDOW))
