"""The HTTP side (`--http-port`): Jobber's POST /queue and /healthz, over
real HTTP to a real server, whose jobs are then looked at through the
wire protocol."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.web.metrics import MAX_QUEUES
from tls_certs import make_certificates
from wire import encode

TIMEOUT = 10.0


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db", http_port=0)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield running
    running.stop()


def call(
    server: ThreadServer, method: str, path: str, body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """(HTTP status, the JSON body)."""
    url = f"http://127.0.0.1:{server.server.http_port}{path}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, text


def post_queue(server: ThreadServer, document: Any, **headers: str) -> tuple[int, Any]:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    return call(server, "POST", "/queue", body, {"Content-Type": "application/json", **headers})


def job_count(server: ThreadServer) -> int:
    with server.client() as client:
        reply = ok(client.request("Query", query="SELECT COUNT(*) AS n FROM jobs;", format="json"))
        return int(reply.json["rows"][0][0])


def test_post_queue_creates_a_job_as_jobber_does(http_server: ThreadServer) -> None:
    status, body = post_queue(http_server, {"type": "email/send", "payload": {"to": "ann"}})
    assert status == 201
    assert set(body) == {"job-id"} and body["job-id"].isdigit()
    with http_server.client() as client:
        job = ok(client.request("GetJob", name="email/*")).json
    assert job["jobID"] == int(body["job-id"])
    assert (job["name"], job["data"]) == ("email/send", {"to": "ann"})


def test_a_waiting_worker_gets_a_job_posted_over_http(http_server: ThreadServer) -> None:
    from wire import encode

    with http_server.client() as worker:
        worker.send(encode("GetJob", {"name": "hook", "Connection": "wait", "timeout": 20000}))
        until(lambda: len(http_server.server.core.engine.waits) == 1, TIMEOUT, "the GetJob to wait")
        status, body = post_queue(http_server, {"type": "hook", "payload": {}})
        assert status == 201
        assert ok(worker.read_reply()).json["jobID"] == int(body["job-id"])


@pytest.mark.parametrize(
    "document",
    [
        b"not json",
        b"\xff\xfe",
        [],
        "a string",
        {},
        {"payload": {}},
        {"type": "", "payload": {}},
        {"type": 7, "payload": {}},
        {"type": "x", "payload": [1]},
        {"type": "x", "payload": "text"},
        {"type": "bad\nname", "payload": {}},
        {"type": "x" * 256, "payload": {}},
    ],
)
def test_a_malformed_body_is_400_and_stores_nothing(
    http_server: ThreadServer, document: Any
) -> None:
    status, body = post_queue(http_server, document)
    assert status == 400, body
    assert isinstance(body["error"], str) and body["error"]
    assert job_count(http_server) == 0


def test_a_body_past_the_limit_is_413(http_server: ThreadServer) -> None:
    huge = json.dumps({"type": "x", "payload": {"blob": "y" * (2 * 1024 * 1024)}}).encode()
    head = (
        b"POST /queue HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(huge)
    )
    with socket.create_connection(("127.0.0.1", http_server.server.http_port), TIMEOUT) as sock:
        # Refused from its Content-Length, before the body is read, and the
        # connection then closed: read while sending, as curl does (a
        # client that reads only when done may meet the close first).
        sender = threading.Thread(target=_send_quietly, args=(sock, head + huge), daemon=True)
        sender.start()
        status_line = sock.makefile("rb").readline()
        sender.join(TIMEOUT)
    assert status_line.startswith(b"HTTP/1.1 413 "), status_line
    assert job_count(http_server) == 0


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def test_data_over_the_limit_is_called_too_large_with_the_limit(http_server: ThreadServer) -> None:
    # Over 1 MiB as JSON text, within the body an HTTP request may have.
    blob = {"blob": "y" * (1024 * 1024)}
    expected = "402 Data too large (1048576 bytes at most)"
    with http_server.client() as client:
        assert client.request("CreateJob", name="x", data=blob).status == expected
    refused = {"error": expected, "status": expected}
    assert post_queue(http_server, {"type": "x", "payload": blob}) == (413, refused)
    code, headers, _ = api(http_server, "CreateJob", {"name": "x", "data": blob})
    assert (code, headers["Jobserver-Status"]) == (413, expected)
    assert job_count(http_server) == 0


def test_wrong_methods_and_paths(http_server: ThreadServer) -> None:
    assert call(http_server, "GET", "/queue")[0] == 405
    assert call(http_server, "POST", "/nowhere", b"{}")[0] == 404
    # The server goes on serving both sides.
    assert post_queue(http_server, {"type": "x"})[0] == 201
    with http_server.client() as client:
        assert client.request("Ping").status == "200 OK"


def test_healthz(http_server: ThreadServer) -> None:
    assert call(http_server, "GET", "/healthz") == (200, {"status": "ok"})


def test_the_token_is_asked_for_as_a_bearer(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", http_port=0, auth_token="s3cret")
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        job = {"type": "x", "payload": {}}
        assert post_queue(server, job)[0] == 401
        assert post_queue(server, job, Authorization="Bearer wrong")[0] == 401
        assert post_queue(server, job, Authorization="Basic s3cret")[0] == 401
        assert post_queue(server, job, Authorization="Bearer s3cret")[0] == 201
        # A load balancer asks for health without the token.
        assert call(server, "GET", "/healthz")[0] == 200
    finally:
        server.stop()


def test_serve_names_the_http_port_it_picked(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobserver", "serve", "--port", "0", "--http-port", "0",
         "--db", str(tmp_path / "jobs.db")],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "HTTP on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        else:
            pytest.fail("the server never said where HTTP listens")
        url = f"http://127.0.0.1:{port}/healthz"
        with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
            assert reply.status == 200
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)


def test_with_a_certificate_http_is_https(tmp_path: Path) -> None:
    files = make_certificates(tmp_path, "127.0.0.1")
    server = ThreadServer(
        tmp_path / "jobs.db", http_port=0, tls_cert=str(files.cert), tls_key=str(files.key)
    )
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        context = ssl.create_default_context(cafile=str(files.ca))
        url = f"https://127.0.0.1:{server.server.http_port}/healthz"
        with urllib.request.urlopen(url, timeout=TIMEOUT, context=context) as reply:
            assert reply.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https", "http"), timeout=TIMEOUT)
    finally:
        server.stop()


# POST /api/<Command>: every wire command, its parameters as JSON.


def api(server: ThreadServer, command: str, params: Any = None, **headers: str):
    url = f"http://127.0.0.1:{server.server.http_port}/api/{command}"
    body = params if isinstance(params, bytes) else json.dumps(params or {}).encode()
    # Declared JSON, as the API wants (urllib would say it is a form).
    headers = {"Content-Type": "application/json", **headers}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def test_the_api_runs_wire_commands(http_server: ThreadServer) -> None:
    code, headers, body = api(
        http_server, "CreateJob", {"name": "report", "data": {"day": 1}, "priority": 1000}
    )
    assert (code, headers["Jobserver-Status"]) == (200, "200 OK")
    job_id = json.loads(body)["jobID"]
    code, _, body = api(http_server, "GetJob", {"name": "report"})
    job = json.loads(body)
    assert (code, job["jobID"], job["data"], job["priority"]) == (200, job_id, {"day": 1}, 1000)
    code, headers, body = api(http_server, "FinishJob", {"jobID": job_id})
    assert (code, json.loads(body)) == (200, {"status": "200 OK"})
    code, headers, body = api(http_server, "QueryJob", {"jobID": job_id})
    assert (code, headers["Jobserver-Status"]) == (404, "404 No job with this jobID")
    # The same reply as the wire command's, byte for byte.
    api(http_server, "CreateJob", {"name": "q"})
    with http_server.client() as client:
        wire = client.request("Query", query="SELECT name FROM jobs;")
    code, headers, body = api(http_server, "Query", {"query": "SELECT name FROM jobs;"})
    assert (code, body) == (200, wire.body)
    assert headers["Content-Type"].startswith("text/plain")


def test_the_api_answers_with_http_status_codes(http_server: ThreadServer) -> None:
    code, headers, body = api(http_server, "Bogus")
    assert (code, headers["Jobserver-Status"]) == (404, "430 Unrecognized command")
    assert json.loads(body) == {"status": "430 Unrecognized command"}
    code, headers, body = api(http_server, "CreateJob", {"name": "x", "repeat": "NEVER EVER"})
    assert (code, headers["Jobserver-Status"]) == (400, "402 Malformed repeat")
    assert json.loads(body) == {"status": "402 Malformed repeat"}
    assert api(http_server, "CreateJob", b"[1]")[0] == 400
    assert api(http_server, "CreateJob", b"nope")[0] == 400
    code, _, body = api(http_server, "GetJob", {"name": "x", "Connection": "wait"})
    assert code == 400 and b"wire protocol" in body
    assert job_count(http_server) == 0


def test_the_api_checks_bodies_against_the_openapi_document(http_server: ThreadServer) -> None:
    cases = {
        # A typo is refused, not ignored.
        b'{"name": "x", "priorty": 1000}': b"priorty",
        b'{"name": "x", "priority": 3}': b"priority",
        b'{"name": 7}': b"name",
        b'{"name": "x", "data": [1]}': b"data",
        b'{"data": {}}': b"name",
    }
    for body, named in cases.items():
        code, _, reply = api(http_server, "CreateJob", body)
        assert code == 400 and named in json.loads(reply)["error"].encode(), (body, reply)
    assert job_count(http_server) == 0
    # Verbs are read in any case, as on the wire.
    assert api(http_server, "createjob", {"name": "x", "priorty": 1})[0] == 400
    assert api(http_server, "createjob", {"name": "x"})[0] == 200


def test_the_api_sets_rates_per_key_and_fair_limits_and_creates_keyed_jobs(
    http_server: ThreadServer,
) -> None:
    limit = {"name": "mail/*", "max": 1, "rate": "100/1m", "perKey": True, "fair": True}
    assert api(http_server, "SetLimit", limit)[0] == 200
    code, _, body = api(http_server, "CreateJob", {"name": "mail/a", "key": "acme"})
    acme = json.loads(body)["jobID"]
    code, _, body = api(http_server, "CreateJobs", {"jobs": [
        {"name": "mail/b", "key": "acme"}, {"name": "mail/c", "key": "globex"}]})
    globex = json.loads(body)["jobIDs"][1]
    code, _, body = api(http_server, "QueryJob", {"jobID": acme})
    assert (code, json.loads(body)["key"]) == (200, "acme")
    # One running job per key: acme's second waits.
    code, _, body = api(http_server, "GetJobs", {"name": "mail/*", "numResults": 5})
    assert {job["jobID"] for job in json.loads(body)["jobs"]} == {acme, globex}
    # max may be left out beside a rate.
    assert api(http_server, "SetLimit", {"name": "api/*", "rate": "5/1s"})[0] == 200
    code, _, body = api(http_server, "Status")
    assert json.loads(body)["limits"] == {
        "api/*": {"max": 0, "rate": "5/1s", "running": 0, "inWindow": 0},
        "mail/*": {"max": 1, "rate": "100/1m", "perKey": True, "fair": True, "running": 2,
                   "inWindow": 1, "keys": 2},
    }


def test_the_api_refuses_a_bad_rate_or_key(http_server: ThreadServer) -> None:
    # What the OpenAPI document describes is refused before the command runs.
    for command, params, named in (
        ("SetLimit", {"name": "x", "rate": "5/1w"}, "rate"),
        ("SetLimit", {"name": "x", "max": 1, "perKey": "yes"}, "perKey"),
        ("CreateJob", {"name": "x", "key": "k" * 256}, "key"),
        ("CreateJobs", {"jobs": [{"name": "x", "key": 7}]}, "key"),
    ):
        code, _, reply = api(http_server, command, params)
        assert code == 400 and named in json.loads(reply)["error"], (params, reply)
    # What it cannot (a rate's bounds, a key's bytes) the wire refuses.
    for command, params, status in (
        ("SetLimit", {"name": "x", "rate": "10001/1s"},
         "402 Malformed rate (N/DURATION: 1 to 10000 per 1s to 1d, as 100/1m)"),
        ("SetLimit", {"name": "x", "rate": "1/2d"}, "402 Malformed rate"),
        ("SetLimit", {"name": "x"}, "402 Missing max"),
        ("CreateJob", {"name": "x", "key": "\u00e9" * 128}, "402 Key too large"),
        ("CreateJob", {"name": "x", "key": "a\nb"}, "402 Malformed key"),
    ):
        code, headers, _ = api(http_server, command, params)
        assert (code, headers["Jobserver-Status"][:len(status)]) == (400, status), params
    assert job_count(http_server) == 0
    code, _, body = api(http_server, "Status")
    assert json.loads(body)["limits"] == {}


def test_the_api_wants_the_token(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", http_port=0, auth_token="s3cret")
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        assert api(server, "Ping")[0] == 401
        assert api(server, "Ping", Authorization="Bearer s3cret")[0] == 200
    finally:
        server.stop()


# GET /metrics, read with Prometheus' own parser.


def scrape(server: ThreadServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = f"http://127.0.0.1:{server.server.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_show_queues_states_ages_limits_and_pauses(http_server: ThreadServer) -> None:
    with http_server.client() as client:
        for name in ["email/send", "email/send", "email/bounce", "thumbs", "later/x"]:
            create(client, name)
        create(client, "future/x", firstRun="2999-01-01")
        failing = create(client, "email/bad", maxAttempts=1)
        ok(client.request("GetJob", name="email/bad"))
        ok(client.request("FailJob", jobID=failing))
        ok(client.request("SetLimit", name="thumbs", max=2))
        ok(client.request("GetJob", name="thumbs"))
        ok(client.request("PauseJobs", name="later/*"))
        assert client.request("Bogus").status == "430 Unrecognized command"
        # Bedrock's shorthand with the SQL on the method line is a Query too.
        ok(client.request("Query: SELECT 1;"))
        ok(client.request("Query", query="SELECT 1;"))
    figures = scrape(http_server)
    assert figures[("jobserver_jobs", (("queue", "email"), ("state", "QUEUED")))] == 3
    assert figures[("jobserver_jobs", (("queue", "email"), ("state", "FAILED")))] == 1
    assert figures[("jobserver_jobs", (("queue", "thumbs"), ("state", "RUNNING")))] == 1
    assert figures[("jobserver_limit_running", (("pattern", "thumbs"),))] == 1
    assert figures[("jobserver_limit_capacity", (("pattern", "thumbs"),))] == 2
    assert figures[("jobserver_paused", (("pattern", "later/*"),))] == 1
    assert figures[("jobserver_waiting_getjobs", ())] == 0
    assert figures[("jobserver_connections", ())] == 0
    # Ready jobs have waited a little; a job due in 2999 is not ready.
    assert figures[("jobserver_queue_oldest_age_seconds", (("queue", "email"),))] >= 0
    assert ("jobserver_queue_oldest_age_seconds", (("queue", "future"),)) not in figures
    assert ("jobserver_queue_oldest_age_seconds", (("queue", "thumbs"),)) not in figures
    # A job held by a pause is not ready: a paused queue raises no age alert.
    assert ("jobserver_queue_oldest_age_seconds", (("queue", "later"),)) not in figures
    assert figures[("jobserver_queue_paused_jobs", (("queue", "later"),))] == 1
    assert ("jobserver_queue_paused_jobs", (("queue", "email"),)) not in figures
    # Requests by command and status; the scrape's own Status counts too.
    assert figures[("jobserver_requests_total", (("code", "200"), ("command", "createjob")))] == 7
    assert figures[("jobserver_requests_total", (("code", "430"), ("command", "unknown")))] == 1
    assert figures[("jobserver_requests_total", (("code", "200"), ("command", "query")))] == 2
    commands = {
        dict(labels)["command"] for name, labels in figures if name.startswith("jobserver_requests")
    }
    assert "query:" not in commands
    assert figures[("jobserver_requests_total", (("code", "200"), ("command", "status")))] >= 1


def test_metrics_show_rates_and_per_key_limits_by_pattern_never_by_key(
    http_server: ThreadServer,
) -> None:
    with http_server.client() as client:
        ok(client.request("SetLimit", name="api/*", rate="3/1m", perKey="true", max=2))
        ok(client.request("SetLimit", name="plain", max=1))
        jobs = [{"name": "api/call", "key": f"customer-{n % 4}"} for n in range(12)]
        ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
        # Two of each key run (the max); then one of customer-0 ends and a third goes.
        taken = ok(client.request("GetJobs", name="api/*", numResults=20)).json["jobs"]
        assert len(taken) == 8
        first = next(job for job in taken if job["key"] == "customer-0")
        ok(client.request("FinishJob", jobID=first["jobID"]))
        assert ok(client.request("GetJob", name="api/*")).json["key"] == "customer-0"
    figures = scrape(http_server)
    api = (("pattern", "api/*"),)
    assert figures[("jobserver_limit_rate", api)] == 3
    assert figures[("jobserver_limit_rate_window_seconds", api)] == 60
    assert figures[("jobserver_limit_in_window", api)] == 3
    assert figures[("jobserver_limit_keys_running", api)] == 4
    assert figures[("jobserver_limit_running", api)] == 8
    assert figures[("jobserver_limit_capacity", api)] == 2
    # A plain limit has no rate and no keys; no series is labelled by key.
    assert ("jobserver_limit_rate", (("pattern", "plain"),)) not in figures
    assert ("jobserver_limit_keys_running", (("pattern", "plain"),)) not in figures
    assert not [labels for _, labels in figures if "customer" in str(labels)]


def test_metrics_age_grows_with_the_wait(http_server: ThreadServer) -> None:
    with http_server.client() as client:
        create(client, "old", firstRun="2020-01-01")
    age = scrape(http_server)[("jobserver_queue_oldest_age_seconds", (("queue", "old"),))]
    assert age > 86400 * 365


def test_metrics_sum_queues_past_the_cap_under_other(http_server: ThreadServer) -> None:
    with http_server.client() as client:
        jobs = [{"name": f"q{i}/x"} for i in range(MAX_QUEUES + 5)] + [{"name": "big"}] * 3
        ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
    figures = scrape(http_server)
    queues = {dict(labels)["queue"] for name, labels in figures if name == "jobserver_jobs"}
    assert len(queues) == MAX_QUEUES + 1 and "other" in queues and "big" in queues
    total = sum(v for (name, _), v in figures.items() if name == "jobserver_jobs")
    assert total == MAX_QUEUES + 5 + 3


def test_metrics_show_batch_sizes_and_commit_and_sync_times(http_server: ThreadServer) -> None:
    before = scrape(http_server)
    with http_server.client() as client:
        # Ten creates pipelined: they share a few transactions.
        client.send(b"".join(encode("CreateJob", {"name": "h"}) for _ in range(10)))
        replies = [client.read_reply() for _ in range(10)]
        assert {reply.status for reply in replies} == {"200 OK"}
    after = scrape(http_server)

    def grew(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0)

    # The scrapes' own Status reads count as transactions too.
    transactions = grew("jobserver_batch_requests_count")
    assert 1 <= transactions <= 10 + 2
    assert grew("jobserver_batch_requests_sum") >= 10
    assert grew("jobserver_commit_seconds_count") == transactions
    assert 0 < grew("jobserver_commit_seconds_sum") < 10 * TIMEOUT
    assert grew("jobserver_sync_seconds_count") >= 1
    inf = after[("jobserver_commit_seconds_bucket", (("le", "+Inf"),))]
    assert inf == after[("jobserver_commit_seconds_count", ())]
    # Buckets are cumulative: each at least the one below.
    bounds = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in after.items()
        if name == "jobserver_batch_requests_bucket"
    )
    assert [v for _, v in bounds] == sorted(v for _, v in bounds)
    assert bounds[0][0] == 1.0 and bounds[-1][0] == float("inf")


def test_an_http_port_in_use_stops_the_server_saying_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "jobserver", "serve", "--port", "0",
             "--http-port", str(port), "--db", str(tmp_path / "jobs.db")],
            capture_output=True, text=True, timeout=30,
        )
    assert done.returncode == 1
    assert f"cannot serve HTTP: [Errno 98] 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr and "listening on" not in done.stderr


def test_metrics_of_a_memory_database_say_why_there_are_none() -> None:
    server = ThreadServer(Path(":memory:"), http_port=0)
    try:
        until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
        status, body = call(server, "GET", "/metrics")
        assert status == 503 and b"cannot read the jobs" in body
        assert call(server, "GET", "/healthz")[0] == 200
    finally:
        server.stop()


def test_no_http_client_can_stop_the_server(http_server: ThreadServer) -> None:
    """Garbage, a reset in the middle of a body, a request cut short, huge
    headers, a client that never finishes: each costs its own connection
    only, and both sides keep serving."""
    port = http_server.server.http_port
    abuses = [
        b"\x00\xff garbage\r\n\r\n",
        b"POST /queue HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"type\": \"x\", ",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
        b"POST /api/CreateJob HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /api/CreateJob HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n\xff\xfe\x00\x01\x02",
    ]
    for abuse in abuses:
        for reset in (False, True):
            sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            # The server may close first.
            with contextlib.suppress(OSError):
                sock.sendall(abuse)
            if reset:
                # SO_LINGER 0: close sends RST instead of FIN.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            sock.close()
    lingering = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    lingering.sendall(b"POST /queue HTTP/1.1\r\nHost: x\r\n")
    try:
        assert call(http_server, "GET", "/healthz") == (200, {"status": "ok"})
        assert post_queue(http_server, {"type": "after", "payload": {}})[0] == 201
        with http_server.client() as client:
            assert client.request("Ping").status == "200 OK"
        assert job_count(http_server) == 1
    finally:
        lingering.close()


@pytest.mark.parametrize("module", ["starlette", "jsonschema"])
def test_without_the_web_extra_http_port_says_what_to_install(tmp_path: Path, module: str) -> None:
    # A module of that name that cannot be imported, ahead of the real one.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / f"{module}.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", "--port", "0", "--http-port", "0",
         "--db", str(tmp_path / "jobs.db")],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "pip install 'jobserverd[web]'" in done.stderr
    assert "listening" not in done.stderr
