"""Issue 23, the HTTP side: what another site's page, a page on a name that
resolves to this machine (DNS rebinding), and someone guessing the token
can do. Real servers on loopback ports, raw HTTP requests, curl, and
headless Chromium running the attacks as a web page would."""

from __future__ import annotations

import http.client
import http.server
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from harness import ServerProcess, ThreadServer
from helpers import chromium as launch_chromium
from helpers import until
from jobserver.cli import build_parser
from jobserver.web.access import FIRST_PENALTY_SECONDS
from wire import Client

TIMEOUT = 10.0
TOKEN = "s3cret-token"
# Chromium's Private Network Access stops a page from a public address
# fetching from loopback; Firefox and Safari have no such check, nor
# Chromium before it. These flags turn it off, so the browser under test
# plays any of them.
WITHOUT_PRIVATE_NETWORK_ACCESS = (
    "--disable-features=BlockInsecurePrivateNetworkRequests,"
    "PrivateNetworkAccessRespectPreflightResults,PrivateNetworkAccessSendPreflights,"
    "LocalNetworkAccessChecks"
)
# A name no DNS serves: Chromium is told it is 127.0.0.1, as an attacker's
# DNS would answer once the page has loaded (DNS rebinding).
REBOUND = "rebind.example"


def start(db: Path, **options: Any) -> ThreadServer:
    running = ThreadServer(db, http_port=0, **options)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    return running


@pytest.fixture(params=[None, TOKEN], ids=["no token", "a token"])
def any_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ThreadServer]:
    running = start(tmp_path / "jobs.db", auth_token=request.param)
    yield running
    running.stop()


@pytest.fixture
def open_server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = start(tmp_path / "jobs.db", http_hosts=("jobs.internal",))
    yield running
    running.stop()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[ThreadServer]:
    running = start(tmp_path / "jobs.db", auth_token=TOKEN)
    yield running
    running.stop()


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


def send(
    server: ThreadServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    source: str = "",
) -> Answer:
    """One raw request: exactly these headers (and Host, unless given; no
    Content-Type unless given), from the address `source` if set."""
    port = server.server.http_port
    assert port is not None
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=TIMEOUT, source_address=(source, 0) if source else None
    )
    try:
        connection.request(method, path, body, headers or {})
        reply = connection.getresponse()
        return Answer(reply.status, reply.headers, reply.read())
    finally:
        connection.close()


def own(server: ThreadServer) -> str:
    return f"127.0.0.1:{server.server.http_port}"


def bearer(server: ThreadServer) -> dict[str, str]:
    token = server.server.config.auth_token
    return {"Authorization": f"Bearer {token}"} if token else {}


def wire_auth(server: ThreadServer) -> dict[str, str]:
    token = server.server.config.auth_token
    return {"authToken": token} if token else {}


def job_names(server: ThreadServer) -> list[str]:
    with Client(server.port) as client:
        reply = client.request(
            "Query", wire_auth(server), query="SELECT name FROM jobs ORDER BY jobID;", format="json"
        )
    assert reply.status == "200 OK", reply.status
    return [row[0] for row in reply.json["rows"]]


def paused(server: ThreadServer) -> list[str]:
    with Client(server.port) as client:
        reply = client.request("Status", wire_auth(server))
    assert reply.status == "200 OK", reply.status
    return list(reply.json["paused"])


CREATE = json.dumps({"name": "attack"}).encode()
JOBBER = json.dumps({"type": "attack", "payload": {}}).encode()
FOREIGN_ORIGINS = ["http://evil.example", "null", "http://127.0.0.1:1", "http://localhost"]


# What a page on another site can send: refused, token or not.


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
        "application/jsonx",
        "text/json",
    ],
)
@pytest.mark.parametrize("path,body", [("/api/CreateJob", CREATE), ("/queue", JOBBER)])
def test_the_json_api_wants_a_json_content_type(
    any_server: ThreadServer, content_type: str | None, path: str, body: bytes
) -> None:
    headers = {**bearer(any_server)}
    if content_type is not None:
        headers["Content-Type"] = content_type
    answer = send(any_server, "POST", path, body, headers)
    assert answer.status == 415, answer.body
    assert "application/json" in answer.json["error"]
    assert job_names(any_server) == []


@pytest.mark.parametrize(
    "headers",
    [
        *({"Origin": origin} for origin in FOREIGN_ORIGINS),
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "Cross-Site"},
    ],
    ids=lambda headers: "=".join(next(iter(headers.items()))),
)
@pytest.mark.parametrize("path,body", [("/api/CreateJob", CREATE), ("/queue", JOBBER)])
def test_the_json_api_refuses_another_sites_page(
    any_server: ThreadServer, headers: dict[str, str], path: str, body: bytes
) -> None:
    sent = {"Content-Type": "application/json", **bearer(any_server), **headers}
    answer = send(any_server, "POST", path, body, sent)
    assert answer.status == 403, answer.body
    assert "another site" in answer.json["error"]
    assert job_names(any_server) == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
    ],
    ids=lambda headers: "=".join(next(iter(headers.items()))),
)
def test_the_dashboards_forms_refuse_another_sites_page(
    any_server: ThreadServer, headers: dict[str, str]
) -> None:
    """Even with the token as a bearer: a page cannot send one, so what
    matters is who sent it."""
    form = {"Content-Type": "application/x-www-form-urlencoded", **bearer(any_server), **headers}
    body = urlencode({"name": "*", "back": "/"}).encode()
    for path in ["/actions/pause", "/signin", "/signout"]:
        page = send(any_server, "POST", path, body, form)
        assert page.status == 403 and b"another site" in page.body, path
    assert paused(any_server) == []


def test_another_sites_page_cannot_lock_the_operator_out(guarded: ThreadServer) -> None:
    """Wrong sign-ins a page sends are refused before they are counted."""
    form = urlencode({"token": "guess", "back": "/"}).encode()
    for _ in range(30):
        page = send(guarded, "POST", "/signin", form, {
            "Content-Type": "application/x-www-form-urlencoded",
            "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site",
        })
        assert page.status == 403
    assert browser(guarded).sign_in().status == 303


def test_with_a_token_a_missing_token_is_401_first(guarded: ThreadServer) -> None:
    for headers in [{"Content-Type": "text/plain"}, {"Content-Type": "application/json"}]:
        assert send(guarded, "POST", "/api/CreateJob", CREATE, headers).status == 401
        assert send(guarded, "POST", "/queue", JOBBER, headers).status == 401
    assert job_names(guarded) == []


def test_a_json_client_without_an_origin_keeps_working(any_server: ThreadServer) -> None:
    auth = bearer(any_server)
    for content_type in ["application/json", "application/json; charset=utf-8", "Application/JSON"]:
        headers = {"Content-Type": content_type, **auth}
        assert send(any_server, "POST", "/api/CreateJob", CREATE, headers).status == 200
        assert send(any_server, "POST", "/queue", JOBBER, headers).status == 201
    # The dashboard's own page (same origin) may call the API too.
    same = {
        "Content-Type": "application/json", "Origin": f"http://{own(any_server)}",
        "Sec-Fetch-Site": "same-origin", **auth,
    }
    assert send(any_server, "POST", "/api/CreateJob", CREATE, same).status == 200
    assert job_names(any_server) == ["attack"] * 7


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_with_the_json_header_works_and_without_it_is_told_why(
    any_server: ThreadServer,
) -> None:
    url = f"http://{own(any_server)}/api/CreateJob"
    auth = [f"-H{k}: {v}" for k, v in bearer(any_server).items()]

    def curl(*options: str) -> tuple[int, Any]:
        done = subprocess.run(
            ["curl", "-sS", "--noproxy", "*", "-w", "\n%{http_code}", *auth, *options, url],
            capture_output=True, text=True, timeout=TIMEOUT, check=True,
        )
        body, _, code = done.stdout.rpartition("\n")
        return int(code), json.loads(body)

    assert curl("-H", "Content-Type: application/json", "-d", '{"name":"curl"}') == (
        200, {"jobID": 1}
    )
    code, body = curl("-d", '{"name":"form"}')
    assert code == 415 and "Content-Type: application/json" in body["error"]
    assert job_names(any_server) == ["curl"]


# The Host header: DNS rebinding.


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1", "127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}",
        "localhost.:{port}", "[::1]:{port}", "10.1.2.3:{port}", "jobs.internal:{port}",
        "Jobs.Internal", "jobs.internal.",
    ],
)
def test_the_servers_own_names_are_answered(open_server: ThreadServer, host: str) -> None:
    host = host.format(port=open_server.server.http_port)
    assert send(open_server, "GET", "/", headers={"Host": host}).status == 200
    assert send(open_server, "GET", "/metrics", headers={"Host": host}).status == 200
    headers = {"Host": host, "Content-Type": "application/json"}
    assert send(open_server, "POST", "/api/Ping", b"{}", headers).status == 200


REBINDING_HOSTS = [
    "evil.example:{port}", "evil.example", "127.0.0.1.evil.example:{port}",
    "localhost.evil.example:{port}", "jobs.internal.evil.example", "evil-jobs.internal",
    "", "127.0.0.1:{port}:1", "[::1", "[::1]x", "127.0.0.1:http",
]


@pytest.mark.parametrize("host", REBINDING_HOSTS)
def test_a_request_naming_another_host_is_refused(any_server: ThreadServer, host: str) -> None:
    host = host.format(port=any_server.server.http_port)
    auth = bearer(any_server)
    pages = ["/", "/live", "/jobs/1", "/jobs?name=*", "/scheduled", "/retries"]
    for path in [*pages, "/static/dashboard.js", "/nowhere"]:
        page = send(any_server, "GET", path, headers={"Host": host, **auth})
        assert page.status == 421, (path, page.body)
        assert page.headers["Content-Type"].startswith("text/plain")
        assert b"does not answer to the Host" in page.body and b"<" not in page.body
    for path in ["/metrics", "/healthz", "/openapi.json"]:
        answer = send(any_server, "GET", path, headers={"Host": host, **auth})
        assert answer.status == 421 and "--http-host" in answer.json["error"], path
    # As a rebinding page sends it: its Origin matches its Host.
    same = {"Host": host, "Origin": f"http://{host}", "Content-Type": "application/json", **auth}
    assert send(any_server, "POST", "/api/CreateJob", CREATE, same).status == 421
    assert send(any_server, "POST", "/queue", JOBBER, same).status == 421
    form = urlencode({"name": "*", "back": "/"}).encode()
    action = {**same, "Content-Type": "application/x-www-form-urlencoded"}
    assert send(any_server, "POST", "/actions/pause", form, action).status == 421
    assert job_names(any_server) == [] and paused(any_server) == []


def test_the_name_the_server_listens_on_is_one_of_its_names(tmp_path: Path) -> None:
    import socket

    name = socket.gethostname().lower()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = ""
    if not address.startswith("127."):
        pytest.skip(f"this machine's name {name!r} is not a loopback name")
    running = ThreadServer(tmp_path / "jobs.db", host=name, http_port=0)
    try:
        until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
        port = running.server.http_port
        assert send(running, "GET", "/healthz", headers={"Host": f"{name}:{port}"}).status == 200
        assert send(running, "GET", "/healthz", headers={"Host": "evil.example"}).status == 421
    finally:
        running.stop()


DNS_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
DNS_NAME = st.lists(DNS_LABEL, min_size=1, max_size=4).map(".".join)
PORT = st.one_of(st.just(""), st.integers(0, 65535).map(lambda port: f":{port}"))


@given(st.text(max_size=300))
def test_any_host_header_is_judged_without_error(header: str) -> None:
    from jobserver.web.access import host_name, is_ip_literal, known_host

    name = host_name(header)
    if known_host(header, frozenset({"jobs.internal"})):
        assert name is not None
        assert name in ("localhost", "jobs.internal") or is_ip_literal(name)


@given(DNS_NAME, PORT, st.booleans())
@example(name="0.0.0.0", port="", listed=False)
def test_a_dns_name_is_answered_only_if_it_is_listed(name: str, port: str, listed: bool) -> None:
    from jobserver.web.access import is_ip_literal, known_host

    # Digits and dots make a DNS name too: `0.0.0.0` is an address, and
    # addresses are always answered (the next test).
    assume(not is_ip_literal(name))
    names = frozenset({name}) if listed else frozenset()
    expected = listed or name == "localhost"
    assert known_host(f"{name}{port}", names) == expected
    assert known_host(f"{name.upper()}.{port}", names) == expected


@given(st.ip_addresses(), PORT)
def test_an_ip_address_is_always_answered(address: Any, port: str) -> None:
    from jobserver.web.access import known_host

    text = f"[{address}]" if address.version == 6 else str(address)
    assert known_host(f"{text}{port}", frozenset())


def test_two_host_headers_are_refused(open_server: ThreadServer) -> None:
    port = open_server.server.http_port
    assert port is not None
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        connection.putrequest("GET", "/", skip_host=True)
        connection.putheader("Host", f"127.0.0.1:{port}")
        connection.putheader("Host", "evil.example")
        connection.endheaders()
        assert connection.getresponse().status in (400, 421)
    finally:
        connection.close()


def test_serve_takes_http_host_names_and_checks_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ServerProcess(
        tmp_path / "jobs.db", "--http-port", "0", "--http-host", "Jobs.Example.COM",
        "--http-host", "other.example",
    )
    try:
        found = server.matching(r"HTTP on [\d.]+:(\d+)", 1, TIMEOUT)
        assert found, server.log
        port = int(found[0].rsplit(":", 1)[1])
        for host, status in [("jobs.example.com", 200), ("other.example", 200),
                             ("evil.example", 421)]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
            connection.request("GET", "/healthz", headers={"Host": f"{host}:{port}"})
            assert connection.getresponse().status == status, host
            connection.close()
    finally:
        server.signal()
        server.wait()
    for option in [["--http-host", "evil example"], ["--http-host", "-x.example"],
                   ["--http-host", "a" * 64 + ".example"], ["--http-host", "x:80"],
                   ["--http-host", ""], ["--session-lifetime", "59s"],
                   ["--session-lifetime", "31d"], ["--session-lifetime", "soon"]]:
        # Read by serve's own parser here: a process each cost seconds
        # under the suite's load (test_serve_options runs the command).
        with pytest.raises(SystemExit) as exit:
            build_parser().parse_args(
                ["serve", "--db", str(tmp_path / "x.db"), "--http-port", "0", *option]
            )
        assert exit.value.code == 2, option
        assert option[0] in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()


# Dashboard sessions.


@dataclass
class Browser:
    """Cookies and requests as a browser on this server's own pages sends them."""

    server: ThreadServer
    cookies: dict[str, str]
    source: str = ""

    def post(self, path: str, fields: dict[str, str]) -> Answer:
        headers = {
            "Content-Type": "application/x-www-form-urlencoded",
            "Origin": f"http://{own(self.server)}",
            "Sec-Fetch-Site": "same-origin",
        }
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        answer = send(
            self.server, "POST", path, urlencode(fields).encode(), headers, self.source
        )
        for line in answer.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(line).items():
                if morsel["max-age"] == "0" or morsel.value == "":
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return answer

    def sign_in(self, token: str = TOKEN) -> Answer:
        return self.post("/signin", {"token": token, "back": "/"})

    def pause(self, pattern: str) -> int:
        return self.post("/actions/pause", {"name": pattern, "back": "/"}).status


def browser(server: ThreadServer, source: str = "") -> Browser:
    return Browser(server, {}, source)


def session_of(visitor: Browser) -> str:
    return visitor.cookies["jobserver_session"]


def test_sign_out_ends_the_session_on_the_server(guarded: ThreadServer) -> None:
    ann = browser(guarded)
    assert ann.sign_in().status == 303
    copy = Browser(guarded, dict(ann.cookies))
    assert copy.pause("a/*") == 303
    bob = browser(guarded)
    assert bob.sign_in().status == 303
    assert ann.post("/signout", {"back": "/"}).status == 303
    assert "jobserver_session" not in ann.cookies
    # The cookie the browser dropped is dead wherever a copy of it is.
    assert copy.pause("b/*") == 401
    # Another sign-in is another session, with nothing of the token in it.
    assert bob.pause("c/*") == 303
    assert session_of(bob) != session_of(copy) and TOKEN not in session_of(bob)
    assert paused(guarded) == ["a/*", "c/*"]


def test_a_sign_in_replaces_the_session_it_came_with(guarded: ThreadServer) -> None:
    ann = browser(guarded)
    ann.sign_in()
    before = Browser(guarded, dict(ann.cookies))
    assert ann.sign_in().status == 303
    assert session_of(ann) != session_of(before)
    assert before.pause("x/*") == 401 and ann.pause("y/*") == 303


def test_a_session_ends_with_its_lifetime(tmp_path: Path) -> None:
    running = start(tmp_path / "jobs.db", auth_token=TOKEN, session_seconds=1.0)
    try:
        ann = browser(running)
        signed = ann.sign_in()
        cookie = next(
            line for line in signed.headers.get_all("Set-Cookie") or []
            if line.startswith("jobserver_session=")
        )
        assert "Max-Age=1" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert ann.pause("early/*") == 303
        until(lambda: ann.pause("late/*") == 401, TIMEOUT, "the session to end")
        assert ann.pause("after/*") == 401 and "after/*" not in paused(running)
    finally:
        running.stop()


def test_a_restart_ends_every_session(tmp_path: Path) -> None:
    running = start(tmp_path / "jobs.db", auth_token=TOKEN)
    try:
        ann = browser(running)
        ann.sign_in()
        assert ann.pause("before/*") == 303
    finally:
        running.stop()
    # The same database and the same token: only the restart differs.
    again = start(tmp_path / "jobs.db", auth_token=TOKEN)
    try:
        assert Browser(again, dict(ann.cookies)).pause("after/*") == 401
        assert paused(again) == ["before/*"]
    finally:
        again.stop()


def test_wrong_sign_ins_are_slowed_down(guarded: ThreadServer) -> None:
    mallory = browser(guarded)
    # Each sign-in: when it was sent, when answered, the answer.
    tries: list[tuple[float, float, Answer]] = []

    def sign_in(token: str = TOKEN) -> Answer:
        sent = time.monotonic()
        answer = mallory.sign_in(token)
        tries.append((sent, time.monotonic(), answer))
        return answer

    # A few are answered; then the address waits.
    answers = [sign_in("guess") for _ in range(10)]
    statuses = [answer.status for answer in answers]
    assert statuses[:3] == [401] * 3 and 429 in statuses, statuses
    refused = [answer for answer in answers if answer.status == 429][-1]
    assert b"try again in" in refused.body and int(refused.headers["Retry-After"]) >= 1
    # The right token waits too, or guessing would go on through it; and
    # twenty more in a row are answered with 429, not looked at.
    right = sign_in()
    for _ in range(20):
        sign_in("guess")
    # ... those answered while the penalty surely lasted: it began when the
    # server looked at the last wrong token, after it was sent, and lasts a
    # FIRST_PENALTY_SECONDS at least. Under the whole suite on two cores
    # these tries outlasted its second (CI: a 401 among the twenty).
    looked_at = max(sent for sent, _, answer in tries[:10] if answer.status == 401)
    lasts_until = looked_at + FIRST_PENALTY_SECONDS
    within = [answer.status for _, answered, answer in tries[10:] if answered < lasts_until]
    assert set(within) <= {429}, (within, statuses)
    if right.status == 429:
        assert not mallory.cookies
    # Another address is not held back by this one's failures.
    other = browser(guarded, source="127.0.0.2")
    assert other.sign_in().status == 303 and other.pause("other/*") == 303
    # Once the wait is over, the right token works and the count starts over.
    until(lambda: mallory.sign_in().status == 303, TIMEOUT, "the penalty to end")
    assert mallory.pause("mallory/*") == 303
    assert browser(guarded).sign_in("guess").status == 401


def test_the_session_and_throttle_tables_are_bounded() -> None:
    from jobserver.web.access import FREE_FAILURES, Sessions, SignInThrottle

    now = [0.0]
    sessions = Sessions(lifetime=10.0, limit=3, clock=lambda: now[0])
    opened = [sessions.open() for _ in range(5)]
    assert len(sessions) == 3
    assert [sessions.live(s) for s in opened] == [False, False, True, True, True]
    assert not sessions.live("") and not sessions.live("x" * 10_000)
    now[0] = 9.999
    assert sessions.live(opened[-1])
    now[0] = 10.0
    assert not sessions.live(opened[-1])
    assert sessions.open() and len(sessions) == 1

    throttle = SignInThrottle(limit=100, clock=lambda: now[0])
    for i in range(10_000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 100
    # One IPv6 host holds its whole /64: it is one client.
    for i in range(FREE_FAILURES):
        throttle.failed(f"2001:db8::{i:x}")
    assert throttle.wait("2001:db8::ffff:1") > 0 and throttle.wait("2001:db8:0:1::1") == 0
    assert throttle.wait("::ffff:10.0.39.15") == 0 and throttle.wait("10.0.39.15") == 0
    # The penalty doubles and stops at its ceiling, whatever the count.
    for _ in range(1000):
        throttle.failed("192.0.2.1")
    assert 0 < throttle.wait("192.0.2.1") <= 60.0


# In a real browser: another site's page attacks, the server's own page works.


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """Chromium, told that REBOUND is 127.0.0.1."""
    with launch_chromium(
        "--no-sandbox", f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",
        WITHOUT_PRIVATE_NETWORK_ACCESS,
    ) as launched:
        yield launched


class AttackSite:
    """Another origin: an HTTP server on another port of this machine
    serving one page, `html`."""

    def __init__(self) -> None:
        self.html = ""
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = site.html.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def attack_site() -> Iterator[AttackSite]:
    site = AttackSite()
    yield site
    site.close()


ATTACK_PAGE = """<!doctype html>
<iframe name="sink"></iframe>
<form id="queue" method="post" action="{target}/queue" enctype="text/plain" target="sink">
<input name='{{"type":"form-attack","payload":{{"x":"' value='"}}}}'></form>
<form id="pause" method="post" action="{target}/actions/pause" target="sink">
<input name="name" value="*"><input name="back" value="/"></form>
<script>
window.attack = async (form) => {{
  const sink = document.querySelector("iframe");
  const loaded = new Promise((done) => sink.addEventListener("load", done, {{once: true}}));
  document.getElementById(form).submit();
  await loaded;
}};
window.post = async (path, body) => {{
  await fetch("{target}" + path, {{
    method: "POST", mode: "no-cors", body,
    headers: {{"Content-Type": "text/plain"}},
  }});
}};
</script>
"""


@pytest.mark.parametrize("site_host", ["127.0.0.1", "localhost"])
def test_in_a_browser_another_sites_page_changes_nothing(
    chromium: Any, open_server: ThreadServer, attack_site: AttackSite, site_host: str,
    tmp_path: Path,
) -> None:
    target = f"http://{own(open_server)}"
    attack_site.html = ATTACK_PAGE.format(target=target)
    page = chromium.new_page()
    try:
        page.goto(f"http://{site_host}:{attack_site.port}/")
        with page.expect_response(f"{target}/api/CreateJob") as created:
            page.evaluate("post('/api/CreateJob', JSON.stringify({name: 'fetch-attack'}))")
        assert created.value.status == 403
        # JSON, as the API wants it, needs the server's leave first (a CORS
        # preflight), which it never gives: the POST is not even sent.
        refused = page.evaluate(
            """(target) => fetch(target + "/api/CreateJob", {
                method: "POST", body: '{"name": "cors-attack"}',
                headers: {"Content-Type": "application/json"},
            }).then(() => "sent", String)""",
            target,
        )
        assert "Failed to fetch" in refused
        with page.expect_response(f"{target}/api/SetLimit") as limited:
            page.evaluate("post('/api/SetLimit', JSON.stringify({name: '*', max: 1}))")
        assert limited.value.status == 403
        copy = tmp_path / "stolen.db"
        with page.expect_response(f"{target}/api/Backup") as backed_up:
            page.evaluate(f"post('/api/Backup', JSON.stringify({{path: {str(copy)!r}}}))")
        assert backed_up.value.status == 403 and not copy.exists()
        with page.expect_response(f"{target}/queue") as queued:
            page.evaluate("post('/queue', JSON.stringify({type: 'fetch-attack', payload: {}}))")
        assert queued.value.status == 403
        with page.expect_response(f"{target}/queue") as form_queued:
            page.evaluate("attack('queue')")
        assert form_queued.value.status == 403
        with page.expect_response(f"{target}/actions/pause") as form_paused:
            page.evaluate("attack('pause')")
        assert form_paused.value.status == 403
    finally:
        page.close()
    assert job_names(open_server) == [] and paused(open_server) == []
    with Client(open_server.port) as client:
        assert client.request("Status").json["limits"] == {}


def test_in_a_browser_a_signed_in_person_is_not_acted_for_by_another_page(
    chromium: Any, guarded: ThreadServer, attack_site: AttackSite
) -> None:
    """A page on another port of this host is same-site: the browser sends
    the SameSite=Strict cookie with its form. Origin and Sec-Fetch-Site
    still give it away."""
    from playwright.sync_api import expect

    target = f"http://{own(guarded)}"
    attack_site.html = ATTACK_PAGE.format(target=target)
    context = chromium.new_context()
    try:
        page = context.new_page()
        page.goto(f"{target}/")
        page.get_by_label("auth token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".flash.ok")).to_have_text("Signed in.")
        # The dashboard's own form acts.
        page.locator('form[action="/actions/pause"] input[name="name"]').fill("mine/*")
        page.locator('form[action="/actions/pause"] button').click()
        expect(page.locator(".flash.ok")).to_have_text("Paused mine/*.")
        attack = context.new_page()
        attack.goto(f"http://127.0.0.1:{attack_site.port}/")
        with attack.expect_response(f"{target}/actions/pause") as form_paused:
            attack.evaluate("attack('pause')")
        assert form_paused.value.status == 403
        assert form_paused.value.request.header_value("cookie") is not None
    finally:
        context.close()
    assert paused(guarded) == ["mine/*"]


REBINDING_PAGE = """<!doctype html>
<script>
window.results = (async () => {
  const created = await fetch("/api/CreateJob", {
    method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({name: "rebinding-attack"}),
  });
  const dashboard = await fetch("/");
  const metrics = await fetch("/metrics");
  return [
    [created.status, await created.text()],
    [dashboard.status, await dashboard.text()],
    [metrics.status, await metrics.text()],
  ];
})();
</script>
"""


def test_in_a_browser_a_rebinding_page_can_neither_act_nor_read(
    chromium: Any, any_server: ThreadServer
) -> None:
    """The page comes from REBOUND:PORT (as from the attacker's server),
    then REBOUND resolves to 127.0.0.1: the page's requests to its own
    origin reach this server, same-origin in the browser's eyes."""
    with Client(any_server.port) as client:
        client.request("CreateJob", wire_auth(any_server), name="secret/job")
    origin = f"http://{REBOUND}:{any_server.server.http_port}"
    page = chromium.new_page()
    try:
        page.route(
            f"{origin}/attack",
            lambda route: route.fulfill(body=REBINDING_PAGE, content_type="text/html"),
        )
        page.goto(f"{origin}/attack")
        results = page.evaluate("window.results")
    finally:
        page.close()
    assert [status for status, _ in results] == [421, 421, 421], results
    assert all("secret/job" not in text for _, text in results)
    assert job_names(any_server) == ["secret/job"]
