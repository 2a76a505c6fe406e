"""JSON input is bounded on every port: nesting depth and lone surrogates.

A JSON text a request carries (a `data` value, a `jobs` list, an HTTP
body) nests at most MAX_JSON_DEPTH arrays and objects, checked before any
parser recursion; deeper is a clear 4xx, answered fast even at 100,000
levels. A lone surrogate (`\\ud800`, from a JSON escape) in anything that
becomes a name, a pattern, a key or a parameter is refused (402 on the
wire, 400 over HTTP); inside job data it is kept, escaped. Never a 500,
on a real server through both ports, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.web import openapi
from jobserver.wire import jsonbody
from jobserver.wire.limits import MAX_JSON_DEPTH
from wire import Client

TIMEOUT = 10.0
# A deep input is refused at once, not after a parse that takes its time.
FAST = 1.0
SURROGATE = "\ud800"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadServer]:
    with contextlib.ExitStack() as stack:
        db: Path | str = tmp_path_factory.mktemp("json") / "jobs.db"
        if request.param == "postgres":
            db = stack.enter_context(pg.fresh_schema())
        running = ThreadServer(db, http_port=0)
        until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
        yield running
        running.stop()


@pytest.fixture
def wire(server: ThreadServer) -> Iterator[Client]:
    with server.client() as client:
        yield client


def post(server: ThreadServer, path: str, body: bytes | str) -> tuple[int, Any]:
    """(HTTP status, the JSON body) of a POST of `body` as JSON."""
    raw = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}", data=raw, method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, text


def get(server: ThreadServer, path: str) -> int:
    url = f"http://127.0.0.1:{server.server.http_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def nested(depth: int, inner: str = "1") -> str:
    """JSON text of objects nested `depth` deep: {"a":{"a":...1...}}."""
    return '{"a":' * depth + inner + "}" * depth


def arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def send_raw(client: Client, method: str, headers: dict[str, str]) -> Any:
    """A request whose header values are sent as given (JSON text escaped
    for the wire: backslashes doubled, protocol.md 1.3)."""
    lines = [method] + [f"{k}: {v.replace(chr(92), chr(92) * 2)}" for k, v in headers.items()]
    client.send(("\r\n".join(lines) + "\r\n\r\n").encode("utf-8"))
    return client.read_reply()


# Depth on the wire ------------------------------------------------------


def test_data_at_the_depth_limit_is_kept_and_one_past_is_refused(wire: Client) -> None:
    deepest = nested(MAX_JSON_DEPTH)
    job_id = ok(send_raw(wire, "CreateJob", {"name": "deep/ok", "data": deepest})).json["jobID"]
    stored = ok(wire.request("QueryJob", jobID=job_id)).json["data"]
    assert json.dumps(stored, separators=(",", ":")) == deepest
    reply = send_raw(wire, "CreateJob", {"name": "deep/no", "data": nested(MAX_JSON_DEPTH + 1)})
    assert reply.status == f"402 Malformed data: JSON nested deeper than {MAX_JSON_DEPTH} levels"


def test_data_behind_a_byte_order_mark_is_refused_as_malformed(wire: Client) -> None:
    # The parser is one decoder made once, which (unlike json.loads) does
    # not look for a BOM itself: it must still refuse one.
    reply = send_raw(wire, "CreateJob", {"name": "bom", "data": "\ufeff{}"})
    assert reply.status == "402 Data is not a valid JSON Object"
    reply = send_raw(wire, "CreateJobs", {"jobs": '\ufeff[{"name":"bom"}]'})
    assert reply.status == "401 Invalid JSON"


def test_a_jobs_list_at_the_depth_limit_is_taken_and_one_past_is_refused(wire: Client) -> None:
    # The list and its element are two levels: the data has the rest.
    def jobs(data_depth: int) -> str:
        return '[{"name":"deep/batch","data":' + nested(data_depth) + "}]"

    ok(send_raw(wire, "CreateJobs", {"jobs": jobs(MAX_JSON_DEPTH - 2)}))
    reply = send_raw(wire, "CreateJobs", {"jobs": jobs(MAX_JSON_DEPTH - 1)})
    assert reply.status == f"401 Invalid JSON: JSON nested deeper than {MAX_JSON_DEPTH} levels"


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize(
    "command", ["CreateJob data", "CreateJobs jobs", "FinishJobs jobs", "FinishJob data",
                "DeliverReply data", "CreateJobs data in a job"]
)
def test_deep_json_on_the_wire_is_refused_fast(wire: Client, command: str, depth: int) -> None:
    verb, header = command.split()[:2]
    text = arrays(depth) if header == "jobs" else nested(depth)
    if command == "CreateJobs data in a job":
        header, text = "jobs", '[{"name":"deep","data":' + nested(depth) + "}]"
    headers = {header: text}
    if verb in ("CreateJob",):
        headers["name"] = "deep"
    elif verb == "FinishJob":
        create(wire, "deep/finish")
        headers["jobID"] = str(ok(wire.request("GetJob", name="deep/finish")).json["jobID"])
    elif verb == "DeliverReply":
        headers["key"] = "deep"
    began = time.monotonic()
    reply = send_raw(wire, verb, headers)
    assert time.monotonic() - began < FAST
    assert 400 <= reply.code < 500, reply.status
    assert "nested deeper" in reply.status or reply.code == 404, reply.status
    assert wire.request("Ping").status == "200 OK"


# Depth over HTTP --------------------------------------------------------


def test_an_http_body_at_the_depth_limit_is_taken_and_one_past_is_refused(
    server: ThreadServer,
) -> None:
    # The body is one level: the data has the rest.
    body = '{"name":"deep/http","data":' + nested(MAX_JSON_DEPTH - 1) + "}"
    status, reply = post(server, "/api/CreateJob", body)
    assert status == 200, reply
    body = '{"name":"deep/http","data":' + nested(MAX_JSON_DEPTH) + "}"
    status, reply = post(server, "/api/CreateJob", body)
    assert (status, reply) == (
        400,
        {"status": "400 Bad Request",
         "error": f"the body is JSON nested deeper than {MAX_JSON_DEPTH} levels"},
    )
    payload = '{"type":"deep/queue","payload":' + nested(MAX_JSON_DEPTH - 1) + "}"
    assert post(server, "/queue", payload)[0] == 201
    payload = '{"type":"deep/queue","payload":' + nested(MAX_JSON_DEPTH) + "}"
    assert post(server, "/queue", payload)[0] == 400


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize(
    ("path", "template"),
    [
        ("/api/CreateJob", "{deep}"),
        ("/api/CreateJob", '{{"name":"deep","data":{deep}}}'),
        ("/api/CreateJobs", '{{"jobs":[{{"name":"deep","data":{deep}}}]}}'),
        ("/api/Ping", "{deep}"),
        ("/queue", '{{"type":"deep","payload":{deep}}}'),
        ("/queue", "{deep}"),
    ],
)
def test_deep_json_over_http_is_refused_fast(
    server: ThreadServer, path: str, template: str, depth: int
) -> None:
    deep = arrays(depth) if template == "{deep}" else nested(depth)
    began = time.monotonic()
    status, reply = post(server, path, template.format(deep=deep))
    assert time.monotonic() - began < FAST
    assert status == 400, reply
    assert "nested deeper than" in reply["error"]


# Lone surrogates --------------------------------------------------------

# Every command's parameter that is a name, a pattern, a key or other text
# the server keeps or compares, with a lone surrogate in it.
HTTP_CASES: list[tuple[str, dict[str, Any]]] = [
    ("CreateJob", {"name": SURROGATE}),
    ("CreateJob", {"name": "a" + SURROGATE + "b"}),
    ("CreateJob", {"name": "ok", "repeat": SURROGATE}),
    ("CreateJob", {"name": "ok", "timeZone": SURROGATE}),
    ("CreateJob", {"name": "ok", "retryAfter": SURROGATE}),
    ("GetJob", {"name": SURROGATE}),
    ("GetJob", {"name": "a," + SURROGATE}),
    ("GetJobs", {"name": SURROGATE, "numResults": 2}),
    ("FailedJobs", {"name": SURROGATE}),
    ("PauseJobs", {"name": SURROGATE}),
    ("ResumeJobs", {"name": SURROGATE}),
    ("SetLimit", {"name": SURROGATE, "max": 1}),
    ("RequeueJobs", {"jobIDs": "1", "name": SURROGATE}),
    ("AwaitReply", {"jobID": 1, "key": SURROGATE}),
    ("DeliverReply", {"key": SURROGATE, "data": {}}),
    ("FailJob", {"jobID": 1, "error": SURROGATE}),
    ("RetryJob", {"jobID": 1, "name": SURROGATE}),
    ("RequeueJobs", {"jobIDs": SURROGATE}),
    ("QueryJob", {"jobID": SURROGATE}),
    ("Query", {"query": "SELECT '" + SURROGATE + "';"}),
    ("Ping", {SURROGATE: 1}),
]
# Where the surrogate is inside a list, the wire command's own check
# answers, with its own status.
NESTED_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("CreateJobs", {"jobs": [{"name": SURROGATE}]}, "402 Malformed name"),
    ("CreateJobs", {"jobs": [{"name": "ok", "repeat": SURROGATE}]}, "402 Malformed repeat"),
    ("FinishJobs", {"jobs": [{"jobID": SURROGATE}]}, "402 Malformed jobID"),
]


@pytest.mark.parametrize(("command", "params"), HTTP_CASES)
def test_a_lone_surrogate_in_a_parameter_over_http_is_400(
    server: ThreadServer, command: str, params: dict[str, Any]
) -> None:
    status, reply = post(server, f"/api/{command}", json.dumps(params))
    assert status == 400, reply
    assert "lone surrogate" in reply["error"]


@pytest.mark.parametrize(("command", "params", "expected"), NESTED_CASES)
def test_a_lone_surrogate_in_a_list_element_gets_the_commands_status(
    server: ThreadServer, wire: Client, command: str, params: dict[str, Any], expected: str
) -> None:
    status, reply = post(server, f"/api/{command}", json.dumps(params))
    # The OpenAPI document's check may answer first, with 400.
    assert reply.get("status") == expected or status == 400, reply
    # The same element on the wire: the JSON escape reaches the parser.
    text = json.dumps(params["jobs"])
    assert send_raw(wire, command, {"jobs": text}).status == expected


def test_a_lone_surrogate_in_a_key_of_a_list_element_is_refused_on_the_wire(
    wire: Client,
) -> None:
    text = json.dumps([{"name": "ok", SURROGATE: "x"}])
    reply = send_raw(wire, "CreateJobs", {"jobs": text})
    assert reply.status == "402 Malformed parameter name: a lone surrogate"


def test_a_lone_surrogate_for_jobber_is_400(server: ThreadServer) -> None:
    status, reply = post(server, "/queue", json.dumps({"type": SURROGATE, "payload": {}}))
    assert status == 400 and "lone surrogate" in reply["error"]


@dataclass
class Stored:
    job_id: int
    data: Any


def test_a_lone_surrogate_in_job_data_is_kept_escaped_on_both_ports(
    server: ThreadServer, wire: Client
) -> None:
    data = {"text": SURROGATE, SURROGATE: [SURROGATE]}
    stored: list[Stored] = []
    status, reply = post(server, "/api/CreateJob", json.dumps({"name": "sur/http", "data": data}))
    assert status == 200, reply
    stored.append(Stored(reply["jobID"], data))
    status, reply = post(server, "/queue", json.dumps({"type": "sur/jobber", "payload": data}))
    assert status == 201, reply
    stored.append(Stored(int(reply["job-id"]), data))
    reply = send_raw(wire, "CreateJob", {"name": "sur/wire", "data": json.dumps(data)})
    stored.append(Stored(ok(reply).json["jobID"], data))
    for job in stored:
        assert ok(wire.request("QueryJob", jobID=job.job_id)).json["data"] == job.data
        status, reply = post(server, "/api/QueryJob", json.dumps({"jobID": job.job_id}))
        assert (status, reply["data"]) == (200, job.data)
        # The dashboard's page of the job shows it too.
        assert get(server, f"/jobs/{job.job_id}") == 200
    taken = ok(wire.request("GetJobs", name="sur/*", numResults=10)).json["jobs"]
    assert sorted(job["jobID"] for job in taken) == sorted(job.job_id for job in stored)


@pytest.mark.parametrize(
    ("command", "params"),
    [
        ("CreateJob", {"name": "\\ud800"}),
        ("GetJob", {"name": "\\ud800"}),
        ("GetJobs", {"name": "\\ud800", "numResults": "1"}),
        ("FailedJobs", {"name": "\\ud800"}),
        ("PauseJobs", {"name": "\\udfff*"}),
        ("ResumeJobs", {"name": "\\udfff*"}),
        ("SetLimit", {"name": "\\ud800", "max": "1"}),
        ("AwaitReply", {"jobID": "1", "key": "\\ud800"}),
        ("DeliverReply", {"key": "\\ud800", "data": "{}"}),
    ],
)
def test_a_surrogate_escape_in_a_wire_header_is_never_a_server_error(
    wire: Client, command: str, params: dict[str, str]
) -> None:
    """In a header value `\\ud800` is unescaped to U+FFFD (protocol.md 1.3):
    the server never holds a lone surrogate from a header."""
    lines = [command] + [f"{k}: {v}" for k, v in params.items()]
    wire.send(("\r\n".join(lines) + "\r\n\r\n").encode())
    reply = wire.read_reply()
    assert reply.code < 500, reply.status


# Property: whatever the /api commands get, never a server error ---------------

# Backup writes files where it is told: tests/test_backup.py covers it.
COMMANDS = sorted(set(openapi.COMMANDS) - {"Backup"})


@dataclass(frozen=True)
class Deep:
    """A value written as `depth` nested arrays."""

    depth: int


def _odd_text() -> st.SearchStrategy[str]:
    """Short text, lone surrogates (category Cs) and controls among it."""
    return st.text(
        st.characters(codec=None, categories=["Cs", "Cc", "Lu", "Nd"]) | st.sampled_from("*,?[]"),
        max_size=8,
    )


def _values() -> st.SearchStrategy[Any]:
    odd_text = _odd_text()
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | odd_text
    deep = st.builds(Deep, st.sampled_from(
        [MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 1000, 5000]
    ))
    return st.recursive(
        scalars | deep,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
        max_leaves=6,
    )


def _text(value: Any) -> str:
    """JSON text of `value`, a Deep as its brackets (json.dumps would itself
    recurse too deep); lone surrogates as \\u escapes."""
    if isinstance(value, Deep):
        return arrays(value.depth)
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@st.composite
def api_calls(draw: st.DrawFn) -> tuple[str, str]:
    command = draw(st.sampled_from(COMMANDS))
    schema = openapi.body_schema(command) or {}
    names = sorted(schema.get("properties", {})) or ["name"]
    keys = draw(st.lists(st.sampled_from(names) | st.text(max_size=4), max_size=4, unique=True))
    body = {key: draw(_values()) for key in keys}
    return command, _text(body)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=api_calls())
def test_no_api_command_answers_a_server_error_to_surrogates_or_depth(
    server: ThreadServer, call: tuple[str, str]
) -> None:
    command, body = call
    status, reply = post(server, f"/api/{command}", body)
    assert status < 500, (command, body[:500], status, reply)


WIRE_JSON_PARAMS = [
    ("CreateJobs", "jobs"), ("FinishJobs", "jobs"), ("CreateJob", "data"),
    ("DeliverReply", "data"), ("UpdateJob", "data"),
]


@st.composite
def wire_calls(draw: st.DrawFn) -> tuple[str, dict[str, str]]:
    command, param = draw(st.sampled_from(WIRE_JSON_PARAMS))
    value = draw(_values())
    if draw(st.booleans()):
        # A list of objects, as the batch commands want.
        element = st.fixed_dictionaries(
            {"name": _odd_text()},
            optional={"data": _values(), "repeat": _odd_text(), "jobID": _odd_text(),
                      "error": _odd_text()},
        )
        value = draw(st.lists(element, min_size=1, max_size=3))
        # A key of an element's own, odd too.
        value[0].update(draw(st.dictionaries(_odd_text(), _values(), max_size=1)))
    headers = {param: _text(value), "name": "fuzz", "jobID": "1", "key": "fuzz"}
    return command, headers


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=wire_calls())
def test_no_wire_command_answers_a_server_error_to_surrogates_or_depth(
    wire: Client, call: tuple[str, dict[str, str]]
) -> None:
    command, headers = call
    reply = send_raw(wire, command, headers)
    assert reply.code < 500, (command, headers, reply.status)


def test_stored_data_one_level_past_the_limit_is_still_served(wire: Client) -> None:
    """A reply put in a job's data adds a level: data and reply, each at
    the limit, make stored data one level deeper, which the server takes
    on as its own (a hand-out under a lease reads it, FinishJob ends it)."""
    deepest = nested(MAX_JSON_DEPTH)
    ok(send_raw(wire, "CreateJob", {"name": "grow", "data": deepest, "retryAfter": "+1 HOUR"}))
    job_id = ok(wire.request("GetJob", name="grow")).json["jobID"]
    ok(wire.request("AwaitReply", jobID=job_id, key=f"grow-{job_id}"))
    ok(send_raw(wire, "DeliverReply", {"key": f"grow-{job_id}", "data": deepest}))
    again = ok(wire.request("GetJob", name="grow")).json
    assert again["jobID"] == job_id
    assert json.dumps(again["data"]["reply"], separators=(",", ":")) == deepest
    ok(wire.request("FinishJob", jobID=job_id))


# Depth is counted in linear time ----------------------------------------


def _deeper_than_the_bound(text: str) -> bool:
    """The reference count: brackets outside strings, one at a time, up to
    a bracket that closes below the start (the parser stops there)."""
    level, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            level += 1
            if level > MAX_JSON_DEPTH:
                return True
        elif char in "]}":
            level -= 1
            if level < 0:
                return False
    return False


@given(
    opened=st.integers(MAX_JSON_DEPTH - 5, MAX_JSON_DEPTH + 2),
    # With escapes, and without (whose strings check_depth finds another way).
    rest=st.text(alphabet='[]{}"\\a,', max_size=40) | st.text(alphabet='[]{}"a,', max_size=40),
)
def test_check_depth_counts_as_the_brackets_are_read(opened: int, rest: str) -> None:
    text = "[" * opened + rest
    try:
        jsonbody.check_depth(text)
    except jsonbody.TooDeep:
        assert _deeper_than_the_bound(text)
    else:
        assert not _deeper_than_the_bound(text)


def test_escaped_quotes_in_an_unterminated_string_are_read_once(wire: Client) -> None:
    # 80 KB of `\"` after an opening quote: the string's regular
    # expression was tried again from every quote, 32 s before any answer.
    data = '{"a":' + "[" * MAX_JSON_DEPTH + '"' + '\\"' * 40_000
    began = time.monotonic()
    reply = send_raw(wire, "CreateJob", {"name": "quotes", "data": data})
    assert time.monotonic() - began < FAST
    assert reply.status == f"402 Malformed data: JSON nested deeper than {MAX_JSON_DEPTH} levels"
