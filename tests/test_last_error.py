"""A job's last error as text (jobserver.wire.last_error), for any text a
client may have sent: the worker manager's JSON, other JSON, free text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.wire.last_error import MAX_WIDTH, describe, printable

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None)
@given(st.text() | JSON.map(json.dumps) | st.dictionaries(st.text(), JSON).map(json.dumps))
def test_any_error_reads_as_bounded_printable_lines(text):
    for line in describe(text).lines():
        assert line.isprintable() and len(line) <= MAX_WIDTH


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 255), st.lists(st.text(min_size=1).map(printable), max_size=20))
def test_a_workers_error_is_its_exit_status_then_its_stderr_line_by_line(status, lines):
    lines = [line[:MAX_WIDTH] for line in lines if line.strip()] or ["boom"]
    stderr = "\n".join(lines) + "\n"
    error = json.dumps({"exitStatus": status, "stderr": stderr}, separators=(",", ":"))
    assert describe(error).lines() == [f"exit status {status}", *lines]
    tail = describe(error).lines(tail=1)
    expected = [f"... {len(lines) - 1} earlier line{'s' if len(lines) > 2 else ''}"]
    assert tail == [f"exit status {status}", *(expected if len(lines) > 1 else []), lines[-1]]


def test_shapes_that_are_not_the_worker_managers():
    assert describe("").lines() == []
    assert describe("disk full").lines() == ["disk full"]
    assert describe('"quoted\\nJSON text"').lines() == ["quoted", "JSON text"]
    assert describe("[1, 2]").lines() == ["[1, 2]"]
    assert describe('{"broken": ').lines() == ['{"broken": ']
    signalled = '{"signal": "SIGSEGV", "stderr": "", "host": "w1", "tries": [1, 2]}'
    assert describe(signalled).lines() == ["killed by signal SIGSEGV", "host: w1", "tries: [1, 2]"]
    assert describe('{"trace": "a\\nb", "stderr": 5}').lines() == [
        "trace:", "  a", "  b", "stderr: 5"
    ]
    assert describe("\x1b[2Jred\r\nnext\x00").lines() == ["\\x1b[2Jred", "next\\x00"]
    assert describe("x" * 5000).lines() == ["x" * (MAX_WIDTH - 3) + "..."]
