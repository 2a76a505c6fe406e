"""The `Query` command on SQLite, in a process of its own.

A query's text can make SQLite work inside one C call for as long as it
likes (`instr` of two 16 MB strings is quadratic, and no progress handler
runs inside it), and can make one row as large as its columns allow; a
thread can be neither stopped nor bounded in memory. A process can: the
server starts this one for each Query, with a limit on its address space
(RLIMIT_AS) and on its CPU time, and kills it at the query's deadline.

It reads one JSON object from standard input (`path`, `sql`, `seconds`,
`memory`, `max_bytes`) and writes JSON lines: `{"headers": [...]}`, then
one row a line (a list; a blob as `{"hex": ...}`), then `{"end": true}`;
or, at any point, `{"error": KIND, "text": ...}` with KIND one of "bad",
"timeout", "large", "memory". `sqlite_readers.query_in_child` is the other
side.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from typing import Any, BinaryIO

from jobserver.storage.reader_types import BadQuery, QueryTimeout, ReplyTooLarge
from jobserver.storage.sqlite_readers import read_only_query


class _Lines:
    """QueryRows that writes each row as a JSON line; a row whose values
    alone pass `max_bytes` is refused before it is encoded."""

    max_rows = sys.maxsize

    def __init__(self, out: BinaryIO, max_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_bytes

    def start(self, headers: list[str]) -> None:
        self._write({"headers": headers})

    def add(self, row: tuple[object, ...]) -> None:
        size = sum(len(value) for value in row if isinstance(value, str | bytes))
        if size > self.max_bytes:
            raise ReplyTooLarge(self.max_bytes)
        self._write([_plain(value) for value in row])

    def _write(self, value: Any) -> None:
        # ASCII, so that text SQLite holds with a lone surrogate (from a
        # `\ud800` escape in JSON data) crosses as an escape.
        self.out.write(json.dumps(value).encode("ascii"))
        self.out.write(b"\n")


def _plain(value: object) -> object:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def main() -> int:
    request = json.loads(sys.stdin.buffer.read())
    memory = int(request["memory"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = math.ceil(float(request["seconds"])) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    out = sys.stdout.buffer
    lines = _Lines(out, int(request["max_bytes"]))
    try:
        read_only_query(request["path"], request["sql"], float(request["seconds"]), lines)
        lines._write({"end": True})
    except BadQuery as error:
        lines._write({"error": "bad", "text": str(error)})
    except QueryTimeout:
        lines._write({"error": "timeout", "text": ""})
    except ReplyTooLarge:
        lines._write({"error": "large", "text": ""})
    except MemoryError:
        lines._write({"error": "memory", "text": ""})
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
