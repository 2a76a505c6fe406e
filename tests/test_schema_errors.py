"""A body that the OpenAPI document refuses is told what is wrong as a
person would write it (web/schema_errors.py), over a real server's
/api/*: the parameter, what it takes, and what it got."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from harness import ThreadServer
from helpers import until
from jobserver.web import openapi, schema_errors

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path_factory.mktemp("schema") / "jobs.db", http_port=0)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


def refusal(server: ThreadServer, command: str, body: Any) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}/api/{command}",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


@pytest.mark.parametrize(
    "command,body,message",
    [
        ("CreateJob", {"name": "x", "maxAttempts": "3"},
         'maxAttempts: expected an integer from 1 to 10000, got the string "3"'),
        ("CreateJob", {"name": "x", "maxAttempts": 1.5},
         "maxAttempts: expected an integer from 1 to 10000, got the number 1.5"),
        ("CreateJob", {"name": "x", "maxAttempts": True},
         "maxAttempts: expected an integer from 1 to 10000, got true"),
        ("CreateJob", {"name": "x", "priority": 3},
         "priority: expected one of 0, 250, 500, 750, 850, 1000, got the integer 3"),
        ("CreateJob", {"name": "x", "priorty": 1000},
         "priorty: not a parameter here (did you mean priority?)"),
        ("CreateJob", {"data": {}}, "name: required, and missing"),
        ("CreateJob", {"name": 7},
         "name: expected a string of 1 to 255 characters, got the integer 7"),
        ("CreateJob", {"name": "x", "data": [1, 2]},
         "data: expected a JSON object, got an array of 2 items"),
        ("CreateJob", {"name": "x", "unique": "yes"},
         'unique: expected true or false, got the string "yes"'),
        ("CreateJob", {"name": "x", "retryBackoff": "linear"},
         'retryBackoff: expected one of "fixed", "exponential", got the string "linear"'),
        ("CreateJob", {"name": "x", "retryDelay": -1},
         "retryDelay: expected a number from 0 to 99999999, got the integer -1"),
        ("CreateJob", {"name": "x", "key": "k" * 300},
         'key: expected a string of at most 255 characters, got the string "'
         + "k" * 40 + '..." (300 characters)'),
        ("CreateJobs", {"jobs": [{"name": "a"}, {"name": "b", "key": 7}]},
         "jobs[1].key: expected a string of at most 255 characters, got the integer 7"),
        ("CreateJobs", {"jobs": [{"nme": "a"}]}, "jobs[0].name: required, and missing"),
        ("CreateJobs", {"jobs": []},
         "jobs: expected an array of 1 or more objects, got an array of 0 items"),
        ("SetLimit", {"name": "x", "rate": "5/1w"},
         'rate: expected a string such as "100/1m", got the string "5/1w"'),
        ("GetJobs", {"name": "x"}, "numResults: required, and missing"),
        ("FinishJobs", {"jobs": [{"jobID": 0}]},
         "jobs[0].jobID: expected an integer from 1 to 9223372036854775807, got the integer 0"),
        ("Ping", {"x\n\u2028": 1}, '"x\\n\\u2028": not a parameter here (it takes none)'),
    ],
)
def test_a_refused_body_is_told_what_is_wrong(
    http_server: ThreadServer, command: str, body: Any, message: str
) -> None:
    assert refusal(http_server, command, body) == (400, message)


@settings(max_examples=300, deadline=None)
@given(
    command=st.sampled_from(sorted(openapi.COMMANDS)),
    body=st.dictionaries(
        st.sampled_from(["name", "jobID", "data", "jobs", "maxAttempts", "priority", "limit",
                         "key", "rate", "x"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
            | st.text(max_size=60),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                        inner, max_size=3),
            max_leaves=8,
        ),
        max_size=4,
    ),
)
def test_every_refusal_reads_as_one_short_line(command: str, body: dict[str, Any]) -> None:
    validator = Draft202012Validator(openapi.body_schema(command) or {})
    message = schema_errors.explain(validator.iter_errors(body))
    if not list(validator.iter_errors(body)):
        assert message == ""
        return
    assert message and message.isprintable() and len(message) < 400, message
    assert "is not valid under any of the given schemas" not in message


def answer(
    server: ThreadServer, path: str, body: bytes, kind: str = "application/json"
) -> tuple[int, dict[str, Any], str | None]:
    """(HTTP status, the JSON body, its Jobserver-Status header)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}", data=body, method="POST",
        headers={"Content-Type": kind},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, json.loads(reply.read()), reply.headers["Jobserver-Status"]
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers["Jobserver-Status"]


@pytest.mark.parametrize(
    "path,body,kind,line",
    [
        # The schema's refusal, a parameter's name of characters no header can carry.
        ("/api/CreateJob", b'{"name":"x","maxAttempts":"3"}', "application/json",
         "400 Bad Request"),
        ("/api/Ping", json.dumps({"x\r\n\u00e9\u2028": 1}).encode(), "application/json",
         "400 Bad Request"),
        ("/queue", b'{"type":"x","priorty":1}', "application/json", "400 Bad Request"),
        ("/api/Ping", b"not json", "application/json", "400 Bad Request"),
        ("/api/Ping", b"{}", "text/plain", "415 Unsupported Media Type"),
        # The wire's own refusals, as they were.
        ("/api/QueryJob", b'{"jobID":999999}', "application/json",
         "404 No job with this jobID"),
        ("/queue", b'{"type":"x","payload":{"a":"' + b"a" * (1 << 20) + b'"}}',
         "application/json", "402 Data too large (1048576 bytes at most)"),
        # A wire refusal whose body is text (Query's error) was that text,
        # as text/plain (schemathesis found it).
        ("/api/Query", b'{"query":"cr;","format":"json"}', "application/json",
         "402 Bad query"),
    ],
)
def test_every_refusal_has_one_shape(
    http_server: ThreadServer, path: str, body: bytes, kind: str, line: str
) -> None:
    """Whoever refuses, the HTTP side before any command runs or the wire's
    command: the line in `status` and in `Jobserver-Status`, and `error`
    saying why unless the wire's line is all there is."""
    code, document, header = answer(http_server, path, body, kind)
    assert code >= 400
    assert header == document["status"] == line
    wire_line_alone = path.startswith("/api/") and line.startswith("404")
    assert set(document) == ({"status"} if wire_line_alone else {"status", "error"})


@pytest.mark.parametrize("path", ["/api/Ping", "/queue"])
def test_a_method_other_than_post_is_refused_in_the_same_shape(
    http_server: ThreadServer, path: str
) -> None:
    """The router's 405 was text/plain without Jobserver-Status."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_server.server.http_port}{path}", method="GET"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    error = refused.value
    document = json.loads(error.read())
    assert error.code == 405 and error.headers["Allow"] == "POST"
    assert error.headers["Jobserver-Status"] == document["status"] == "405 Method Not Allowed"
    assert document["error"] == f"{path} takes POST alone"


def test_a_path_under_api_that_names_no_command_is_refused_as_such(
    http_server: ThreadServer,
) -> None:
    """The router's 404 under /api said "takes POST alone"."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_server.server.http_port}/api/a/b", data=b"{}", method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    error = refused.value
    document = json.loads(error.read())
    assert error.code == 404
    assert error.headers["Jobserver-Status"] == document["status"] == "404 Not Found"
    assert document["error"] == "/api/a/b names no command"
