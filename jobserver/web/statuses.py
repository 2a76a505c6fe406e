"""The HTTP status an /api/* or POST /queue answer gets for a wire reply.

The wire keeps Bedrock's codes, which HTTP reads otherwise (`402` is
Payment Required, `430` is no status at all, `405` is a wrong method), so
HTTP clients get HTTP's own: one rule for each meaning, applied
everywhere.

- 400: the request itself is wrong (a malformed or missing parameter, one
  out of its range, whatever Bedrock's code for it): never 422.
- 404: what the request names does not exist (a job, a command).
- 409: the request is well formed but the state of a job, a key or the
  server's set of limits refuses it (Bedrock's `405` moves included).
- 413: what the request carries is larger than a bound: a job's data,
  an error, a query, or more items (jobs, jobIDs) than one request may hold.
- 503: the server cannot do it now; 504: it cannot learn whether it did.
- 500: a fault of the server's own.

A code is mapped by `BY_CODE`; where one wire code holds more than one of
these meanings, `BY_LINE` tells them apart by the status line's text.
The wire's status line itself still goes with every answer: in the
`Jobserver-Status` header and in the JSON body (app.py).
"""

from __future__ import annotations

import re
from http import HTTPStatus

# Bedrock's code (and this server's own) -> what it means to HTTP.
BY_CODE: dict[int, HTTPStatus] = {
    200: HTTPStatus.OK,
    # DeliverReply kept a reply for a job to come.
    202: HTTPStatus.ACCEPTED,
    400: HTTPStatus.BAD_REQUEST,
    401: HTTPStatus.UNAUTHORIZED,
    # Bedrock's "Malformed x", "Missing x", "Invalid priority value".
    402: HTTPStatus.BAD_REQUEST,
    404: HTTPStatus.NOT_FOUND,
    # A move the job's state does not allow (protocol.md 4.2).
    405: HTTPStatus.CONFLICT,
    408: HTTPStatus.REQUEST_TIMEOUT,
    409: HTTPStatus.CONFLICT,
    # A report on a job whose run was cancelled (protocol.md 14.26): the
    # job is gone from its worker, for good.
    410: HTTPStatus.GONE,
    413: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    # A header line too long, on the wire.
    414: HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    # Unrecognized command: no such operation.
    430: HTTPStatus.NOT_FOUND,
    431: HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
    500: HTTPStatus.INTERNAL_SERVER_ERROR,
    # A part the server was started without: Backup without a backup
    # directory or on PostgreSQL, Query without a role it may use.
    501: HTTPStatus.NOT_IMPLEMENTED,
    # "Query failed": the database refused a statement the server wrote.
    502: HTTPStatus.INTERNAL_SERVER_ERROR,
    503: HTTPStatus.SERVICE_UNAVAILABLE,
    504: HTTPStatus.GATEWAY_TIMEOUT,
    # Query ran past its time: nothing was changed, it may be asked again.
    555: HTTPStatus.SERVICE_UNAVAILABLE,
}

# (code, a pattern searched in the text after it, its HTTP status): the
# first that matches wins over BY_CODE.
BY_LINE: tuple[tuple[int, re.Pattern[str], HTTPStatus], ...] = tuple(
    (code, re.compile(pattern), status)
    for code, pattern, status in (
        (401, r"^Invalid JSON", HTTPStatus.BAD_REQUEST),
        # What the request carries (a job's data, an error, a query, its
        # CRON rules) past a bound; a name or key past its length is a
        # parameter out of its range, 400, as the schema's check says.
        (402, r"^(Data|Error|Query) too large|^Too many CRON rules",
         HTTPStatus.REQUEST_ENTITY_TOO_LARGE),
        # A job that costs more than a limit's capacity could never run.
        (402, r"^Cost .* exceeds limit", HTTPStatus.CONFLICT),
        (402, r"^Backup file already exists", HTTPStatus.CONFLICT),
        (404, r"^Trying to create a child that already exists", HTTPStatus.CONFLICT),
        (404, r"^Invalid jobID - Cannot cancel", HTTPStatus.CONFLICT),
        (404, r"^Reply already delivered", HTTPStatus.CONFLICT),
        # The server's set is full, not the request too large.
        (413, r"^Too many (limits|paused patterns)|^Patterns too costly", HTTPStatus.CONFLICT),
        # A repeat or lease whose next run SQLite cannot compute: the
        # rule or time the job was given, not the server.
        (502, r"^Failed to compute nextRun", HTTPStatus.BAD_REQUEST),
    )
)


# What each HTTP status of a wire reply means, for the OpenAPI document.
MEANINGS: dict[HTTPStatus, str] = {
    HTTPStatus.BAD_REQUEST: "the request is wrong: a malformed, missing or out-of-range "
    "parameter (the wire's 402 Malformed ..., 402 Missing ...)",
    HTTPStatus.UNAUTHORIZED: "a missing or wrong token",
    HTTPStatus.NOT_FOUND: "no such job (404 No job with this jobID), no job due (404 No job "
    "found), or no such command (430 Unrecognized command)",
    HTTPStatus.REQUEST_TIMEOUT: "the request did not arrive in time",
    HTTPStatus.CONFLICT: "the job's state, its lease, a key or the server's limits refuse it "
    "(the wire's 405 Can only ..., 409 Lease expired, ...)",
    HTTPStatus.GONE: "the job's run was cancelled (410 Job cancelled, protocol.md 14.26): "
    "the report was not taken; stop the job",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "a job's data, an error or a query too large, or "
    "too many items in one request",
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "a line or head too large (the wire's framing)",
    HTTPStatus.INTERNAL_SERVER_ERROR: "a fault of the server's own; nothing was done",
    HTTPStatus.NOT_IMPLEMENTED: "a part this server runs without (Backup without a backup "
    "directory or on PostgreSQL, Query without a database role it may use)",
    HTTPStatus.SERVICE_UNAVAILABLE: "the database is unavailable, or a Query ran out of "
    "time: nothing was done, ask again later",
    HTTPStatus.GATEWAY_TIMEOUT: "the server could not learn whether the request was done "
    "(protocol.md section 10)",
}


def refusals() -> set[HTTPStatus]:
    """Every HTTP status a wire refusal can be answered with."""
    every = {*BY_CODE.values(), *(status for _, _, status in BY_LINE)}
    return {status for status in every if status >= 400}


def http_status(status_line: str) -> HTTPStatus:
    """What HTTP status the wire reply of this status line is sent with. A
    code not in the table (none the server sends: tests/test_statuses.py
    reads them all from the code) is 200, 400 or 500 by its class."""
    code_text, _, text = status_line.partition(" ")
    code = int(code_text)
    for wire_code, pattern, status in BY_LINE:
        if wire_code == code and pattern.search(text):
            return status
    found = BY_CODE.get(code)
    if found is not None:
        return found
    if code < 300:
        return HTTPStatus.OK
    return HTTPStatus.BAD_REQUEST if code < 500 else HTTPStatus.INTERNAL_SERVER_ERROR
