"""The read-only `Query` command: SQL over the jobs table, for people.

`Query` takes its SQL from a `query` header, or from the method line itself
(`Query: SELECT * FROM jobs;`, as on the Bedrock::Jobs page). Output is
sqlite3's list format with a header row, or `format: json`. The storage
runs the SQL (Storage.run_query) so that nothing can be written through it,
and hands over the rows one by one: the reply is built as they come, and
refused as soon as it passes its row or byte bound, so a query over huge
rows never makes the server hold more than the bound.
"""

from __future__ import annotations

import math

import trio

from jobserver.core.commands import params
from jobserver.core.commands.route import DEFAULT_QUERY_SECONDS, Answer, Services, is_loopback
from jobserver.storage.interface import Storage
from jobserver.storage.reader_types import BadQuery, QueryTimeout, QueryUnavailable, ReplyTooLarge
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import DEFAULT_MAX_REPLY_BYTES

MAX_QUERY = 1024 * 1024
# The most of a database's message a `402 Bad query` quotes. A message can
# quote the query itself (SQLite's "unrecognized token" holds an unclosed
# literal whole, up to MAX_QUERY characters), and the reply gives it twice
# (the `error` header and the body), over HTTP JSON-escaped: a query of
# control characters came back six times its size.
MAX_ERROR_CHARACTERS = 1000
# People read Query output; more rows than this belongs in a LIMIT.
MAX_ROWS = 10_000

VERBS = ("query", "query:")


async def query(services: Services, request: Request, peer: str) -> Answer:
    access = services.access
    if not (access.allow_remote_query or is_loopback(peer)):
        return Answer(Response("401 Unauthorized"))
    response = await trio.to_thread.run_sync(
        run, services.store, request, access.query_seconds, access.max_reply_bytes,
        limiter=services.query_threads,
        # A shutdown does not wait for a query; it stops itself at its deadline.
        abandon_on_cancel=True,
    )
    # Its own connection may have read commits not yet on disk.
    await services.engine.settled()
    return Answer(response)


def sql_of(request: Request) -> str | None:
    if request.verb.lower() == "query:":
        return request.method_line.split(":", 1)[1].strip()
    return request.get("query")


def run(
    store: Storage,
    request: Request,
    seconds: float = DEFAULT_QUERY_SECONDS,
    max_bytes: int = DEFAULT_MAX_REPLY_BYTES,
) -> Response:
    """Answer a Query request (blocking: call it from a worker thread)."""
    sql = (sql_of(request) or "").strip()
    if not sql:
        return Response("402 Missing query")
    if len(sql) > MAX_QUERY:
        return Response(params.too_large("query", MAX_QUERY, "characters").status)
    if not sql.endswith(";"):
        # Bedrock's words, but a client's mistake: 4xx, not to be retried.
        return Response("402 Query Missing Semicolon")
    as_json = (request.get("format") or "").lower() == "json"
    body = ReplyBody(as_json, MAX_ROWS, max_bytes)
    try:
        store.run_query(sql, seconds, body)
    except QueryUnavailable as error:
        return Response(f"501 {error}")
    except QueryTimeout:
        return Response("555 Timeout")
    except OverflowError:
        return Response(f"413 Query returned more than {MAX_ROWS} rows")
    except ReplyTooLarge:
        return Response(f"413 Query reply larger than {max_bytes} bytes")
    except BadQuery as error:
        message = _quoted(str(error))
        return Response("402 Bad query", body=message.encode(), headers={"error": message})
    except store.errors as error:
        return Response(f"503 Database unavailable: {error}")
    return Response("200 OK", body.finish())


def _quoted(message: str) -> str:
    """A database's message, cut to MAX_ERROR_CHARACTERS, saying so."""
    if len(message) <= MAX_ERROR_CHARACTERS:
        return message
    left = len(message) - MAX_ERROR_CHARACTERS
    return f"{message[:MAX_ERROR_CHARACTERS]}... ({left} characters more)"


class ReplyBody:
    """The body of a Query reply, encoded a row at a time (Storage's
    QueryRows): the bytes are counted as each row is added, and the row
    that would pass `max_bytes` is refused before it joins the body."""

    def __init__(self, as_json: bool, max_rows: int, max_bytes: int) -> None:
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._as_json = as_json
        self._body = bytearray()
        self._rows = 0
        self._started = False

    def start(self, headers: list[str]) -> None:
        self._started = True
        if self._as_json:
            self._append(b'{"headers":' + jsonbody.encode(headers) + b',"rows":[')
        else:
            self._append(("|".join(headers) + "\n").encode("utf-8"))

    def add(self, row: tuple[object, ...]) -> None:
        if self._rows == self.max_rows:
            raise OverflowError(self.max_rows)
        if self._as_json:
            encoded = jsonbody.encode([_json(value) for value in row])
            self._append(b"," + encoded if self._rows else encoded)
        else:
            self._append(("|".join(_text(value) for value in row) + "\n").encode("utf-8"))
        self._rows += 1

    def finish(self) -> bytes:
        if not self._started:
            # A statement that returned no result set at all.
            self.start([])
        if self._as_json:
            self._append(b"]}")
        return bytes(self._body)

    def _append(self, chunk: bytes) -> None:
        if len(self._body) + len(chunk) > self.max_bytes:
            raise ReplyTooLarge(self.max_bytes)
        self._body += chunk


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _json(value: object) -> object:
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return _text(value)
