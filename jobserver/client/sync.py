"""`Client`: the client on plain blocking sockets."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any, Self, TypeVar

from jobserver.client import await_calls, batches, calls, operating_calls, report_calls
from jobserver.client.batches import Batch, BatchProgress
from jobserver.client.calls import Call, When, documented_by
from jobserver.client.endpoint import (
    CANNOT_CONNECT,
    CANNOT_SEND,
    NO_REPLY,
    RECEIVE_SIZE,
    Endpoint,
    idle_connection_dead,
)
from jobserver.client.errors import ConnectionFailed, MalformedReply, TLSFailed
from jobserver.client.report_calls import Fail, FinishResult, Retry
from jobserver.wire.client_framing import Reply

T = TypeVar("T")


class Client(Endpoint):
    """A blocking client on one persistent connection, opened lazily."""

    _sock: socket.socket | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection, if one is open; the next request opens another."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @documented_by(calls.request)
    def request(self, method: str, params: Mapping[str, object]) -> Reply:
        return self._call(calls.request(method, params))

    @documented_by(calls.create_job)
    def create_job(
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
        return self._call(
            calls.create_job(
                name, data, first_run, repeat, priority, retry_after, unique, parent_job_id,
                max_attempts, retry_backoff, retry_delay, retry_max_delay, cost, time_windows,
                time_zone, overwrite, idempotency_key, key, depends_on, on_dependency_failure,
            )
        )

    @documented_by(calls.create_jobs)
    def create_jobs(
        self, jobs: list[dict[str, Any]], idempotency_key: str | None = None
    ) -> list[int]:
        return self._call(calls.create_jobs(jobs, idempotency_key))

    @documented_by(batches.create_batch)
    def create_batch(
        self,
        jobs: Sequence[Mapping[str, Any]],
        then: str | Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> Batch:
        return self._call(batches.create_batch(jobs, then, idempotency_key))

    @documented_by(batches.batch_progress)
    def batch_progress(self, job_id: int) -> BatchProgress:
        return self._call(batches.batch_progress(job_id))

    @documented_by(calls.get_job)
    def get_job(
        self,
        name: str,
        wait: float | None = None,
        priority: int | None = None,
        lease: int | None = None,
    ) -> dict[str, Any] | None:
        return self._call(calls.get_job(name, wait, priority, lease))

    @documented_by(calls.get_jobs)
    def get_jobs(
        self,
        name: str,
        num_results: int,
        wait: float | None = None,
        priority: int | None = None,
        lease: int | None = None,
    ) -> list[dict[str, Any]]:
        return self._call(calls.get_jobs(name, num_results, wait, priority, lease))

    @documented_by(calls.update_job)
    def update_job(
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
        self._call(
            calls.update_job(
                job_id, data, repeat, priority, next_run, lease_id, clear_repeat, time_zone
            )
        )

    @documented_by(await_calls.await_job)
    def await_job(self, job_id: int, timeout: float | None = None) -> dict[str, Any] | None:
        return self._call(await_calls.await_job(job_id, timeout))

    @documented_by(calls.query_job)
    def query_job(self, job_id: int) -> dict[str, Any]:
        return self._call(calls.query_job(job_id))

    @documented_by(report_calls.finish_job)
    def finish_job(
        self, job_id: int, data: dict[str, Any] | None = None, lease_id: str | None = None
    ) -> None:
        self._call(report_calls.finish_job(job_id, data, lease_id))

    @documented_by(report_calls.finish_jobs)
    def finish_jobs(
        self, jobs: Sequence[tuple[int, str | None, dict[str, Any] | None]]
    ) -> list[FinishResult]:
        return self._call(report_calls.finish_jobs(jobs))

    @documented_by(report_calls.fail_jobs)
    def fail_jobs(self, jobs: Sequence[Fail]) -> list[FinishResult]:
        return self._call(report_calls.fail_jobs(jobs))

    @documented_by(report_calls.retry_jobs)
    def retry_jobs(self, jobs: Sequence[Retry]) -> list[FinishResult]:
        return self._call(report_calls.retry_jobs(jobs))

    @documented_by(report_calls.fail_job)
    def fail_job(
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
        self._call(
            report_calls.fail_job(
                job_id, data, lease_id, error, max_attempts, retry_backoff, retry_delay,
                retry_max_delay,
            )
        )

    @documented_by(calls.await_reply)
    def await_reply(
        self,
        job_id: int,
        key: str,
        timeout: int | None = None,
        lease_id: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self._call(calls.await_reply(job_id, key, timeout, lease_id, data))

    @documented_by(calls.deliver_reply)
    def deliver_reply(self, key: str, data: dict[str, Any]) -> dict[str, Any]:
        return self._call(calls.deliver_reply(key, data))

    @documented_by(report_calls.touch_job)
    def touch_job(
        self, job_id: int, lease_id: str | None = None, lease: int | None = None
    ) -> str | None:
        return self._call(report_calls.touch_job(job_id, lease_id, lease))

    @documented_by(operating_calls.failed_jobs)
    def failed_jobs(self, pattern: str = "*", limit: int | None = None) -> list[dict[str, Any]]:
        return self._call(operating_calls.failed_jobs(pattern, limit))

    @documented_by(operating_calls.set_limit)
    def set_limit(
        self,
        pattern: str,
        max: int = 0,
        *,
        rate: str | None = None,
        per_key: bool = False,
        fair: bool = False,
    ) -> None:
        self._call(operating_calls.set_limit(pattern, max, rate, per_key, fair))

    @documented_by(operating_calls.pause_jobs)
    def pause_jobs(self, pattern: str) -> None:
        self._call(operating_calls.pause_jobs(pattern))

    @documented_by(operating_calls.resume_jobs)
    def resume_jobs(self, pattern: str) -> None:
        self._call(operating_calls.resume_jobs(pattern))

    @documented_by(report_calls.retry_job)
    def retry_job(
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
        self._call(
            report_calls.retry_job(
                job_id, delay, next_run, data, name, priority, ignore_repeat, lease_id
            )
        )

    @documented_by(calls.cancelled_jobs)
    def cancelled_jobs(self, job_ids: Sequence[int]) -> list[int]:
        return self._call(calls.cancelled_jobs(job_ids))

    @documented_by(calls.cancel_job)
    def cancel_job(self, job_id: int, running: bool = False) -> None:
        self._call(calls.cancel_job(job_id, running))

    @documented_by(calls.delete_job)
    def delete_job(self, job_id: int) -> None:
        self._call(calls.delete_job(job_id))

    @documented_by(operating_calls.requeue_jobs)
    def requeue_jobs(self, job_ids: list[int], name: str | None = None) -> None:
        self._call(operating_calls.requeue_jobs(job_ids, name))

    @documented_by(operating_calls.ping)
    def ping(self) -> None:
        self._call(operating_calls.ping())

    @documented_by(operating_calls.queues)
    def queues(self, limit: int | None = None) -> dict[str, Any]:
        return self._call(operating_calls.queues(limit))

    @documented_by(operating_calls.query)
    def query(self, sql: str) -> dict[str, Any]:
        return self._call(operating_calls.query(sql))

    @documented_by(operating_calls.status)
    def status(self) -> dict[str, Any]:
        return self._call(operating_calls.status())

    @documented_by(operating_calls.running_jobs)
    def running_jobs(
        self, name: str | None = None, limit: int | None = None, newest: bool = False
    ) -> dict[str, Any]:
        return self._call(operating_calls.running_jobs(name, limit, newest))

    @documented_by(operating_calls.history)
    def history(self, queue: str | None = None, minutes: int | None = None) -> dict[str, Any]:
        return self._call(operating_calls.history(queue, minutes))

    @documented_by(operating_calls.requeue_failed_jobs)
    def requeue_failed_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return self._call(operating_calls.requeue_failed_jobs(name, queue, job_ids, limit, dry_run))

    @documented_by(operating_calls.delete_failed_jobs)
    def delete_failed_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return self._call(operating_calls.delete_failed_jobs(name, queue, job_ids, limit, dry_run))

    @documented_by(operating_calls.cancel_queued_jobs)
    def cancel_queued_jobs(
        self,
        name: str | None = None,
        *,
        queue: str | None = None,
        job_ids: list[int] | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        return self._call(operating_calls.cancel_queued_jobs(name, queue, job_ids, limit, dry_run))

    @documented_by(operating_calls.backup)
    def backup(self, name: str) -> dict[str, Any]:
        return self._call(operating_calls.backup(name))

    def _call(self, call: Call[T]) -> T:
        reply, earlier_lost = self._exchange(call)
        self._learn_keys(call, reply)
        try:
            result: T = self._outcome(call, reply, earlier_lost)
        except MalformedReply:
            self.close()
            raise
        return result

    def _exchange(self, call: Call[Any]) -> tuple[Reply, bool]:
        """The reply, and whether it answers a second try (the first one's
        reply lost)."""
        request = self._encode(call)
        patience = self.timeout + call.wait_seconds
        sock = self._send(request)
        try:
            return self._receive(sock, patience), False
        except TLSFailed:
            raise
        except ConnectionFailed:
            # The server that broke the connection or did not answer may be
            # gone: the next connection tries another first.
            self.switch_server()
            if not (call.repeatable or (call.keyed and self._keeps_keys())):
                raise
        try:
            return self._receive(self._send(request), patience), True
        except ConnectionFailed as failure:
            failure.sent = True  # the first try was, whatever became of this one
            raise

    def _keeps_keys(self) -> bool:
        """Whether the server the next request goes to keeps idempotency
        keys: asked (keys_probe) unless every server is known to."""
        if all(address in self.keys_kept for address in self.servers.addresses):
            return True
        probe = calls.keys_probe()
        try:
            reply, _ = self._exchange(probe)
        except ConnectionFailed:
            return False
        self._learn_keys(probe, reply)
        return self.servers.now in self.keys_kept

    def _send(self, request: bytes) -> socket.socket:
        """Send on the kept connection or, if it has died, on a new one."""
        if self._sock is not None and not idle_connection_dead(self._sock.fileno()):
            try:
                return self._send_on(self._sock, request)
            except ConnectionFailed:
                pass  # the request's end never left, so the server ignores it
        failures: list[ConnectionFailed] = []
        for _ in self.servers.rotation():
            try:
                connection = self._connect()
                self._note_connected()
                return self._send_on(connection, request)
            except TLSFailed:
                raise  # the options must change: another server would not help
            except ConnectionFailed as failure:
                failures.append(failure)  # nothing was carried out: try the next
        raise self._unreachable(failures)

    def _send_on(self, sock: socket.socket, request: bytes) -> socket.socket:
        try:
            sock.settimeout(self.timeout)
            sock.sendall(request)
        except OSError as error:
            self.close()
            raise self._failed(CANNOT_SEND, error) from error
        except BaseException:
            self.close()
            raise
        return sock

    def _receive(self, sock: socket.socket, patience: float) -> Reply:
        reader = self._reader()
        try:
            sock.settimeout(patience)
            while (reply := reader.reply()) is None:
                reader.feed(sock.recv(RECEIVE_SIZE))
        except (OSError, ValueError) as error:
            self.close()
            raise self._failed(NO_REPLY, error) from error
        except BaseException:
            self.close()
            raise
        if reply.closes_connection or reader.leftover:
            self.close()
        self._check_plaintext_reply(reply)
        return reply

    def _connect(self) -> socket.socket:
        self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as error:
            raise self._failed(CANNOT_CONNECT, error) from error
        # Each request is small and waits for its reply: Nagle would only delay it.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                # Handshakes at once, within the socket's timeout; closes the
                # socket if that fails.
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            except OSError as error:
                raise self._handshake_failed(error) from error
        self._sock = sock
        return sock
