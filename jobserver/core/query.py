"""The read-only `Query` command: SQL over the jobs table, for people.

`Query` takes its SQL from a `query` header, or from the method line itself
(`Query: SELECT * FROM jobs;`, as on the Bedrock::Jobs page). Output is
sqlite3's list format with a header row, or `format: json`. The storage
runs the SQL (Storage.run_query) so that nothing can be written through it.
"""

from __future__ import annotations

import math

from jobserver.storage.interface import BadQuery, QueryTimeout, Storage
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response

MAX_QUERY = 1024 * 1024
# A query that runs longer than this holds a reader thread and the
# database's read snapshot; it is stopped and answered `555 Timeout`.
DEFAULT_SECONDS = 5.0
# People read Query output; more rows than this belongs in a LIMIT.
MAX_ROWS = 10_000

VERBS = ("query", "query:")


def sql_of(request: Request) -> str | None:
    if request.verb.lower() == "query:":
        return request.method_line.split(":", 1)[1].strip()
    return request.get("query")


def run(store: Storage, request: Request, seconds: float = DEFAULT_SECONDS) -> Response:
    """Answer a Query request (blocking: call it from a worker thread)."""
    sql = (sql_of(request) or "").strip()
    if not sql or len(sql) > MAX_QUERY:
        return Response("402 Missing query")
    if not sql.endswith(";"):
        # Bedrock's words, but a client's mistake: 4xx, not to be retried.
        return Response("402 Query Missing Semicolon")
    try:
        headers, rows = store.run_query(sql, seconds, MAX_ROWS)
    except QueryTimeout:
        return Response("555 Timeout")
    except OverflowError:
        return Response(f"413 Query returned more than {MAX_ROWS} rows")
    except BadQuery as error:
        return Response("402 Bad query", body=str(error).encode(), headers={"error": str(error)})
    if (request.get("format") or "").lower() == "json":
        body = jsonbody.encode({"headers": headers, "rows": [[_json(v) for v in r] for r in rows]})
    else:
        lines = ["|".join(headers)] + ["|".join(_text(v) for v in r) for r in rows]
        body = ("\n".join(lines) + "\n").encode("utf-8")
    return Response("200 OK", body)


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
