"""What a client raises: a refusal by the server, or a failed connection."""

from __future__ import annotations


class JobServerError(Exception):
    """The server refused the request. `status` is the whole status line,
    `code` its number and `reason` the text after it; `detail` the
    server's explanation beyond the status line (the reply's `error`
    header, such as SQLite's message for `402 Bad query`), or None. The
    exception reads as the status line, then the detail after a colon."""

    def __init__(self, status: str, detail: str | None = None) -> None:
        # Both in args, so that the exception pickles as it was made.
        super().__init__(status, detail)
        self.status = status
        self.detail = detail
        code, _, self.reason = status.partition(" ")
        self.code = int(code)

    def __str__(self) -> str:
        return f"{self.status}: {self.detail}" if self.detail else self.status


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


class JobCancelled(JobServerError):
    """410: the job's run was cancelled (CancelJob with running: true,
    protocol.md 14.26): the report was not taken and the job ended
    CANCELLED. Stop working on it; report it no more."""


class UnrecognizedCommand(JobServerError):
    """430: the server has no such command."""


class ServerError(JobServerError):
    """5xx: a problem in the server; the request was not carried out and may
    be retried, unless it is an OutcomeUnknown."""


class OutcomeUnknown(ServerError):
    """504: the server could not learn whether the database committed the
    request (protocol.md 10): it may or may not have been carried out, as
    when a connection breaks before the reply. Send again only what is safe
    to repeat; look first (QueryJob) before repeating anything else."""


class ConnectionFailed(OSError):
    """The server could not be reached, or the connection broke (or its
    reply did not come in time) during a request. `sent` says whether the
    request had been sent whole, so that the server may have carried it
    out; when false, it certainly did not."""

    def __init__(self, message: str, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent

    def __reduce__(self) -> tuple[type[ConnectionFailed], tuple[str, bool]]:
        return type(self), (str(self), self.sent)


class MalformedReply(ConnectionFailed):
    """The server's reply is framed but means nothing: a body that is not
    what its command answers (not JSON, a job without a name, a jobID that
    is not a number). The client closes the connection, as it does one that
    broke: a server that answers so is broken or is not a jobserver. The
    request was sent, and may have been carried out (`sent` is true). A reply
    that is not framed as the protocol says, or larger than the client's
    `max_reply_bytes`, is a broken connection (ConnectionFailed) already."""


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
    410: JobCancelled,
    430: UnrecognizedCommand,
    504: OutcomeUnknown,
}


def error_for(status: str, detail: str | None = None) -> JobServerError:
    """The exception for a status line that is not a success, with the
    server's explanation if it gave one."""
    code = int(status[:3])
    default = ServerError if 500 <= code <= 599 else JobServerError
    return _ERRORS.get(code, default)(status, detail)
