"""The dashboard (GET / and the pages and forms under it), over real HTTP
to a real server whose jobs are set up and checked through the wire
protocol; and once end to end in headless Chromium."""

from __future__ import annotations

import http.client
import json
import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.web.dashboard import REFRESH_SECONDS
from jobserver.web.forms import FLASH_COOKIE
from tls_certs import tls_server
from wire import Client

TIMEOUT = 10.0
TOKEN = "s3cret-token"
XSS = "<script>alert(1)</script>"


def start(db: Path | str, **options: Any) -> ThreadServer:
    running = ThreadServer(db, http_port=0, **options)
    until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
    return running


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = start(tmp_path / "jobs.db")
    yield running
    running.stop()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[ThreadServer]:
    """A server with an auth token."""
    running = start(tmp_path / "jobs.db", auth_token=TOKEN)
    yield running
    running.stop()


@dataclass
class Page:
    status: int
    headers: http.client.HTTPMessage
    text: str

    @property
    def location(self) -> str | None:
        return self.headers.get("Location")


@dataclass
class Visitor:
    """A browser's share of HTTP: keeps cookies, follows no redirects."""

    server: ThreadServer
    cookies: dict[str, str] = field(default_factory=dict)
    context: ssl.SSLContext | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server.http_port}"

    def get(self, path: str, **headers: str) -> Page:
        return self._send("GET", path, None, headers)

    def post(self, path: str, fields: dict[str, Any], **headers: str) -> Page:
        body = urlencode(fields).encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded", **headers}
        return self._send("POST", path, body, headers)

    def act(self, action: str, **fields: Any) -> Page:
        """POST an action as the dashboard's own form does (same Origin)."""
        return self.post(f"/actions/{action}", fields, Origin=f"http://{self.host}")

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Page:
        if self.context is not None:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.server.server.http_port, timeout=TIMEOUT, context=self.context
            )
        else:
            connection = http.client.HTTPConnection(
                "127.0.0.1", self.server.server.http_port, timeout=TIMEOUT
            )
        if self.cookies:
            headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()), **headers}
        try:
            connection.request(method, path, body, headers)
            reply = connection.getresponse()
            page = Page(reply.status, reply.headers, reply.read().decode())
        finally:
            connection.close()
        for line in page.headers.get_all("Set-Cookie") or []:
            for name, morsel in SimpleCookie(line).items():
                if morsel["max-age"] == "0" or morsel.value == "":
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return page


def flash_of(visitor: Visitor, redirect: Page) -> str:
    """The page a redirect leads to, once: its message."""
    assert redirect.status == 303, (redirect.status, redirect.text)
    assert redirect.location is not None
    page = visitor.get(redirect.location)
    assert page.status == 200, page.text
    found = re.search(r'<p class="flash (ok|error)" role="status">(.*?)</p>', page.text, re.S)
    assert found is not None, "no message on the page"
    # Shown once: the next page has none.
    assert 'class="flash' not in visitor.get(redirect.location).text
    return f"{found.group(1)}: {found.group(2)}"


def failed_job(
    client: Client, name: str, error: str, token: str | None = None, **params: Any
) -> int:
    """A new job, taken and failed with `error`."""
    auth: dict[str, Any] = {"authToken": token} if token else {}
    job_id = create(client, name, **auth, **params)
    taken = ok(client.request("GetJob", name=name, **auth)).json["jobID"]
    assert taken == job_id, "a job of that name was there before"
    ok(client.request("FailJob", jobID=job_id, error=error, **auth))
    return job_id


def query_job(client: Client, job_id: int) -> Any:
    return ok(client.request("QueryJob", jobID=job_id)).json


def test_the_front_page_shows_status_queues_failed_jobs_limits_and_pauses(
    server: ThreadServer,
) -> None:
    with server.client() as client:
        for name in ["email/send", "email/send", "email/bounce", "thumbs/make"]:
            create(client, name)
        create(client, "report/daily", firstRun="2999-01-01")
        failing = failed_job(client, "email/verify", "SMTP server said 451")
        ok(client.request("SetLimit", name="thumbs/*", max=4))
        ok(client.request("GetJob", name="thumbs/make"))
        ok(client.request("PauseJobs", name="report/*"))
    visitor = Visitor(server)
    page = visitor.get("/")
    assert page.status == 200
    assert page.headers["Content-Type"].startswith("text/html")
    text = page.text
    # Status (report/daily is QUEUED too), and queues: email has 3 QUEUED
    # and 1 FAILED.
    assert re.search(r"<dt>QUEUED</dt><dd>4</dd>", text)
    assert re.search(r"<dt>FAILED</dt><dd>1</dd>", text)
    assert re.search(r"<dt>version</dt><dd>\d", text)
    email = re.search(r'<td><a href="/queues/email">email</a></td>(.*?)</tr>', text, re.S)
    assert email is not None
    assert [int(n) for n in re.findall(r">(\d+)<", email.group(1))] == [3, 1, 4]
    # The oldest ready age of email, none for report (due in 2999).
    report = re.search(r'<td><a href="/queues/report">report</a>(.*?)</tr>', text, re.S)
    assert report is not None and "—" in report.group(1)
    # The failed job with its error and buttons; the limit and the pause.
    assert f'<a href="/jobs/{failing}">{failing}</a>' in text
    assert "SMTP server said 451" in text
    assert 'action="/actions/requeue"' in text and 'action="/actions/delete"' in text
    assert re.search(r"<td>thumbs/\*</td>\s*<td[^>]*>1</td>\s*<td[^>]*>4</td>", text)
    assert "<code>report/*</code>" in text and 'action="/actions/resume"' in text
    # It refreshes itself: the live part comes from /live.
    assert f'id="live" data-refresh="{REFRESH_SECONDS}"' in text
    assert '<script src="/static/dashboard.js" defer></script>' in text
    live = visitor.get("/live")
    assert live.status == 200 and "<html" not in live.text
    assert '<a href="/queues/email">email</a></td>' in live.text
    with server.client() as client:
        create(client, "audio/encode")
    assert '<a href="/queues/audio">audio</a></td>' in visitor.get("/live").text
    script = visitor.get("/static/dashboard.js")
    assert script.status == 200 and 'fetch("/live"' in script.text
    assert script.headers["Content-Type"].startswith("text/javascript")
    assert visitor.get("/static/dashboard.css").status == 200
    assert visitor.get("/static/nothing.js").status == 404


def test_names_data_and_errors_are_escaped(server: ThreadServer) -> None:
    data = json.dumps({"note": "</pre><script>alert(2)</script>", "<b>key</b>": 1})
    with server.client() as client:
        job_id = failed_job(client, XSS, '<img src=x onerror="alert(3)">', data=data)
        ok(client.request("PauseJobs", name="<i>p</i>*"))
        ok(client.request("SetLimit", name="<u>l</u>*", max=1))
    visitor = Visitor(server)
    pages = [
        visitor.get("/"), visitor.get(f"/jobs/{job_id}"),
        visitor.get("/jobs?" + urlencode({"name": "<script>*"})),
    ]
    for page in pages:
        assert page.status == 200
        for raw in ["<script>alert", "<img src=x", "<b>key", "<i>p</i>", "<u>l</u>"]:
            assert raw not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        # And no script but the dashboard's own could run.
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert "&lt;img src=x onerror=&#34;alert(3)&#34;&gt;" in pages[0].text
    assert "&lt;/pre&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in pages[1].text
    # A message built from what a visitor sent is escaped as well.
    page = visitor.get("/jobs/" + "%3Cscript%3Ealert(4)%3C%2Fscript%3E")
    assert page.status == 404 and "<script>alert(4)" not in page.text


def test_a_jobs_page_shows_its_state_times_attempts_lease_and_family(server: ThreadServer) -> None:
    with server.client() as client:
        parent = create(client, "split", data='{"files":["a","b"]}', retryAfter="+1 HOUR")
        lease = ok(client.request("GetJob", name="split", includeLeaseID="true")).json["leaseID"]
        child = create(client, "split/part", parentJobID=parent)
        retried = create(client, "mail", maxAttempts=3, retryDelay=60)
        ok(client.request("GetJob", name="mail"))
        ok(client.request("FailJob", jobID=retried, error="451 try later"))
        waiting = create(client, "pay")
        ok(client.request("GetJob", name="pay"))
        ok(client.request("AwaitReply", jobID=waiting, key="order-77"))
    visitor = Visitor(server)
    page = visitor.get(f"/jobs/{parent}").text
    assert f"Job {parent}" in page and 'class="state runqueued">RUNQUEUED' in page
    assert "<code>+1 HOUR</code>; ends at the next run" in page and lease in page
    assert f'data-confirm="Job {parent} is RUNQUEUED: requeue it anyway?' in page
    assert "&#34;files&#34;: [\n    &#34;a&#34;," in page  # data, pretty
    assert f'<a href="/jobs/{child}">{child}</a>' in page and "split/part" in page
    # A time is a <time> element in UTC (the script shows it in the viewer's
    # zone), with how long ago.
    created = re.search(
        r'created</th><td><time datetime="(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)" '
        r'title="([^"]+) UTC">\2</time> \(', page
    )
    assert created and created[1].replace("T", " ").startswith(created[2])
    page = visitor.get(f"/jobs/{child}").text
    assert f'<a href="/jobs/{parent}">{parent}</a>' in page and "PAUSED" in page
    assert 'action="/actions/cancel"' not in page  # a PAUSED child cannot be cancelled
    page = visitor.get(f"/jobs/{retried}").text
    assert "1 of 3: exponential backoff from 60 s, at most 3600 s" in page
    assert "451 try later" in page
    assert 'action="/actions/delete"' in page and 'action="/actions/requeue"' in page
    page = visitor.get(f"/jobs/{waiting}").text
    assert "<code>order-77</code>; deadline" in page and "WAITING" in page


@pytest.mark.parametrize(
    "text",
    ["abc", "0", "-1", "007", "1.5", "9" * 40, "9223372036854775808", "%00", "%FF", "1%0A2"],
)
def test_what_is_not_a_jobID_is_a_404_page(server: ThreadServer, text: str) -> None:
    visitor = Visitor(server)
    page = visitor.get(f"/jobs/{text}")
    assert page.status == 404 and "is not a jobID" in page.text
    assert visitor.get("/jobs/9223372036854775807").status == 404
    # The server goes on serving both sides.
    assert visitor.get("/").status == 200
    with server.client() as client:
        assert client.request("Ping").status == "200 OK"


@pytest.mark.backends
def test_search_by_name_pattern_and_by_jobID(backend: str, db: Path | str) -> None:
    running = start(db)
    try:
        with running.client() as client:
            email = [create(client, "email/send") for _ in range(3)]
            create(client, "thumbs/make")
            done = failed_job(client, "email/old", "gone")
        visitor = Visitor(running)
        page = visitor.get("/jobs?" + urlencode({"name": "email/*"}))
        assert page.status == 200
        listed = [int(n) for n in re.findall(r'<a href="/jobs/(\d+)">', page.text)]
        assert listed == [done, *reversed(email)]  # newest first
        assert "FAILED" in page.text and "thumbs" not in page.text
        exact = visitor.get("/jobs?" + urlencode({"name": "thumbs/make"})).text
        assert len(re.findall(r'<a href="/jobs/\d+">', exact)) == 1
        jump = visitor.get(f"/jobs?id={email[1]}")
        assert (jump.status, jump.location) == (303, f"/jobs/{email[1]}")
        assert visitor.get("/jobs?id=..%2F..%2Fx").location == "/jobs/..%2F..%2Fx"
        assert visitor.get("/jobs").location == "/"
        bad = visitor.get("/jobs?" + urlencode({"name": "a\nb"}))
        assert bad.status == 400 and "Not a name pattern" in bad.text
    finally:
        running.stop()


def test_actions_do_what_they_say_and_come_back_with_a_message(server: ThreadServer) -> None:
    with server.client() as client:
        failed = failed_job(client, "email/send", "boom")
        doomed = failed_job(client, "email/send", "boom")
        parent = create(client, "split")
        ok(client.request("GetJob", name="split"))
        child = create(client, "split/part", parentJobID=parent)
        ok(client.request("FinishJob", jobID=parent))  # the child is QUEUED now
    visitor = Visitor(server)
    reply = visitor.act("requeue", jobID=failed, back=f"/jobs/{failed}")
    assert reply.location == f"/jobs/{failed}"
    assert flash_of(visitor, reply) == f"ok: Job {failed} requeued: QUEUED, due now."
    assert flash_of(visitor, visitor.act("delete", jobID=doomed, back="/")) == (
        f"ok: Job {doomed} deleted."
    )
    assert flash_of(visitor, visitor.act("cancel", jobID=child, back="/")) == (
        f"ok: Job {child} cancelled."
    )
    assert flash_of(visitor, visitor.act("pause", name="email/*", back="/")) == (
        "ok: Paused email/*."
    )
    assert flash_of(visitor, visitor.act("limit", name="split/*", max="7", back="/")) == (
        "ok: Limit on split/* set to 7."
    )
    with server.client() as client:
        assert query_job(client, failed)["state"] == "QUEUED"
        assert client.request("QueryJob", jobID=doomed).status == "404 No job with this jobID"
        assert query_job(client, child)["state"] == "CANCELLED"
        status = ok(client.request("Status")).json
        assert status["paused"] == ["email/*"]
        assert status["limits"] == {"split/*": {"max": 7, "running": 0}}
    assert flash_of(visitor, visitor.act("resume", name="email/*", back="/")) == (
        "ok: Resumed email/*."
    )
    assert flash_of(visitor, visitor.act("limit", name="split/*", max="0", back="/")) == (
        "ok: Limit on split/* removed."
    )
    with server.client() as client:
        status = ok(client.request("Status")).json
        assert (status["paused"], status["limits"]) == ([], {})


def test_a_running_job_is_cancelled_from_its_page(server: ThreadServer) -> None:
    """The "Cancel run" button (CancelJob with running: true, protocol.md
    14.26): the cancel is pending until the worker's next report."""
    with server.client() as client:
        running = create(client, "busy")
        ok(client.request("GetJob", name="busy"))
    visitor = Visitor(server)
    page = visitor.get(f"/jobs/{running}")
    assert "Cancel run" in page.text and "pending" not in page.text
    assert flash_of(visitor, visitor.act("cancel-running", jobID=running, back="/")) == (
        f"ok: Job {running} will be cancelled: its worker is told at its next report."
    )
    page = visitor.get(f"/jobs/{running}")
    assert "Cancel run" not in page.text and "pending" in page.text
    with server.client() as client:
        assert client.request("TouchJob", jobID=running).status == "410 Job cancelled"
        assert query_job(client, running)["state"] == "CANCELLED"
    assert "Cancel run" not in visitor.get(f"/jobs/{running}").text


def test_a_refused_action_is_shown_to_the_person(server: ThreadServer) -> None:
    with server.client() as client:
        running = create(client, "busy")
        ok(client.request("GetJob", name="busy"))
        lone = create(client, "lone")
    visitor = Visitor(server)
    cases: list[tuple[tuple[str, dict[str, Any]], str]] = [
        (("delete", {"jobID": running}),
         f"error: Job {running} was not deleted: 405 Can&#39;t delete a RUNNING job"),
        (("requeue", {"jobID": 999}),
         "error: Job 999 was not requeued: 404 No job with this jobID"),
        (("cancel", {"jobID": lone}),
         f"error: Job {lone} was not cancelled: 404 Invalid jobID - "
         "Cannot cancel a job without a parent"),
        (("delete", {"jobID": "abc"}), "error: Nothing was done: &#39;abc&#39; is not a jobID."),
        (("delete", {"jobID": "9" * 30}), "error: Nothing was done: &#39;" + "9" * 30
         + "&#39; is not a jobID."),
        (("pause", {}), "error: Nothing was done: name is missing."),
        (("pause", {"name": "x" * 300}), "error: " + "x" * 300 + " was not paused: "
         "402 Name too large (255 bytes at most)"),
        (("limit", {"name": "a*", "max": "-1"}),
         "error: The limit on a* was not set: 402 Malformed max"),
    ]
    for (action, fields), message in cases:
        assert flash_of(visitor, visitor.act(action, back="/", **fields)) == message
    with server.client() as client:
        assert query_job(client, running)["state"] == "RUNNING"
    assert visitor.act("explode", jobID=1).status == 404
    huge = visitor.post("/actions/pause", {"name": "x" * 20000, "back": "/"})
    assert huge.status == 400
    binary = visitor._send(
        "POST", "/actions/pause", b"name=%FF%FE&back=/", {"Content-Type": "text/plain"}
    )
    assert binary.status == 400
    assert visitor.get("/").status == 200


def test_redirects_stay_on_this_server(server: ThreadServer) -> None:
    visitor = Visitor(server)
    for back, location in [
        ("/jobs/1", "/jobs/1"), ("//evil.example/", "/"), ("/\\evil.example", "/"),
        ("https://evil.example/", "/"), ("/\t/evil.example", "/"), ("", "/"),
    ]:
        assert visitor.act("pause", name="x", back=back).location == location


def test_with_a_token_the_pages_are_read_only_until_one_signs_in(guarded: ThreadServer) -> None:
    with Client(guarded.port) as client:
        job_id = failed_job(client, "mail", "boom", TOKEN)
    visitor = Visitor(guarded)
    page = visitor.get("/").text
    assert f'<a href="/jobs/{job_id}">' in page and 'action="/signin"' in page
    assert "/actions/" not in page and "/actions/" not in visitor.get(f"/jobs/{job_id}").text
    refused = visitor.act("pause", name="*", back="/")
    assert refused.status == 401 and "Sign in to act" in refused.text
    origin = {"Origin": f"http://{visitor.host}"}
    wrong = visitor.post("/signin", {"token": "guess", "back": "/"}, **origin)
    assert wrong.status == 401 and not visitor.cookies
    signed = visitor.post("/signin", {"token": TOKEN, "back": f"/jobs/{job_id}"}, **origin)
    assert (signed.status, signed.location) == (303, f"/jobs/{job_id}")
    cookie = next(
        line for line in signed.headers.get_all("Set-Cookie") or []
        if line.startswith("jobserver_session=")
    )
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie
    # The cookie holds no token.
    assert TOKEN not in cookie
    page = visitor.get("/").text
    assert 'action="/actions/requeue"' in page and 'action="/signout"' in page
    assert flash_of(visitor, visitor.act("requeue", jobID=job_id, back="/")).startswith("ok:")
    # A forged cookie, a bearer header.
    forged = Visitor(guarded, {"jobserver_session": "0" * 64})
    assert forged.act("pause", name="*", back="/").status == 401
    bearer = Visitor(guarded)
    acted = bearer.post("/actions/pause", {"name": "x/*"}, Authorization=f"Bearer {TOKEN}")
    assert acted.status == 303
    # Signing out ends it.
    visitor.post("/signout", {"back": "/"}, **origin)
    assert "jobserver_session" not in visitor.cookies
    assert visitor.act("pause", name="*", back="/").status == 401
    with Client(guarded.port) as client:
        status = ok(client.request("Status", authToken=TOKEN)).json
        assert status["paused"] == ["x/*"]
        assert query_job_with(client, job_id)["state"] == "QUEUED"


def query_job_with(client: Client, job_id: int) -> Any:
    return ok(client.request("QueryJob", jobID=job_id, authToken=TOKEN)).json


def test_a_form_posted_from_another_site_is_refused(server: ThreadServer) -> None:
    visitor = Visitor(server)
    for origin in ["http://evil.example", "null", "http://[::1", f"https://{visitor.host}.evil"]:
        page = visitor.post("/actions/pause", {"name": "*", "back": "/"}, Origin=origin)
        assert page.status == 403, origin
        assert visitor.post("/signin", {"token": "x"}, Origin=origin).status == 403
    with server.client() as client:
        assert ok(client.request("Status")).json["paused"] == []
    same = visitor.post("/actions/pause", {"name": "*"}, Origin=f"http://{visitor.host}")
    assert same.status == 303


def test_over_tls_the_cookies_are_secure(tmp_path: Path) -> None:
    with tls_server(tmp_path, "127.0.0.1", http_port=0, auth_token=TOKEN) as (running, files):
        until(lambda: running.server.http_port, TIMEOUT, "the HTTP side to listen")
        visitor = Visitor(running, context=ssl.create_default_context(cafile=str(files.ca)))
        signed = visitor.post(
            "/signin", {"token": TOKEN}, Origin=f"https://{visitor.host}"
        )
        assert signed.status == 303
        cookies = signed.headers.get_all("Set-Cookie") or []
        assert cookies and all("; Secure" in line for line in cookies)


def test_a_database_that_cannot_be_read_apart_is_said_so() -> None:
    # A memory database: nothing but the writer can read it.
    running = start(Path(":memory:"))
    try:
        with running.client() as client:
            job_id = create(client, "x")
        visitor = Visitor(running)
        page = visitor.get("/")
        assert page.status == 200 and "Queues: 503 Database unavailable" in page.text
        assert visitor.get(f"/jobs/{job_id}").status == 200
        search = visitor.get("/jobs?name=x")
        assert search.status == 503 and "cannot be searched" in search.text
    finally:
        running.stop()


def test_the_flash_cookie_cannot_carry_markup(server: ThreadServer) -> None:
    visitor = Visitor(server, {FLASH_COOKIE: "error%3A%3Cscript%3Ealert(5)%3C%2Fscript%3E"})
    page = visitor.get("/").text
    assert "&lt;script&gt;alert(5)" in page and "<script>alert(5)" not in page


# End to end in headless Chromium (helpers.chromium).


def sample_jobs(client: Client) -> int:
    """A queue at work, as a screenshot should show one; the ID of a failed job."""
    # Due a few minutes ago: the queue's workers are behind.
    due = (datetime.now(UTC) - timedelta(minutes=7)).strftime("%Y-%m-%d %H:%M:%S")
    jobs = [
        {"name": "email/send", "data": {"to": f"user{i}@example.com"}, "firstRun": due}
        for i in range(6)
    ]
    jobs += [{"name": "thumbs/make", "data": {"image": i}} for i in range(3)]
    # Paused on purpose as long: not drawn as late.
    jobs += [{"name": "report/daily", "repeat": "DAILY", "firstRun": due}]
    jobs += [{"name": "webhook/deliver"}]
    ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
    ok(client.request("SetLimit", name="thumbs/*", max=2))
    # The limit full: drawn as full.
    ok(client.request("GetJobs", name="thumbs/make", numResults=2))
    ok(client.request("GetJob", name="email/send"))
    ok(client.request("PauseJobs", name="report/*"))
    failed_job(client, "webhook/retry", "HTTP 502 from https://hooks.example.com/orders")
    return failed_job(
        client, "email/bounce", "SMTP 451 4.7.1 try again later", data='{"to":"ann@example.com"}'
    )


def times_shown_in_the_viewers_zone(page: Any, shown: Any) -> None:
    """A stored time reads on the viewer's wall clock (New York's: 5 hours
    behind UTC in winter, 4 in summer), its UTC value on hover."""
    from playwright.sync_api import expect

    expect(shown).to_have_text(re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d E[SD]T"))
    utc = shown.get_attribute("title") or ""
    assert utc.endswith(" UTC")
    stored = datetime.fromisoformat(utc.removesuffix(" UTC")).replace(tzinfo=UTC)
    local = datetime.strptime(shown.inner_text()[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    assert stored.replace(microsecond=0) - local in (timedelta(hours=5), timedelta(hours=4))


def test_in_a_browser_a_failed_job_is_requeued_with_a_click(
    browser: Any, server: ThreadServer, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    with server.client() as client:
        job_id = sample_jobs(client)
        weekdays = create(
            client, "report/weekday", repeat="CRON 0 9 * * MON-FRI", timeZone="Europe/Paris"
        )
    # A viewer far from UTC: times are shown in their zone.
    page = browser.new_page(viewport={"width": 1280, "height": 900}, timezone_id="America/New_York")
    try:
        # The page's clock is the test's: its refresh runs when told to.
        page.clock.install()
        page.goto(f"http://127.0.0.1:{server.server.http_port}/")
        row = page.locator(f'#failed tr:has(a[href="/jobs/{job_id}"])')
        expect(row).to_contain_text("SMTP 451 4.7.1 try again later")
        times_shown_in_the_viewers_zone(page, row.locator("time"))
        full = page.locator("#limits tr.full")
        expect(full).to_contain_text("thumbs/* full")
        assert full.locator("meter").evaluate("m => m.value >= m.high && m.optimum < m.low")
        late = re.compile(r"\blate\b")
        email = page.locator('#live tbody tr:has(td > a:text-is("email"))')
        expect(email.locator("td").last).to_have_class(late)
        report = page.locator('#live tbody tr:has(td:has-text("report"))')
        expect(report.locator("td").first).to_contain_text("paused: 1")
        expect(report.locator("td").last).not_to_have_class(late)
        expect(report.locator("td").last).to_have_text("—")
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
        # It refreshes by itself: a new queue shows up without a reload.
        with server.client() as client:
            create(client, "audio/encode")
        page.clock.run_for(REFRESH_SECONDS * 1000 + 100)
        expect(page.locator("#live")).to_contain_text("audio")
        row.get_by_role("button", name="Requeue").click()
        expect(page.locator(".flash.ok")).to_have_text(
            f"Job {job_id} requeued: QUEUED, due now."
        )
        expect(row).to_have_count(0)
        page.goto(f"http://127.0.0.1:{server.server.http_port}/jobs/{job_id}")
        expect(page.locator("h1 .state")).to_have_text("QUEUED")
        worker_errors_read_as_text(page, server)
        # A CRON job's page lists its next runs, in its zone and in UTC.
        page.goto(f"http://127.0.0.1:{server.server.http_port}/jobs/{weekdays}")
        runs = page.locator("ol.next-runs li")
        expect(runs).to_have_count(5)
        expect(runs.first).to_have_text(re.compile(
            r"(Mon|Tue|Wed|Thu|Fri) \d{4}-\d\d-\d\d 09:00 CES?T \(\d{4}-\d\d-\d\d 0[78]:00:00 UTC\)"
        ))
    finally:
        page.close()
    with server.client() as client:
        assert query_job(client, job_id)["state"] == "QUEUED"


def worker_errors_read_as_text(page: Any, server: ThreadServer) -> None:
    """A worker's error (the worker manager's JSON) reads as its exit status
    and the end of its stderr, the raw JSON a click away; what stderr holds
    is text, never markup."""
    from playwright.sync_api import expect

    frames = [f"  frame {i}" for i in range(8)]
    output = ["Traceback (most recent call last):", *frames, XSS, "OSError: disk full"]
    raw = json.dumps({"exitStatus": 1, "stderr": "\n".join(output) + "\n"})
    with server.client() as client:
        # A header value's backslashes are escaped, as the client library does.
        crashed = failed_job(client, "video/crash", raw.replace("\\", "\\\\"))
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    page.goto(f"http://127.0.0.1:{server.server.http_port}/")
    row = page.locator(f'#failed tr:has(a[href="/jobs/{crashed}"])')
    expect(row.locator("pre")).to_have_text(
        "\n".join(["exit status 1", "... 6 earlier lines", *output[-5:]])
    )
    expect(row.locator("details code")).not_to_be_visible()
    row.locator("details summary").click()
    expect(row.locator("details code")).to_have_text(raw)
    page.goto(f"http://127.0.0.1:{server.server.http_port}/jobs/{crashed}")
    expect(page.locator("pre.error-text")).to_have_text("\n".join(["exit status 1", *output]))
    assert page.locator("script").count() == 1  # the dashboard's own
    assert dialogs == []


def test_a_job_that_is_gone_shows_its_kept_outcome(server: ThreadServer) -> None:
    with server.client() as client:
        job_id = create(client, "thumb/make", data={"in": 1})
        ok(client.request("GetJob", name="thumb/make"))
        ok(client.request("FailJob", jobID=job_id, error="no space left"))
        ok(client.request("DeleteJob", jobID=job_id))
        finished = create(client, "thumb/make")
        ok(client.request("GetJob", name="thumb/make"))
        ok(client.request("FinishJob", jobID=finished, data={"png": "7.png"}))
    visitor = Visitor(server)
    page = visitor.get(f"/jobs/{finished}")
    assert page.status == 200 and 'class="state finished">FINISHED' in page.text
    assert "no longer stored" in page.text and "&#34;png&#34;: &#34;7.png&#34;" in page.text
    # A FAILED job deleted later ended FAILED: its outcome says so.
    page = visitor.get(f"/jobs/{job_id}")
    assert 'class="state failed">FAILED' in page.text and "no space left" in page.text
    assert visitor.get("/jobs/999999").status == 404
