"""`AsyncClient`: the client for trio."""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import trio

from jobserver.client import calls
from jobserver.client.calls import Call, FinishResult, When, documented_by
from jobserver.client.endpoint import (
    CANNOT_CONNECT,
    CANNOT_SEND,
    NO_REPLY,
    RECEIVE_SIZE,
    Endpoint,
    idle_connection_dead,
)
from jobserver.client.errors import ConnectionFailed, TLSFailed
from jobserver.wire.framing import Reply, ReplyReader

T = TypeVar("T")

# What moving bytes with trio can raise besides cancellation.
_TRIO_FAILURES = (OSError, ValueError, trio.BrokenResourceError, trio.TooSlowError)


class AsyncClient(Endpoint, trio.abc.AsyncResource):
    """The same client for trio: the methods of Client, as coroutines.
    Close it with `await client.aclose()` or `async with`."""

    _stream: trio.abc.Stream | None = None
    _timeouts = (TimeoutError, trio.TooSlowError)

    async def aclose(self) -> None:
        """Close the connection, if one is open; the next request opens another."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await trio.aclose_forcefully(stream)

    @documented_by(calls.request)
    async def request(self, method: str, params: Mapping[str, object]) -> Reply:
        return await self._call(calls.request(method, params))

    @documented_by(calls.create_job)
    async def create_job(
        self,
        name: str,
        data: dict[str, Any] | None = None,
        first_run: When | None = None,
        repeat: str | None = None,
        priority: int | None = None,
        retry_after: str | None = None,
        unique: bool = False,
        parent_job_id: int | None = None,
        max_attempts: int | None = None,
        retry_backoff: str | None = None,
        retry_delay: float | None = None,
        retry_max_delay: float | None = None,
        cost: int | None = None,
        time_windows: str | None = None,
        time_zone: str | None = None,
        overwrite: bool = True,
    ) -> int:
        return await self._call(
            calls.create_job(
                name, data, first_run, repeat, priority, retry_after, unique, parent_job_id,
                max_attempts, retry_backoff, retry_delay, retry_max_delay, cost, time_windows,
                time_zone, overwrite,
            )
        )

    @documented_by(calls.create_jobs)
    async def create_jobs(self, jobs: list[dict[str, Any]]) -> list[int]:
        return await self._call(calls.create_jobs(jobs))

    @documented_by(calls.get_job)
    async def get_job(
        self, name: str, wait: float | None = None, priority: int | None = None
    ) -> dict[str, Any] | None:
        return await self._call(calls.get_job(name, wait, priority))

    @documented_by(calls.get_jobs)
    async def get_jobs(
        self, name: str, num_results: int, wait: float | None = None, priority: int | None = None
    ) -> list[dict[str, Any]]:
        return await self._call(calls.get_jobs(name, num_results, wait, priority))

    @documented_by(calls.update_job)
    async def update_job(
        self,
        job_id: int,
        data: dict[str, Any],
        repeat: str | None = None,
        priority: int | None = None,
        next_run: When | None = None,
        lease_id: str | None = None,
        clear_repeat: bool = False,
    ) -> None:
        await self._call(
            calls.update_job(job_id, data, repeat, priority, next_run, lease_id, clear_repeat)
        )

    @documented_by(calls.query_job)
    async def query_job(self, job_id: int) -> dict[str, Any]:
        return await self._call(calls.query_job(job_id))

    @documented_by(calls.finish_job)
    async def finish_job(
        self, job_id: int, data: dict[str, Any] | None = None, lease_id: str | None = None
    ) -> None:
        await self._call(calls.finish_job(job_id, data, lease_id))

    @documented_by(calls.finish_jobs)
    async def finish_jobs(
        self, jobs: Sequence[tuple[int, str | None, dict[str, Any] | None]]
    ) -> list[FinishResult]:
        return await self._call(calls.finish_jobs(jobs))

    @documented_by(calls.fail_job)
    async def fail_job(
        self,
        job_id: int,
        data: dict[str, Any] | None = None,
        lease_id: str | None = None,
        error: str | None = None,
    ) -> None:
        await self._call(calls.fail_job(job_id, data, lease_id, error))

    @documented_by(calls.await_reply)
    async def await_reply(
        self,
        job_id: int,
        key: str,
        timeout: int | None = None,  # noqa: ASYNC109 - AwaitReply's parameter, sent to the server
        lease_id: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return await self._call(calls.await_reply(job_id, key, timeout, lease_id, data))

    @documented_by(calls.deliver_reply)
    async def deliver_reply(self, key: str, data: dict[str, Any]) -> dict[str, Any]:
        return await self._call(calls.deliver_reply(key, data))

    @documented_by(calls.touch_job)
    async def touch_job(self, job_id: int, lease_id: str | None = None) -> str | None:
        return await self._call(calls.touch_job(job_id, lease_id))

    @documented_by(calls.failed_jobs)
    async def failed_jobs(
        self, pattern: str = "*", limit: int | None = None
    ) -> list[dict[str, Any]]:
        return await self._call(calls.failed_jobs(pattern, limit))

    @documented_by(calls.set_limit)
    async def set_limit(self, pattern: str, capacity: int) -> None:
        await self._call(calls.set_limit(pattern, capacity))

    @documented_by(calls.pause_jobs)
    async def pause_jobs(self, pattern: str) -> None:
        await self._call(calls.pause_jobs(pattern))

    @documented_by(calls.resume_jobs)
    async def resume_jobs(self, pattern: str) -> None:
        await self._call(calls.resume_jobs(pattern))

    @documented_by(calls.retry_job)
    async def retry_job(
        self,
        job_id: int,
        delay: int | None = None,
        next_run: When | None = None,
        data: dict[str, Any] | None = None,
        name: str | None = None,
        priority: int | None = None,
        ignore_repeat: bool = False,
        lease_id: str | None = None,
    ) -> None:
        await self._call(
            calls.retry_job(job_id, delay, next_run, data, name, priority, ignore_repeat, lease_id)
        )

    @documented_by(calls.cancel_job)
    async def cancel_job(self, job_id: int) -> None:
        await self._call(calls.cancel_job(job_id))

    @documented_by(calls.delete_job)
    async def delete_job(self, job_id: int) -> None:
        await self._call(calls.delete_job(job_id))

    @documented_by(calls.requeue_jobs)
    async def requeue_jobs(self, job_ids: list[int], name: str | None = None) -> None:
        await self._call(calls.requeue_jobs(job_ids, name))

    @documented_by(calls.ping)
    async def ping(self) -> None:
        await self._call(calls.ping())

    @documented_by(calls.queues)
    async def queues(self, limit: int | None = None) -> dict[str, Any]:
        return await self._call(calls.queues(limit))

    @documented_by(calls.query)
    async def query(self, sql: str) -> dict[str, Any]:
        return await self._call(calls.query(sql))

    @documented_by(calls.status)
    async def status(self) -> dict[str, Any]:
        return await self._call(calls.status())

    @documented_by(calls.backup)
    async def backup(self, name: str) -> dict[str, Any]:
        return await self._call(calls.backup(name))

    async def _call(self, call: Call[T]) -> T:
        return call.outcome(await self._exchange(call))

    async def _exchange(self, call: Call[Any]) -> Reply:
        request = self._encode(call)
        patience = self.timeout + call.wait_seconds
        stream = await self._send(request)
        try:
            return await self._receive(stream, patience)
        except TLSFailed:
            raise
        except ConnectionFailed:
            if not call.read_only:
                raise
        return await self._receive(await self._send(request), patience)

    async def _send(self, request: bytes) -> trio.abc.Stream:
        kept = self._stream
        if kept is not None and not idle_connection_dead(_socket_of(kept).fileno()):
            try:
                return await self._send_on(kept, request)
            except ConnectionFailed:
                pass  # the request's end never left, so the server ignores it
        return await self._send_on(await self._connect(), request)

    async def _send_on(self, stream: trio.abc.Stream, request: bytes) -> trio.abc.Stream:
        try:
            with trio.fail_after(self.timeout):
                await stream.send_all(request)
        except _TRIO_FAILURES as error:
            await self.aclose()
            raise self._failed(CANNOT_SEND, error) from error
        except BaseException:
            await self.aclose()
            raise
        return stream

    async def _receive(self, stream: trio.abc.Stream, patience: float) -> Reply:
        reader = ReplyReader()
        try:
            with trio.fail_after(patience):
                while (reply := reader.reply()) is None:
                    reader.feed(await stream.receive_some(RECEIVE_SIZE))
        except _TRIO_FAILURES as error:
            await self.aclose()
            raise self._failed(NO_REPLY, error) from error
        except BaseException:
            await self.aclose()
            raise
        if reply.closes_connection or reader.leftover:
            await self.aclose()
        self._check_plaintext_reply(reply)
        return reply

    async def _connect(self) -> trio.abc.Stream:
        await self.aclose()
        try:
            # trio's streams set TCP_NODELAY themselves.
            with trio.fail_after(self.timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
        except (OSError, trio.TooSlowError) as error:
            raise self._failed(CANNOT_CONNECT, error) from error
        if self.tls is not None:
            stream = await self._handshake(stream, self.tls)
        self._stream = stream
        return stream

    async def _handshake(self, tcp: trio.abc.Stream, context: ssl.SSLContext) -> trio.SSLStream:
        """TLS over `tcp`, handshaken at once rather than on the first send,
        so that a failure is told as one of TLS rather than of the request."""
        secure = trio.SSLStream(tcp, context, server_hostname=self.host)
        try:
            with trio.fail_after(self.timeout):
                await secure.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as error:
            await trio.aclose_forcefully(secure)
            raise self._handshake_failed(error.__cause__ or error) from error
        except BaseException:
            await trio.aclose_forcefully(secure)
            raise
        return secure


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The socket under a trio stream, TLS or not."""
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    assert isinstance(transport, trio.SocketStream)
    return transport.socket
