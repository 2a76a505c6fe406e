"""The client library: `Client` on plain blocking sockets, `AsyncClient` for trio.

    with Client("127.0.0.1", 8888) as jobs:
        job_id = jobs.create_job("email/send", {"to": "ann@example.com"})
        job = jobs.get_job("email/*", wait=60)   # None if nothing came in 60 s

Each method is one request on one persistent connection, opened when it is
first needed. A refusal is a `JobServerError`, with a subclass per status
code and the whole status line; a network failure is `ConnectionFailed`. An
empty queue is an answer, not an error: `get_job` returns None and
`get_jobs` an empty list. Both clients share the encoding of requests and a
sans-IO `ReplyReader`; only the moving of bytes differs.

Reconnect rules. Bedrock's PHP client sends a request again after failures
that can come after the server acted on it (a `500` or `555` reply; a broken
connection, for requests it marks idempotent, FinishJob and RetryJob among
them), so work can be done twice. Here a request is sent again only when
that cannot do anything twice:

- Before sending, a kept connection that died while idle (the server was
  restarted or shut down) is replaced by a new one, once. Sending that
  failed part-way counts the same: the server does nothing with a request
  until its final blank line has arrived (protocol.md 1.2).
- Once a request has been sent, a connection that breaks, or a reply that
  does not come within the timeout, raises ConnectionFailed. The request is
  not sent again: the server may have carried it out (created the job,
  handed one out) and only the caller can tell whether repeating it is safe.
- Except the read-only commands QueryJob, Ping, Status and Query, which are
  sent once more on a new connection. GetJob and GetJobs are not read-only:
  they hand jobs out.
- A reply with `Connection: close` closes the connection once it is read;
  so does an error or an interruption (KeyboardInterrupt, trio
  cancellation) in the middle of a request, since the connection is then
  out of step. The next request opens a new connection.
- A waiting GetJob is answered only when a job comes or its wait is over, so
  its reply is awaited for the wait plus the client's timeout.

Leases. Every GetJob and GetJobs asks for the lease token (`includeLeaseID`),
so each job dict carries `leaseID`. Pass it back as `lease_id` to
finish_job, retry_job, fail_job, update_job and touch_job: if the job has
been handed to another worker since, the server refuses with `Conflict`
(`409 Lease expired`) and changes nothing.

TLS. `tls=True` speaks TLS and trusts the system's certificate
authorities; `tls="ca.pem"` trusts the CA certificates in that PEM file
instead (a server certificate of your own); an `ssl.SSLContext` is used as
it is. The server's certificate must name the host the client connects to
(the host of "host:port"), unless the context turns that check off. When
TLS cannot be set up, `TLSFailed` (a ConnectionFailed) says why plainly:
the certificate is not trusted, the server does not speak TLS, or the
server requires TLS and the client was not told to use it. Nothing was
carried out then, and sending again would fail the same way.

A client is for one thread, or one trio task, at a time.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

import trio

from jobserver.wire.framing import TLS_REQUIRED, escape, unescape

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8888
# Seconds to connect, to send, and to wait for a reply that is not a
# waiting GetJob's. Ordinary replies take milliseconds; a busy server's
# commits and a Query (5 s at most) fit well within this.
DEFAULT_TIMEOUT = 30.0

# What the server does with a waiting GetJob's `timeout` (protocol.md 9).
_DEFAULT_WAIT_MS = 110_000
_MAX_WAIT_MS = 3_600_000
# A reply head is a status line and a few short headers; a peer that sends
# a megabyte without ending its head is not a jobserver.
_MAX_REPLY_HEAD = 1024 * 1024
_RECEIVE_SIZE = 65536
# Commands that change nothing, so sending one twice does no harm.
_READ_ONLY = frozenset({"queryjob", "ping", "status", "query"})

T = TypeVar("T")
# A time for firstRun or nextRun: text the server reads (protocol.md 4.3),
# or a timezone-aware datetime.
When = str | datetime


class JobServerError(Exception):
    """The server refused the request. `status` is the whole status line,
    `code` its number and `reason` the text after it."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status
        code, _, self.reason = status.partition(" ")
        self.code = int(code)


class MalformedRequest(JobServerError):
    """401: the request could not be read, such as a CreateJobs batch that is not JSON."""


class InvalidRequest(JobServerError):
    """402: a parameter is missing or malformed."""


class JobNotFound(JobServerError):
    """404: there is no such job."""


class IllegalState(JobServerError):
    """405: the job's state does not allow this, e.g. finishing a QUEUED job."""


class Conflict(JobServerError):
    """409: the request conflicts with the job as it is."""


class UnrecognizedCommand(JobServerError):
    """430: the server has no such command."""


class ServerError(JobServerError):
    """5xx: a problem in the server; the request was not carried out and may be retried."""


class ConnectionFailed(OSError):
    """The server could not be reached, or the connection broke (or its
    reply did not come in time) during a request."""


class TLSFailed(ConnectionFailed):
    """TLS could not be set up with the server: its certificate is not
    trusted or not for this host, or one side speaks TLS and the other does
    not. No request was carried out."""


_ERRORS: dict[int, type[JobServerError]] = {
    401: MalformedRequest,
    402: InvalidRequest,
    404: JobNotFound,
    405: IllegalState,
    409: Conflict,
    430: UnrecognizedCommand,
}


def error_for(status: str) -> JobServerError:
    """The exception for a status line that is not a success."""
    code = int(status[:3])
    default = ServerError if 500 <= code <= 599 else JobServerError
    return _ERRORS.get(code, default)(status)


@dataclass(frozen=True)
class Reply:
    """One reply. Header names are lower-cased (they are case-insensitive)
    and their values unescaped."""

    status: str
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> int:
        return int(self.status[:3])

    @property
    def closes_connection(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"

    def json(self) -> Any:
        return json.loads(self.body)


class ReplyReader:
    """Bytes in, replies out, without any IO (protocol.md 2).

    `feed` the bytes as they arrive, `b""` at the end of the stream; `reply`
    returns the next Reply once it is complete. Malformed input raises
    ValueError.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        # Status line, headers and body length, once the head is complete.
        self._head: tuple[str, dict[str, str], int] | None = None

    def feed(self, data: bytes) -> None:
        if not data:
            raise ValueError("the server closed the connection before its reply was complete")
        self._buffer += data

    def reply(self) -> Reply | None:
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_REPLY_HEAD:
                    raise ValueError("reply head too large: not a jobserver?")
                return None
            self._head = _parse_head(bytes(self._buffer[:end]))
            del self._buffer[: end + 4]
        status, headers, length = self._head
        if len(self._buffer) < length:
            return None
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._head = None
        return Reply(status, headers, body)

    @property
    def leftover(self) -> int:
        """Bytes received beyond the replies taken out."""
        return len(self._buffer)


_STATUS_LINE = re.compile(r"[0-9]{3} .*")
_DIGITS = re.compile(r"[0-9]+")


def _parse_head(raw: bytes) -> tuple[str, dict[str, str], int]:
    status, *lines = raw.decode("utf-8").split("\r\n")
    if not _STATUS_LINE.fullmatch(status):
        raise ValueError(f"not a status line: {status[:100]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"not a header line: {line[:100]!r}")
        headers[name.strip().lower()] = unescape(value.strip(" "))
    length = headers.get("content-length", "")
    if not _DIGITS.fullmatch(length):
        raise ValueError(f"bad or missing Content-Length: {length[:100]!r}")
    return status, headers, int(length)


def encode_request(method: str, params: Mapping[str, object]) -> bytes:
    """A request's bytes: the method line, a `Name: value` line for each
    parameter that is not None, and a blank line (protocol.md 1.2)."""
    if not method or method[0] in " \t" or "\r" in method or "\n" in method:
        raise ValueError(f"not a method line: {method!r}")
    lines = [method]
    for name, value in params.items():
        if value is None:
            continue
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a parameter name: {name!r}")
        lines.append(f"{name}: {encode_value(value)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


_NAME = re.compile(r"[^\s:]+")


def encode_value(value: object) -> str:
    """A parameter value, escaped so that the server's unescaping gives it
    back exactly (protocol.md 1.3). Dicts and lists are sent as compact JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return _escape_text(value)
    if isinstance(value, (dict, list, tuple)):
        # Compact JSON holds no raw line breaks; escaping doubles its backslashes.
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return escape(text)
    raise TypeError(f"cannot send a {type(value).__name__} as a parameter value")


# The server trims spaces around a value before unescaping it, so spaces
# that belong to the value travel as an escape.
_SPACE = "\\u0020"


def _escape_text(text: str) -> str:
    escaped = escape(text)
    rest = escaped.lstrip(" ")
    core = rest.rstrip(" ")
    return _SPACE * (len(escaped) - len(rest)) + core + _SPACE * (len(rest) - len(core))


_ADDRESS = re.compile(r"(?:\[(?P<ipv6>[^\[\]]+)\]|(?P<host>[^:\[\]\s]+))(?::(?P<port>[0-9]{1,5}))?")


def parse_address(address: str) -> tuple[str, int]:
    """`host:port`, `host`, `[ipv6]:port` or `[ipv6]` -> (host, port); the
    port is 8888 when not given."""
    match = _ADDRESS.fullmatch(address.strip())
    port = int(match["port"] or DEFAULT_PORT) if match else 0
    if match is None or not 0 < port < 65536:
        raise ValueError(
            f"not a server address (HOST, HOST:PORT or [IPV6]:PORT, PORT 1 to 65535): {address!r}"
        )
    return match["ipv6"] or match["host"], port


def _is_read_only(method: str) -> bool:
    return method.split(" ", 1)[0].lower() in _READ_ONLY


def _wait_seconds(params: Mapping[str, object]) -> float:
    """How long the server may hold this request before it answers."""
    lowered = {name.lower(): value for name, value in params.items()}
    if str(lowered.get("connection")).lower() != "wait":
        return 0.0
    timeout = lowered.get("timeout")
    if timeout is None or timeout == "":
        return _DEFAULT_WAIT_MS / 1000
    try:
        millis = int(str(timeout))
    except ValueError:
        return 0.0  # refused at once with 402 Malformed timeout
    return min(max(millis, 0), _MAX_WAIT_MS) / 1000


def _idle_connection_dead(fileno: int) -> bool:
    """Whether a connection with no request outstanding is unusable.

    The server sends nothing unasked, so if there is anything to read it has
    closed the connection (end of stream, reset) or is out of step.
    """
    # poll, unlike select, works for descriptors numbered above 1023.
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


def _time_text(when: When | None) -> str | None:
    if not isinstance(when, datetime):
        return when
    if when.tzinfo is None:
        raise ValueError("a naive datetime is ambiguous: give one with a time zone")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _wait_params(wait: float | None) -> dict[str, object]:
    if wait is None:
        return {}
    return {"Connection": "wait", "timeout": round(wait * 1000)}


# What each command sends and what its reply means, shared by both clients.


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    params: dict[str, object]
    result: Callable[[Reply], T]
    # GetJob/GetJobs: what `404 No job found`, an empty queue, returns.
    none_found: Callable[[], T] | None = None

    def outcome(self, reply: Reply) -> T:
        if reply.code == 404 and self.none_found is not None:
            return self.none_found()
        if not 200 <= reply.code <= 299:
            raise error_for(reply.status)
        return self.result(reply)


def _reply(reply: Reply) -> Reply:
    return reply


def _nothing(reply: Reply) -> None:
    return None


def _body(reply: Reply) -> Any:
    return reply.json()


def _field(name: str) -> Callable[[Reply], Any]:
    return lambda reply: reply.json()[name]


def _no_job() -> None:
    return None


def _create_job(
    name: str,
    data: dict[str, Any] | None,
    first_run: When | None,
    repeat: str | None,
    priority: int | None,
    retry_after: str | None,
    unique: bool,
    parent_job_id: int | None,
    retry: dict[str, object],
) -> _Call[int]:
    params: dict[str, object] = {
        "name": name,
        "data": data,
        "firstRun": _time_text(first_run),
        "repeat": repeat,
        "jobPriority": priority,
        "retryAfter": retry_after,
        # Flags that are off are left out: absent means false to the server.
        "unique": unique or None,
        "parentJobID": parent_job_id,
        **retry,
    }
    return _Call("CreateJob", params, _field("jobID"))


def _retry_policy(
    max_attempts: int | None,
    retry_backoff: str | None,
    retry_delay: float | None,
    retry_max_delay: float | None,
) -> dict[str, object]:
    return {
        "maxAttempts": max_attempts,
        "retryBackoff": retry_backoff,
        "retryDelay": retry_delay,
        "retryMaxDelay": retry_max_delay,
    }


def _create_jobs(jobs: list[dict[str, Any]]) -> _Call[list[int]]:
    return _Call("CreateJobs", {"jobs": jobs}, _field("jobIDs"))


def _get_job(name: str, wait: float | None, priority: int | None) -> _Call[dict[str, Any] | None]:
    params = {"name": name, "jobPriority": priority, "includeLeaseID": True, **_wait_params(wait)}
    return _Call("GetJob", params, _body, _no_job)


def _get_jobs(
    name: str, num_results: int, wait: float | None, priority: int | None
) -> _Call[list[dict[str, Any]]]:
    params: dict[str, object] = {
        "name": name,
        "numResults": num_results,
        "jobPriority": priority,
        "includeLeaseID": True,
    }
    params.update(_wait_params(wait))
    return _Call("GetJobs", params, _field("jobs"), list)


def _update_job(
    job_id: int,
    data: dict[str, Any],
    repeat: str | None,
    priority: int | None,
    next_run: When | None,
    lease_id: str | None,
) -> _Call[None]:
    params: dict[str, object] = {
        "jobID": job_id,
        "data": data,
        "repeat": repeat,
        "jobPriority": priority,
        "nextRun": _time_text(next_run),
        "leaseID": lease_id,
    }
    return _Call("UpdateJob", params, _nothing)


def _fail_job(
    job_id: int, data: dict[str, Any] | None, error: str | None, lease_id: str | None
) -> _Call[None]:
    return _on_job("FailJob", job_id, data=data, error=error, leaseID=lease_id)


def _await_reply(
    job_id: int, key: str, timeout: int | None, lease_id: str | None,
    data: dict[str, Any] | None,
) -> _Call[dict[str, Any]]:
    params = {"jobID": job_id, "key": key, "timeout": timeout, "leaseID": lease_id, "data": data}
    return _Call("AwaitReply", params, _body)


def _deliver_reply(key: str, data: dict[str, Any]) -> _Call[dict[str, Any]]:
    return _Call("DeliverReply", {"key": key, "data": data}, _body)


def _touch_job(job_id: int, lease_id: str | None) -> _Call[str]:
    return _Call("TouchJob", {"jobID": job_id, "leaseID": lease_id}, _field("nextRun"))


def _failed_jobs(pattern: str, limit: int | None) -> _Call[list[dict[str, Any]]]:
    return _Call("FailedJobs", {"name": pattern, "limit": limit}, _field("jobs"))


def _set_limit(pattern: str, capacity: int) -> _Call[None]:
    return _Call("SetLimit", {"name": pattern, "max": capacity}, _nothing)


def _on_pattern(method: str, pattern: str) -> _Call[None]:
    return _Call(method, {"name": pattern}, _nothing)


def _on_job(method: str, job_id: int, **params: object) -> _Call[None]:
    return _Call(method, {"jobID": job_id, **params}, _nothing)


def _query_job(job_id: int) -> _Call[dict[str, Any]]:
    return _Call("QueryJob", {"jobID": job_id}, _body)


def _retry_job(
    job_id: int,
    delay: int | None,
    next_run: When | None,
    data: dict[str, Any] | None,
    name: str | None,
    priority: int | None,
    ignore_repeat: bool,
    lease_id: str | None,
) -> _Call[None]:
    return _on_job(
        "RetryJob",
        job_id,
        delay=delay,
        nextRun=_time_text(next_run),
        data=data,
        name=name,
        jobPriority=priority,
        ignoreRepeat=ignore_repeat or None,
        leaseID=lease_id,
    )


def _requeue_jobs(job_ids: list[int], name: str | None) -> _Call[None]:
    params: dict[str, object] = {"jobIDs": ",".join(map(str, job_ids)), "name": name}
    return _Call("RequeueJobs", params, _nothing)


# How a client speaks TLS (module docstring): None or False for not at all,
# True for the system's CAs, a CA file's path, or a ready SSLContext.
TLS = bool | str | os.PathLike[str] | ssl.SSLContext | None


def tls_context(tls: TLS) -> ssl.SSLContext | None:
    """The SSLContext for a client's `tls` argument, or None for plain TCP.
    A CA file that cannot be read or holds no certificate raises ValueError."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    path = os.fspath(tls)
    try:
        return ssl.create_default_context(cafile=path)
    except OSError as error:  # ssl.SSLError too: not PEM, or no certificate in it
        reason = error.strerror or str(error)
        raise ValueError(f"cannot read CA certificates from {path}: {reason}") from error


class _Endpoint:
    """Where a client connects, and how it words a failure."""

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        tls: TLS = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        # Sent with every request when the server runs with --auth-token-file.
        self.auth_token = auth_token
        self.tls = tls_context(tls)

    @classmethod
    def from_address(
        cls: type[_E],
        address: str,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        tls: TLS = None,
    ) -> _E:
        """A client for `host:port`, `host` (port 8888) or `[ipv6]:port`."""
        host, port = parse_address(address)
        return cls(host, port, timeout, auth_token, tls)

    def _encode(self, method: str, params: dict[str, object]) -> bytes:
        return encode_request(method, {**params, "authToken": self.auth_token})

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _failed(self, what: str, error: BaseException) -> ConnectionFailed:
        return ConnectionFailed(f"{what} {self.address}: {_describe(error)}")

    def _handshake_failed(self, error: BaseException) -> ConnectionFailed:
        """What a failed TLS handshake means, for a person to act on."""
        if isinstance(error, ssl.SSLCertVerificationError):
            if error.verify_code in _NAME_MISMATCH:
                return TLSFailed(
                    f"cannot connect to {self.address}: the server's TLS certificate is not "
                    f"for {self.host} ({error.verify_message}); connect by a name or address "
                    "that the certificate lists"
                )
            return TLSFailed(
                f"cannot connect to {self.address}: the server's TLS certificate is not "
                f"trusted ({error.verify_message}); if your own CA signed it, give that CA's "
                "certificate with --tls-ca FILE"
            )
        if _speaks_no_tls(error):
            return TLSFailed(
                f"the server at {self.address} does not speak TLS (it answered the TLS "
                "handshake with something else); leave out --tls and --tls-ca"
            )
        if isinstance(error, _ENDED):
            # A server that is stopping or starting ends connections too:
            # worth trying again, so not a TLSFailed.
            return ConnectionFailed(
                f"{_CANNOT_CONNECT} {self.address}: the connection ended during the TLS "
                "handshake (the server may be restarting, or may not speak TLS: then leave "
                "out --tls and --tls-ca)"
            )
        return ConnectionFailed(
            f"{_CANNOT_CONNECT} {self.address}: TLS handshake failed: {_describe(error)}"
        )

    def _check_plaintext_reply(self, reply: Reply) -> None:
        """A TLS-only port answers a plaintext client with this one reply."""
        if self.tls is None and reply.status == TLS_REQUIRED:
            raise TLSFailed(f"the server at {self.address} requires TLS: use --tls")


def auth_token(path: str | None = None) -> str | None:
    """The token to send: the content of the file `path` if given, else the
    JOBSERVER_AUTH_TOKEN environment variable, which holds the token itself
    (not a file name), else none."""
    if path:
        with open(path, encoding="utf-8") as token_file:
            return token_file.read().strip() or None
    return os.environ.get("JOBSERVER_AUTH_TOKEN") or None


def _describe(error: BaseException) -> str:
    if isinstance(error, (TimeoutError, trio.TooSlowError)):
        return "timed out"
    return str(error) or type(error).__name__


# OpenSSL's verify codes for a certificate that does not name the host.
_NAME_MISMATCH = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
# OpenSSL's reasons when the peer answers a ClientHello with something that
# is not TLS (a plain-text reply such as TLS_NOT_SPOKEN).
_NOT_TLS_REASONS = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_RECORD"}
)


# How a handshake ends when the connection does: a server restarting, or
# one that does not speak TLS and said nothing.
_ENDED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError)


def _speaks_no_tls(error: BaseException) -> bool:
    """Whether a handshake failure means the peer is not a TLS server: it
    answered with something that is not TLS."""
    if isinstance(error, _ENDED):
        return False
    return isinstance(error, ssl.SSLError) and error.reason in _NOT_TLS_REASONS


# Why a request failed, as ConnectionFailed says it.
_CANNOT_CONNECT = "cannot connect to"
_CANNOT_SEND = "cannot send to"
_NO_REPLY = "no reply (the request may have been carried out) from"


_E = TypeVar("_E", bound=_Endpoint)


class Client(_Endpoint):
    """A blocking client on one persistent connection, opened lazily."""

    _sock: socket.socket | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, method: str, params: Mapping[str, object]) -> Reply:
        """Send any command; parameters that are None are left out. Returns
        a 2xx reply and raises JobServerError for any other."""
        return self._call(_Call(method, dict(params), _reply))

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
    ) -> int:
        """Create a job; returns its jobID. `max_attempts` gives it a retry
        policy: FailJob queues it again after `retry_delay` seconds
        (`retry_backoff` "fixed" or "exponential", the latter capped at
        `retry_max_delay`) until that many attempts have failed."""
        policy = _retry_policy(max_attempts, retry_backoff, retry_delay, retry_max_delay)
        return self._call(
            _create_job(
                name, data, first_run, repeat, priority, retry_after, unique, parent_job_id, policy
            )
        )

    def create_jobs(self, jobs: list[dict[str, Any]]) -> list[int]:
        """Create several jobs, all or none. Each dict holds CreateJob's
        parameters by their protocol names (`name`, `data`, `jobPriority`...)."""
        return self._call(_create_jobs(jobs))

    def get_job(
        self, name: str, wait: float | None = None, priority: int | None = None
    ) -> dict[str, Any] | None:
        """Take a due job whose name matches the pattern; None if there is
        none. With `wait`, wait up to that many seconds for one."""
        return self._call(_get_job(name, wait, priority))

    def get_jobs(
        self, name: str, num_results: int, wait: float | None = None, priority: int | None = None
    ) -> list[dict[str, Any]]:
        """Take up to `num_results` due jobs; an empty list if there are none."""
        return self._call(_get_jobs(name, num_results, wait, priority))

    def update_job(
        self,
        job_id: int,
        data: dict[str, Any],
        repeat: str | None = None,
        priority: int | None = None,
        next_run: When | None = None,
        lease_id: str | None = None,
    ) -> None:
        """Replace a job's data; optionally its repeat, priority and next run."""
        self._call(_update_job(job_id, data, repeat, priority, next_run, lease_id))

    def query_job(self, job_id: int) -> dict[str, Any]:
        """A job as it is, state included."""
        return self._call(_query_job(job_id))

    def finish_job(
        self, job_id: int, data: dict[str, Any] | None = None, lease_id: str | None = None
    ) -> None:
        self._call(_on_job("FinishJob", job_id, data=data, leaseID=lease_id))

    def fail_job(
        self,
        job_id: int,
        data: dict[str, Any] | None = None,
        lease_id: str | None = None,
        error: str | None = None,
    ) -> None:
        """Report a job failed; `error` becomes its last error. With a retry
        policy and attempts left, the server queues it again."""
        self._call(_fail_job(job_id, data, error, lease_id))

    def await_reply(
        self,
        job_id: int,
        key: str,
        timeout: int | None = None,
        lease_id: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Park a handed-out job until a reply for `key` is delivered, or
        `timeout` seconds (default a day) pass. Returns {"state": "WAITING",
        "replyDeadline": ...}, or {"state": "QUEUED"} when the reply had
        already come. Conflict (409) if another job waits on `key`."""
        return self._call(_await_reply(job_id, key, timeout, lease_id, data))

    def deliver_reply(self, key: str, data: dict[str, Any]) -> dict[str, Any]:
        """Deliver the reply for `key`: {"jobID": N} for the job that waited
        on it, or {"expires": ...} when it is kept for a job to await it.
        JobNotFound (404) if this key's reply was delivered already."""
        return self._call(_deliver_reply(key, data))

    def touch_job(self, job_id: int, lease_id: str | None = None) -> str:
        """Extend a leased job's lease to retryAfter from now; returns the
        new end of the lease (its nextRun)."""
        return self._call(_touch_job(job_id, lease_id))

    def failed_jobs(self, pattern: str = "*", limit: int | None = None) -> list[dict[str, Any]]:
        """FAILED jobs whose name matches, oldest first, with their last error."""
        return self._call(_failed_jobs(pattern, limit))

    def set_limit(self, pattern: str, capacity: int) -> None:
        """At most `capacity` cost units of matching jobs run at once; 0 removes it."""
        self._call(_set_limit(pattern, capacity))

    def pause_jobs(self, pattern: str) -> None:
        """Hand out no job whose name matches until resume_jobs(pattern)."""
        self._call(_on_pattern("PauseJobs", pattern))

    def resume_jobs(self, pattern: str) -> None:
        self._call(_on_pattern("ResumeJobs", pattern))

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
        """Put a handed-out job back in the queue, after `delay` seconds or at `next_run`."""
        self._call(
            _retry_job(job_id, delay, next_run, data, name, priority, ignore_repeat, lease_id)
        )

    def cancel_job(self, job_id: int) -> None:
        self._call(_on_job("CancelJob", job_id))

    def delete_job(self, job_id: int) -> None:
        self._call(_on_job("DeleteJob", job_id))

    def requeue_jobs(self, job_ids: list[int], name: str | None = None) -> None:
        self._call(_requeue_jobs(job_ids, name))

    def ping(self) -> None:
        self._call(_Call("Ping", {}, _nothing))

    def status(self) -> dict[str, Any]:
        return self._call(_Call("Status", {}, _body))

    def _call(self, call: _Call[T]) -> T:
        return call.outcome(self._exchange(call.method, call.params))

    def _exchange(self, method: str, params: dict[str, object]) -> Reply:
        request = self._encode(method, params)
        patience = self.timeout + _wait_seconds(params)
        sock = self._send(request)
        try:
            return self._receive(sock, patience)
        except TLSFailed:
            raise
        except ConnectionFailed:
            if not _is_read_only(method):
                raise
        return self._receive(self._send(request), patience)

    def _send(self, request: bytes) -> socket.socket:
        """Send on the kept connection or, if it has died, on a new one."""
        if self._sock is not None and not _idle_connection_dead(self._sock.fileno()):
            try:
                return self._send_on(self._sock, request)
            except ConnectionFailed:
                pass  # the request's end never left, so the server ignores it
        return self._send_on(self._connect(), request)

    def _send_on(self, sock: socket.socket, request: bytes) -> socket.socket:
        try:
            sock.settimeout(self.timeout)
            sock.sendall(request)
        except OSError as error:
            self.close()
            raise self._failed(_CANNOT_SEND, error) from error
        except BaseException:
            self.close()
            raise
        return sock

    def _receive(self, sock: socket.socket, patience: float) -> Reply:
        reader = ReplyReader()
        try:
            sock.settimeout(patience)
            while (reply := reader.reply()) is None:
                reader.feed(sock.recv(_RECEIVE_SIZE))
        except (OSError, ValueError) as error:
            self.close()
            raise self._failed(_NO_REPLY, error) from error
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
            raise self._failed(_CANNOT_CONNECT, error) from error
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


# What moving bytes with trio can raise besides cancellation.
_TRIO_FAILURES = (OSError, ValueError, trio.BrokenResourceError, trio.TooSlowError)


class AsyncClient(_Endpoint, trio.abc.AsyncResource):
    """The same client for trio: the methods of Client, as coroutines.
    Close it with `await client.aclose()` or `async with`."""

    _stream: trio.abc.Stream | None = None

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await trio.aclose_forcefully(stream)

    async def request(self, method: str, params: Mapping[str, object]) -> Reply:
        return await self._call(_Call(method, dict(params), _reply))

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
    ) -> int:
        policy = _retry_policy(max_attempts, retry_backoff, retry_delay, retry_max_delay)
        return await self._call(
            _create_job(
                name, data, first_run, repeat, priority, retry_after, unique, parent_job_id, policy
            )
        )

    async def create_jobs(self, jobs: list[dict[str, Any]]) -> list[int]:
        return await self._call(_create_jobs(jobs))

    async def get_job(
        self, name: str, wait: float | None = None, priority: int | None = None
    ) -> dict[str, Any] | None:
        return await self._call(_get_job(name, wait, priority))

    async def get_jobs(
        self, name: str, num_results: int, wait: float | None = None, priority: int | None = None
    ) -> list[dict[str, Any]]:
        return await self._call(_get_jobs(name, num_results, wait, priority))

    async def update_job(
        self,
        job_id: int,
        data: dict[str, Any],
        repeat: str | None = None,
        priority: int | None = None,
        next_run: When | None = None,
        lease_id: str | None = None,
    ) -> None:
        await self._call(_update_job(job_id, data, repeat, priority, next_run, lease_id))

    async def query_job(self, job_id: int) -> dict[str, Any]:
        return await self._call(_query_job(job_id))

    async def finish_job(
        self, job_id: int, data: dict[str, Any] | None = None, lease_id: str | None = None
    ) -> None:
        await self._call(_on_job("FinishJob", job_id, data=data, leaseID=lease_id))

    async def fail_job(
        self,
        job_id: int,
        data: dict[str, Any] | None = None,
        lease_id: str | None = None,
        error: str | None = None,
    ) -> None:
        await self._call(_fail_job(job_id, data, error, lease_id))

    async def await_reply(
        self,
        job_id: int,
        key: str,
        timeout: int | None = None,
        lease_id: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return await self._call(_await_reply(job_id, key, timeout, lease_id, data))

    async def deliver_reply(self, key: str, data: dict[str, Any]) -> dict[str, Any]:
        return await self._call(_deliver_reply(key, data))

    async def touch_job(self, job_id: int, lease_id: str | None = None) -> str:
        return await self._call(_touch_job(job_id, lease_id))

    async def failed_jobs(
        self, pattern: str = "*", limit: int | None = None
    ) -> list[dict[str, Any]]:
        return await self._call(_failed_jobs(pattern, limit))

    async def set_limit(self, pattern: str, capacity: int) -> None:
        await self._call(_set_limit(pattern, capacity))

    async def pause_jobs(self, pattern: str) -> None:
        await self._call(_on_pattern("PauseJobs", pattern))

    async def resume_jobs(self, pattern: str) -> None:
        await self._call(_on_pattern("ResumeJobs", pattern))

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
            _retry_job(job_id, delay, next_run, data, name, priority, ignore_repeat, lease_id)
        )

    async def cancel_job(self, job_id: int) -> None:
        await self._call(_on_job("CancelJob", job_id))

    async def delete_job(self, job_id: int) -> None:
        await self._call(_on_job("DeleteJob", job_id))

    async def requeue_jobs(self, job_ids: list[int], name: str | None = None) -> None:
        await self._call(_requeue_jobs(job_ids, name))

    async def ping(self) -> None:
        await self._call(_Call("Ping", {}, _nothing))

    async def status(self) -> dict[str, Any]:
        return await self._call(_Call("Status", {}, _body))

    async def _call(self, call: _Call[T]) -> T:
        return call.outcome(await self._exchange(call.method, call.params))

    async def _exchange(self, method: str, params: dict[str, object]) -> Reply:
        request = self._encode(method, params)
        patience = self.timeout + _wait_seconds(params)
        stream = await self._send(request)
        try:
            return await self._receive(stream, patience)
        except TLSFailed:
            raise
        except ConnectionFailed:
            if not _is_read_only(method):
                raise
        return await self._receive(await self._send(request), patience)

    async def _send(self, request: bytes) -> trio.abc.Stream:
        kept = self._stream
        if kept is not None and not _idle_connection_dead(_socket_of(kept).fileno()):
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
            raise self._failed(_CANNOT_SEND, error) from error
        except BaseException:
            await self.aclose()
            raise
        return stream

    async def _receive(self, stream: trio.abc.Stream, patience: float) -> Reply:
        reader = ReplyReader()
        try:
            with trio.fail_after(patience):
                while (reply := reader.reply()) is None:
                    reader.feed(await stream.receive_some(_RECEIVE_SIZE))
        except _TRIO_FAILURES as error:
            await self.aclose()
            raise self._failed(_NO_REPLY, error) from error
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
            raise self._failed(_CANNOT_CONNECT, error) from error
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


def _socket_of(stream: trio.abc.Stream) -> socket.socket:
    """The socket under a trio stream, TLS or not."""
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    assert isinstance(transport, trio.SocketStream)
    return transport.socket  # type: ignore[return-value]
