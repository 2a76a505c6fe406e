"""One client connection, and the boundary that makes it a failure domain.

`serve_connection` is the only place a connection's task begins and ends.
Whatever happens on the connection (a reset, a TLS error, a bug in a
command, a group of exceptions from a waiting GetJob) ends that connection
only: it is logged once, at DEBUG for a client that hung up and at ERROR
for anything else, the jobs handed to it that it did not receive go back
to the queue, and the socket is closed. Only cancellation passes through,
which is how the server stops.

A connection reads requests, gives each to the core's dispatcher
(core/commands/dispatch.py), awaits its Answer and writes it, strictly in
order. A GetJob that waits (`get_jobs.waits_for_jobs`, from the request
itself) is awaited the same way, while the connection reads ahead beside
it, so that a client that hangs up stops the wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from jobserver.core.commands.await_job import NOT_ENDED, awaits_job
from jobserver.core.commands.get_jobs import NO_JOB, waits_for_jobs
from jobserver.core.commands.route import Answer, Undo
from jobserver.logs import RateLimit
from jobserver.server import not_http, peer
from jobserver.wire.framing import (
    TLS_NOT_SPOKEN,
    TLS_REQUIRED,
    NotHttp,
    Request,
    RequestParser,
    Response,
    encode_response,
    starts_like_http,
)

if TYPE_CHECKING:
    from jobserver.server.app import Server

log = logging.getLogger("jobserver")
# How each connection ended, when that is worth a line: a client can open
# and end connections as fast as it likes, so at most this many a minute.
connection_log = logging.getLogger("jobserver.connections")
CONNECTION_LINES_PER_MINUTE = 100
connection_log.addFilter(RateLimit(CONNECTION_LINES_PER_MINUTE, 60.0))

T = TypeVar("T")

# Read size per receive: a whole ordinary request, and a large one in a few reads.
RECEIVE_SIZE = 65536
# A reply is written in pieces of this size, each within the request
# timeout: a client that stops reading in the middle of a large reply is
# found out, while a slow link that keeps taking data is not cut off.
SEND_PIECE = 256 * 1024
# How long a refused or finished connection may take to accept its last
# words and the close (a TLS close_notify needs the client to read).
CLOSE_PATIENCE = 1.0
# The first byte of every TLS connection: a handshake record.
TLS_HANDSHAKE = 0x16
# Why a waiting GetJob whose client closed its sending side got no job: in
# the `error` header of its `404 No job found`, which is what it is to a
# program (a worker that half-closes to end its wait gets what it expects),
# while a person at netcat reads why.
HALF_CLOSED_WHILE_WAITING = (
    "a waiting GetJob needs its connection open: the client closed its sending "
    "side (as nc -N does at the end of its input); no job was handed out"
)
HALF_CLOSED_WHILE_AWAITING = (
    "an AwaitJob needs its connection open: the client closed its sending side "
    "(as nc -N does at the end of its input)"
)


class NotTLS(Exception):
    """A client spoke plain text to a TLS port (it was told so)."""


class TLSOnPlainPort(Exception):
    """A client began a TLS handshake on a plain-text port."""


async def serve_connection(server: Server, stream: trio.abc.Stream, refuse: bool) -> None:
    """Run one connection from accept to close; nothing it raises leaves here
    except cancellation."""
    connection = Connection(server, stream)
    server.connections.add(connection)
    failure: BaseExceptionGroup[Exception] | None = None
    try:
        if refuse:
            await connection.refuse()
        else:
            await connection.run()
    except* Exception as group:  # noqa: BLE001 - the boundary of one connection
        failure = group
    finally:
        # Shielded, and bounded inside: the jobs of a connection cut off by
        # a shutdown are settled too. It counts against --max-connections
        # until its socket is closed: until then it holds a descriptor.
        with trio.CancelScope(shield=True):
            await connection.end(failure)
            await connection.close()
        server.connections.discard(connection)
        server.connection_ended()


class Connection:
    def __init__(self, server: Server, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.parser = RequestParser()
        self.pending: deque[Request] = deque()
        self.eof = False
        self.peer = peer.address(stream)
        # For the log: the client's address and port.
        self.name = peer.describe(stream)
        # The jobs of the reply being written: they belong to this
        # connection until the client has them, and go back to the queue
        # if it never does.
        self.undelivered: Undo | None = None
        # Replies with jobs written whole, until the client's kernel has
        # acknowledged them (peer.py).
        self.deliveries = peer.Deliveries(stream)
        # The read under way, which the sweeper (sweeper.py) stops at its
        # deadline (the idle or the request timeout) and a shutdown stops at
        # once: waiting for the next request is the only moment a shutdown
        # may cut the connection without losing a reply. A read is stopped
        # by waking its wait for the socket with ClosedResourceError
        # (trio's notify_closing), not by a cancel scope per read, which
        # cost about 6 us (8% of a CreateJob's instructions); nothing else
        # in a request's path needs a cancel scope of its own.
        self.read_deadline: float | None = None
        self._fd = _descriptor(stream)
        self._reading = False
        self._read_stopped = False
        # A read reached its deadline: the connection ends.
        self.timed_out = False
        self._request_began: float | None = None
        self._received_any = False

    def stop_reading(self) -> None:
        """Shutdown: an idle connection stops waiting for its next request."""
        if self._reading:
            self._stop_read()

    def sweep(self, now: float) -> None:
        """The sweeper: a read whose deadline has passed stops."""
        deadline = self.read_deadline
        if deadline is not None and now >= deadline:
            self._stop_read()

    def _stop_read(self) -> None:
        # The read may already have what it waited for (its task woken, not
        # yet run): then this wakes nothing and the read goes on, as the
        # request it read deserves; a request deadline fires at the next
        # sweep, since it counts from the request's first byte.
        self._read_stopped = True
        if self._fd is not None:
            trio.lowlevel.notify_closing(self._fd)

    async def run(self) -> None:
        if self.server.tls_context is not None and not await self._start_tls():
            return
        await self._serve()
        if self.timed_out and self.parser.buffered and not self.server.closing:
            await self.say_and_close("408 Request timeout")

    async def refuse(self) -> None:
        """503 Too many connections, in TLS on a TLS port: a TLS client that
        got it in plain text would take the server for one that does not
        speak TLS, and give up instead of trying again later."""
        with trio.move_on_after(CLOSE_PATIENCE):
            if self.server.tls_context is not None and not await self._start_tls():
                return
            await self.say_and_close("503 Too many connections")

    async def say_and_close(self, status: str) -> None:
        """Last words before closing; a client that does not take them
        within CLOSE_PATIENCE is not waited for."""
        await self._last_words(encode_response(Response(status), close=True))

    async def _last_words(self, data: bytes) -> None:
        with trio.move_on_after(CLOSE_PATIENCE):
            await self.stream.send_all(data)

    async def end(self, failure: BaseExceptionGroup[Exception] | None) -> None:
        """Put back the jobs the client did not take, and log the end in one
        line, at a level that fits its cause."""
        undos = await self.deliveries.unreceived()
        if self.undelivered is not None:
            undos.append(self.undelivered)
            self.undelivered = None
        for undo in undos:
            undo.run()
        taken = [job_id for undo in undos for job_id in undo.job_ids]
        errors = _leaves(failure) if failure is not None else []
        unexpected = [e for e in errors if not _is_hang_up(e)]
        cause = _describe(errors[0]) if errors else "closed"
        left = ""
        if taken:
            left = " before it took job{} {}: put back".format(
                "s" if len(taken) > 1 else "", ", ".join(str(job_id) for job_id in taken)
            )
        if unexpected:
            connection_log.error(
                "connection from %s failed%s", self.name, left, exc_info=unexpected[0]
            )
        elif taken:
            connection_log.info("connection from %s ended (%s)%s", self.name, cause, left)
        elif errors and (
            isinstance(errors[0], (NotTLS, TLSOnPlainPort)) or _is_tls_failure(errors[0])
        ):
            connection_log.info("connection from %s: %s; closed", self.name, cause)
        elif errors:
            connection_log.debug("connection from %s ended: %s", self.name, cause)

    async def close(self) -> None:
        # aclose closes the socket even when its TLS goodbye is cut short.
        with trio.move_on_after(CLOSE_PATIENCE):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self.stream.aclose()

    async def _start_tls(self) -> bool:
        """Look at the first byte before the TLS layer takes the stream: a
        client speaking plain text is told so in plain text."""
        sock = peer.transport_socket(self.stream)
        deadline = trio.current_time() + self.server.config.idle_timeout
        first = await self._read(partial(sock.recv, 1, socket.MSG_PEEK), deadline)
        if not first:
            return False
        if first[0] != TLS_HANDSHAKE:
            await self._refuse_plain_text(sock)
            raise NotTLS("plain text on a TLS port")
        context = self.server.tls_context
        assert context is not None
        # Replies and requests carry their own lengths, so a connection
        # that ends without TLS's close_notify cannot pass off a truncated
        # message as whole: its end is read as an end, as on plain TCP.
        self.stream = trio.SSLStream(self.stream, context, server_side=True, https_compatible=True)
        return True

    async def _refuse_plain_text(self, sock: Any) -> None:
        """Plain text on a TLS port: `400 This port requires TLS`, or, to
        an HTTP request (`curl http://` to it), the same in HTTP's form,
        its head read first so that the close does not reset the answer
        away."""
        start = await sock.recv(RECEIVE_SIZE, socket.MSG_PEEK)
        head_only = starts_like_http(start)
        if head_only is None:
            await self.say_and_close(TLS_REQUIRED)
            return
        await sock.recv(RECEIVE_SIZE)
        http_port = self.server.http_port
        await self._last_words(not_http.response(http_port, tls=True, head_only=head_only))

    async def _serve(self) -> None:
        while True:
            request = await self._next_request()
            if request is None:
                await self._say_why_ending()
                return
            answer = await self._respond(request)
            close = request.wants_close or self.server.closing
            await self._deliver(answer, close)
            if close:
                return

    async def _say_why_ending(self) -> None:
        error = self.parser.error
        if isinstance(error, NotHttp):
            server = self.server
            tls = server.tls_context is not None
            await self._last_words(not_http.response(server.http_port, tls, error.head_only))
        elif error is not None:
            await self.say_and_close(error.status)
        elif self.eof and self.parser.buffered and not self.server.closing:
            # The client closed its side in the middle of a request (often a
            # missing blank line at the end of `printf ... | nc -N`).
            await self.say_and_close("400 Incomplete request")

    async def _next_request(self) -> Request | None:
        if self.pending:
            # Pipelined requests are answered without reading or, often,
            # waiting: a yield each keeps one client from holding the loop.
            await trio.lowlevel.checkpoint()
        while not self.pending:
            if self.eof or self.parser.error is not None or self.server.closing:
                return None
            await self._read(self._receive, self._read_deadline())
            if self.timed_out:
                return None
        self._request_began = None
        return self.pending.popleft()

    async def _read(self, reading: Callable[[], Awaitable[T]], deadline: float) -> T | None:
        """One read that a shutdown or its deadline may stop (then None;
        `timed_out` says which)."""
        if self.server.closing:
            return None
        if trio.current_time() >= deadline:
            # Past it already: a sweep that came while this connection's task
            # was awake (data had just arrived) stopped nothing, and a client
            # trickling bytes would otherwise win each such race.
            self.timed_out = True
            return None
        self.read_deadline = deadline
        self._reading, self._read_stopped = True, False
        try:
            return await reading()
        except trio.ClosedResourceError:
            if not self._read_stopped:
                raise
        finally:
            self.read_deadline = None
            self._reading = False
        self.timed_out = not self.server.closing and trio.current_time() >= deadline
        return None

    def _read_deadline(self) -> float:
        config = self.server.config
        now = trio.current_time()
        if not self.parser.buffered:
            return now + config.idle_timeout
        if self._request_began is None:
            self._request_began = now
        return self._request_began + config.request_timeout

    async def _receive(self) -> None:
        data = await self._receive_some()
        if not data:
            self.eof = True
            return
        if not self._received_any:
            self._received_any = True
            if data[0] == TLS_HANDSHAKE and self.server.tls_context is None:
                await self.say_and_close(TLS_NOT_SPOKEN)
                raise TLSOnPlainPort("TLS handshake on a plain-text port")
        self.pending.extend(self.parser.feed(data))

    async def _receive_some(self) -> bytes | bytearray:
        """What has arrived, once something has. On plain TCP: one wait
        for the socket to be readable, then one read, as `_send_at_once`
        writes, where trio's stream first tries a read that fails (a client
        waiting for its reply has sent nothing yet) and passes through
        several layers on each request. TLS reads through its stream."""
        if not isinstance(self.stream, trio.SocketStream):
            return await self.stream.receive_some(RECEIVE_SIZE)
        fd = self.stream.socket.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                return os.read(fd, RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except OSError as error:
                raise trio.BrokenResourceError(f"socket connection broken: {error}") from error

    async def _deliver(self, answer: Answer, close: bool) -> None:
        """Write a reply. Jobs in it stay this connection's to give back
        until the client's kernel has acknowledged the whole reply."""
        client_closed = False
        if answer.undo is not None:
            self.undelivered = answer.undo
            client_closed = self.deliveries.client_closed()
        await self._send(encode_response(answer.response, close))
        if client_closed and self.undelivered is not None:
            self.deliveries.written([self.undelivered])
        self.undelivered = None
        self.server.commands_served += 1

    async def _send(self, data: bytes) -> None:
        sent = self._send_at_once(data)
        timeout = self.server.config.request_timeout
        for start in range(sent, len(data), SEND_PIECE):
            with trio.fail_after(timeout):
                await self.stream.send_all(data[start : start + SEND_PIECE])

    def _send_at_once(self, data: bytes) -> int:
        """Hand a reply to the kernel without waiting, as most fit in its
        buffer: no cancel scope, no trip through the scheduler. How much it
        took; the rest is sent by waiting (never for TLS, whose stream
        does its own writing)."""
        if not isinstance(self.stream, trio.SocketStream):
            return 0
        try:
            return os.write(self.stream.socket.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError as error:
            raise trio.BrokenResourceError(f"socket connection broken: {error}") from error

    async def _respond(self, request: Request) -> Answer:
        if waits_for_jobs(request):
            return await self._wait_watching_for_hangup(
                request, Response(NO_JOB, headers={"error": HALF_CLOSED_WHILE_WAITING})
            )
        if awaits_job(request):
            return await self._wait_watching_for_hangup(
                request, Response(NOT_ENDED, headers={"error": HALF_CLOSED_WHILE_AWAITING})
            )
        return await self.server.core.dispatcher.dispatch(request, self.peer)

    async def _wait_watching_for_hangup(self, request: Request, unanswered: Response) -> Answer:
        """Wait for jobs while reading ahead, so a client that hangs up
        stops waiting at once and is never handed a job. The jobs the wait
        returns are this connection's at once, whatever else happens: no
        checkpoint lies between the engine's wait returning them and
        `undelivered` holding them, and a wait cancelled before that gives
        them back itself. A client that only closed its sending side
        (`nc -N` at the end of its input) cannot be told from one that is
        gone, so its wait ends too; it can still read, and is told why."""
        answer = Answer(unanswered)

        async def take(cancel: trio.CancelScope) -> None:
            nonlocal answer
            answer = await self.server.core.dispatcher.dispatch(request, self.peer)
            self.undelivered = answer.undo
            cancel.cancel()

        async def read_ahead(cancel: trio.CancelScope) -> None:
            # Reading stops at the first complete request pipelined behind
            # this one, so a waiting connection holds at most one request
            # and one partial head in memory.
            while not self.eof and not self.pending and self.parser.error is None:
                await self._receive()
            if self.eof:
                cancel.cancel()
                return
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, nursery.cancel_scope)
            nursery.start_soon(read_ahead, nursery.cancel_scope)
        return answer


def _descriptor(stream: trio.abc.Stream) -> int | None:
    """The socket's file descriptor, under TLS too: a read is stopped by
    waking whatever waits on it."""
    sock = peer.transport_socket(stream)
    return sock.fileno() if sock is not None else None


def _leaves(group: BaseExceptionGroup[Exception]) -> list[Exception]:
    found: list[Exception] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            found += _leaves(error)
        else:
            found.append(error)
    return found


def _is_hang_up(error: BaseException) -> bool:
    """A client that went away or misbehaved at the transport level: its
    business, not the server's."""
    return isinstance(
        error,
        (
            trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
            # TimeoutError: the kernel gave up on an unreachable client.
            ConnectionError, TimeoutError, ssl.SSLError, NotTLS, TLSOnPlainPort,
        ),
    )


def _is_tls_failure(error: BaseException) -> bool:
    cause = error.__cause__ if isinstance(error, trio.BrokenResourceError) else error
    return isinstance(cause, ssl.SSLError) and not isinstance(
        cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)
    )


def _describe(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "the client stopped taking its reply"
    cause: Any = error.__cause__ or error
    return str(cause) or type(cause).__name__
