"""The methods of an async client, and its reconnect rules: shared by
`AsyncClient` (anyio: asyncio or trio) and `TrioClient` (trio alone).

Each method is one request (calls.py); how a subclass moves bytes is its
own: `_connect`, `_send_on`, `_receive`, `_fileno` and `aclose`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Self, TypeVar

from jobserver.client import await_calls, batches, calls, operating_calls, report_calls
from jobserver.client.batches import Batch, BatchProgress
from jobserver.client.calls import Call, When, documented_by
from jobserver.client.endpoint import Endpoint, idle_connection_dead
from jobserver.client.errors import ConnectionFailed, MalformedReply, TLSFailed
from jobserver.client.report_calls import Fail, FinishResult, Retry
from jobserver.wire.client_framing import Reply

T = TypeVar("T")
# A connection as the event loop's library has it.
Stream = TypeVar("Stream")


class AsyncCalls(Endpoint, ABC, Generic[Stream]):
    """The methods of Client, as coroutines, on one persistent connection
    opened when first needed. Close it with `await client.aclose()` or
    `async with`."""

    _stream: Stream | None = None
    _in_request = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @abstractmethod
    async def aclose(self) -> None:
        """Close the connection, if one is open; the next request opens another."""

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
        idempotency_key: str | None = None,
        key: str | None = None,
        depends_on: Sequence[int] | None = None,
        on_dependency_failure: str | None = None,
    ) -> int:
        return await self._call(
            calls.create_job(
                name, data, first_run, repeat, priority, retry_after, unique, parent_job_id,
                max_attempts, retry_backoff, retry_delay, retry_max_delay, cost, time_windows,
                time_zone, overwrite, idempotency_key, key, depends_on, on_dependency_failure,
            )
        )

    @documented_by(calls.create_jobs)
    async def create_jobs(
        self, jobs: list[dict[str, Any]], idempotency_key: str | None = None
    ) -> list[int]:
        return await self._call(calls.create_jobs(jobs, idempotency_key))

    @documented_by(batches.create_batch)
    async def create_batch(
        self,
        jobs: Sequence[Mapping[str, Any]],
        then: str | Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> Batch:
        return await self._call(batches.create_batch(jobs, then, idempotency_key))

    @documented_by(batches.batch_progress)
    async def batch_progress(self, job_id: int) -> BatchProgress:
        return await self._call(batches.batch_progress(job_id))

    @documented_by(calls.get_job)
    async def get_job(
        self,
        name: str,
        wait: float | None = None,
        priority: int | None = None,
        lease: int | None = None,
    ) -> dict[str, Any] | None:
        return await self._call(calls.get_job(name, wait, priority, lease))

    @documented_by(calls.get_jobs)
    async def get_jobs(
        self,
        name: str,
        num_results: int,
        wait: float | None = None,
        priority: int | None = None,
        lease: int | None = None,
    ) -> list[dict[str, Any]]:
        return await self._call(calls.get_jobs(name, num_results, wait, priority, lease))

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
        time_zone: str | None = None,
    ) -> None:
        await self._call(
            calls.update_job(
                job_id, data, repeat, priority, next_run, lease_id, clear_repeat, time_zone
            )
        )

    @documented_by(await_calls.await_job)
    # The timeout is AwaitJob's, the server's to keep: None at its end, no
    # cancellation.
    async def await_job(
        self, job_id: int, timeout: float | None = None  # noqa: ASYNC109
    ) -> dict[str, Any] | None:
        return await self._call(await_calls.await_job(job_id, timeout))

    @documented_by(calls.query_job)
    async def query_job(self, job_id: int) -> dict[str, Any]:
        return await self._call(calls.query_job(job_id))

    @documented_by(report_calls.finish_job)
    async def finish_job(
        self, job_id: int, data: dict[str, Any] | None = None, lease_id: str | None = None
    ) -> None:
        await self._call(report_calls.finish_job(job_id, data, lease_id))

    @documented_by(report_calls.finish_jobs)
    async def finish_jobs(
        self, jobs: Sequence[tuple[int, str | None, dict[str, Any] | None]]
    ) -> list[FinishResult]:
        return await self._call(report_calls.finish_jobs(jobs))

    @documented_by(report_calls.fail_jobs)
    async def fail_jobs(self, jobs: Sequence[Fail]) -> list[FinishResult]:
        return await self._call(report_calls.fail_jobs(jobs))

    @documented_by(report_calls.retry_jobs)
    async def retry_jobs(self, jobs: Sequence[Retry]) -> list[FinishResult]:
        return await self._call(report_calls.retry_jobs(jobs))

    @documented_by(report_calls.fail_job)
    async def fail_job(
        self,
        job_id: int,
        data: dict[str, Any] | None = None,
        lease_id: str | None = None,
        error: str | None = None,
        max_attempts: int | None = None,
        retry_backoff: str | None = None,
        retry_delay: float | None = None,
        retry_max_delay: float | None = None,
    ) -> None:
        await self._call(
            report_calls.fail_job(
                job_id, data, lease_id, error, max_attempts, retry_backoff, retry_delay,
                retry_max_delay,
            )
        )

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

    @documented_by(report_calls.touch_job)
    async def touch_job(
        self, job_id: int, lease_id: str | None = None, lease: int | None = None
    ) -> str | None:
        return await self._call(report_calls.touch_job(job_id, lease_id, lease))

    @documented_by(operating_calls.failed_jobs)
    async def failed_jobs(
        self, pattern: str = "*", limit: int | None = None
    ) -> list[dict[str, Any]]:
        return await self._call(operating_calls.failed_jobs(pattern, limit))

    @documented_by(operating_calls.set_limit)
    async def set_limit(
        self,
        pattern: str,
        max: int = 0,
        *,
        rate: str | None = None,
        per_key: bool = False,
        fair: bool = False,
    ) -> None:
        await self._call(operating_calls.set_limit(pattern, max, rate, per_key, fair))

    @documented_by(operating_calls.pause_jobs)
    async def pause_jobs(self, pattern: str) -> None:
        await self._call(operating_calls.pause_jobs(pattern))

    @documented_by(operating_calls.resume_jobs)
    async def resume_jobs(self, pattern: str) -> None:
        await self._call(operating_calls.resume_jobs(pattern))

    @documented_by(report_calls.retry_job)
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
            report_calls.retry_job(
                job_id, delay, next_run, data, name, priority, ignore_repeat, lease_id
            )
        )

    @documented_by(calls.cancelled_jobs)
    async def cancelled_jobs(self, job_ids: Sequence[int]) -> list[int]:
        return await self._call(calls.cancelled_jobs(job_ids))

    @documented_by(calls.cancel_job)
    async def cancel_job(self, job_id: int, running: bool = False) -> None:
        await self._call(calls.cancel_job(job_id, running))

    @documented_by(calls.delete_job)
    async def delete_job(self, job_id: int) -> None:
        await self._call(calls.delete_job(job_id))

    @documented_by(operating_calls.requeue_jobs)
    async def requeue_jobs(self, job_ids: list[int], name: str | None = None) -> None:
        await self._call(operating_calls.requeue_jobs(job_ids, name))

    @documented_by(operating_calls.ping)
    async def ping(self) -> None:
        await self._call(operating_calls.ping())

    @documented_by(operating_calls.queues)
    async def queues(self, limit: int | None = None) -> dict[str, Any]:
        return await self._call(operating_calls.queues(limit))

    @documented_by(operating_calls.query)
    async def query(self, sql: str) -> dict[str, Any]:
        return await self._call(operating_calls.query(sql))

    @documented_by(operating_calls.status)
    async def status(self) -> dict[str, Any]:
        return await self._call(operating_calls.status())

    @documented_by(operating_calls.running_jobs)
    async def running_jobs(
        self, name: str | None = None, limit: int | None = None, newest: bool = False
    ) -> dict[str, Any]:
        return await self._call(operating_calls.running_jobs(name, limit, newest))

    @documented_by(operating_calls.history)
    async def history(self, queue: str | None = None, minutes: int | None = None) -> dict[str, Any]:
        return await self._call(operating_calls.history(queue, minutes))

    @documented_by(operating_calls.requeue_failed_jobs)
    async def requeue_failed_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return await self._call(
            operating_calls.requeue_failed_jobs(name, queue, job_ids, limit, dry_run)
        )

    @documented_by(operating_calls.delete_failed_jobs)
    async def delete_failed_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return await self._call(
            operating_calls.delete_failed_jobs(name, queue, job_ids, limit, dry_run)
        )

    @documented_by(operating_calls.cancel_queued_jobs)
    async def cancel_queued_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return await self._call(
            operating_calls.cancel_queued_jobs(name, queue, job_ids, limit, dry_run)
        )

    @documented_by(operating_calls.backup)
    async def backup(self, name: str) -> dict[str, Any]:
        return await self._call(operating_calls.backup(name))

    async def _call(self, call: Call[T]) -> T:
        # Two tasks' requests on one connection would mix their bytes and
        # take each other's replies: the second is refused instead.
        if self._in_request:
            raise RuntimeError(
                f"{type(self).__name__} is already in a request of another task: "
                "a client serves one task at a time (open one per task)"
            )
        self._in_request = True
        try:
            reply, earlier_lost = await self._exchange(call)
        finally:
            self._in_request = False
        self._learn_keys(call, reply)
        try:
            result: T = self._outcome(call, reply, earlier_lost)
        except MalformedReply:
            await self.aclose()
            raise
        return result

    async def _exchange(self, call: Call[Any]) -> tuple[Reply, bool]:
        """The reply, and whether it answers a second try (the first one's
        reply lost)."""
        request = self._encode(call)
        patience = self.timeout + call.wait_seconds
        stream = await self._send(request)
        try:
            return await self._receive(stream, patience), False
        except TLSFailed:
            raise
        except ConnectionFailed:
            # The server that broke the connection or did not answer may be
            # gone: the next connection tries another first.
            self.switch_server()
            if not (call.repeatable or (call.keyed and await self._keeps_keys())):
                raise
        try:
            return await self._receive(await self._send(request), patience), True
        except ConnectionFailed as failure:
            failure.sent = True  # the first try was, whatever became of this one
            raise

    async def _keeps_keys(self) -> bool:
        """Whether the server the next request goes to keeps idempotency
        keys: asked (keys_probe) unless every server is known to."""
        if all(address in self.keys_kept for address in self.servers.addresses):
            return True
        probe = calls.keys_probe()
        try:
            reply, _ = await self._exchange(probe)
        except ConnectionFailed:
            return False
        self._learn_keys(probe, reply)
        return self.servers.now in self.keys_kept

    async def _send(self, request: bytes) -> Stream:
        """Send on the kept connection or, if it has died, on a new one."""
        kept = self._stream
        if kept is not None and not idle_connection_dead(self._fileno(kept)):
            try:
                return await self._send_on(kept, request)
            except ConnectionFailed:
                pass  # the request's end never left, so the server ignores it
        failures: list[ConnectionFailed] = []
        for _ in self.servers.rotation():
            try:
                connection = await self._connect()
                self._note_connected()
                return await self._send_on(connection, request)
            except TLSFailed:
                raise  # the options must change: another server would not help
            except ConnectionFailed as failure:
                failures.append(failure)  # nothing was carried out: try the next
        raise self._unreachable(failures)

    @abstractmethod
    async def _connect(self) -> Stream:
        """A new connection, TLS handshaken if asked, kept as `_stream`; a
        failure is a ConnectionFailed."""

    @abstractmethod
    async def _send_on(self, stream: Stream, request: bytes) -> Stream:
        """Send `request` within the timeout; on any failure or interruption,
        close the connection (a failure is a ConnectionFailed)."""

    @abstractmethod
    async def _receive(self, stream: Stream, patience: float) -> Reply:
        """The reply, within `patience` seconds; on any failure or
        interruption, close the connection (it is out of step)."""

    @abstractmethod
    def _fileno(self, stream: Stream) -> int:
        """The descriptor of the socket under `stream`, TLS or not."""


def end_wait(client: AsyncCalls[Any]) -> None:
    """End the waiting GetJob or GetJobs that a task has under way on
    `client`, at once, without losing what it was handed: the connection's
    sending side is shut, so the server answers `404 No job found`, or with
    the jobs it was already handing out (protocol.md 9), and that task's
    call returns it. Cancelling the call instead would drop a reply already
    on its way, whose jobs stay RUNNING. The next request opens a new
    connection. Does nothing without a connection. (A function, not a
    method: the clients' methods are the requests of Client.)"""
    if client._stream is None:
        return
    # A duplicate descriptor: shutdown acts on the socket itself, and
    # closing the duplicate leaves the stream's own open.
    duplicate = os.dup(client._fileno(client._stream))
    with contextlib.suppress(OSError), socket.socket(fileno=duplicate) as sock:
        sock.shutdown(socket.SHUT_WR)
