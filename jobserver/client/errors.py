"""What a client raises: a refusal by the server, or a failed connection."""

from __future__ import annotations


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
