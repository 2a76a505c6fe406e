"""The dashboard's "Running now" and "Idle workers" (web/running_pages.py):
jobs held by real workers on real sockets, the pages over real HTTP, and
once in headless Chromium, on every backend."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, start

from conformance_helpers import fmt, force, get_job, utcnow
from harness import ThreadServer
from helpers import create, ok, until
from wire import Client, encode

pytestmark = pytest.mark.backends

TIMEOUT = 10.0
XSS = "<script>alert(1)</script>"


@pytest.fixture
def web(db: Path | str) -> Iterator[ThreadServer]:
    running = start(db)
    yield running
    running.stop()


def address(client: Client) -> str:
    host, port = client.sock.getsockname()[:2]
    return f"{host}:{port}"


def rows_of(page: str) -> list[str]:
    """The running table's rows, in order."""
    table = page.split('<table class="running">', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr[ >].*?</tr>", table.split("<tbody>", 1)[1], re.S)


def busy(server: ThreadServer, db: Path | str, worker: Client, idle: Client) -> tuple[int, int]:
    """Two jobs held by `worker`, the first running for an hour; `idle`
    waiting for email/*. Their jobIDs, the oldest first."""
    with server.client() as admin:
        oldest = create(admin, f"report/{XSS}")
        newest = create(admin, "thumbs/make")
    get_job(worker, f"report/{XSS}")
    get_job(worker, "thumbs/make")
    hour_ago = fmt(utcnow() - timedelta(hours=1))
    force(db, "UPDATE jobs SET lastRun = ? WHERE jobID = ?", (hour_ago, oldest))
    idle.send(encode("GetJob", {"name": "email/*", "Connection": "wait", "timeout": 20000}))
    with server.client() as admin:
        until(lambda: ok(admin.request("Status")).json["waitingGetJobs"] == 1, TIMEOUT, "wait")
    return oldest, newest


def test_the_running_jobs_show_their_worker_the_oldest_highlighted(web, db):
    visitor = Visitor(web)
    with web.client() as worker, web.client() as idle:
        oldest, newest = busy(web, db, worker, idle)
        page = visitor.get("/").text
        assert "Running now" in page
        rows = rows_of(page)
        assert len(rows) == 2
        first, second = rows
        assert f'href="/jobs/{oldest}"' in first and 'class="oldest"' in first
        assert f'href="/jobs/{newest}"' in second and "oldest" not in second
        assert address(worker) in first and address(worker) in second
        assert f"127.0.0.1:{web.port}" in first
        # A job's name is anyone's text: escaped.
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in first and XSS not in page
        assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ">', first)
        assert "60 min" in first or "61 min" in first
        # Idle workers: the pattern, how many wait for it, and who.
        idle_table = page.split('<table class="waiting">', 1)[1].split("</table>", 1)[0]
        assert "email/*" in idle_table and address(idle) in idle_table
        assert '<td class="number">1</td>' in idle_table
        # Newest first, on the page and in its refresh; the oldest stays marked.
        for path in ("/?running=newest", "/live?running=newest"):
            flipped = rows_of(visitor.get(path).text)
            assert f'href="/jobs/{newest}"' in flipped[0]
            assert f'href="/jobs/{oldest}"' in flipped[1] and 'class="oldest"' in flipped[1]
        # A job's page says who took it.
        job_page = visitor.get(f"/jobs/{newest}").text
        assert f"<code>{address(worker)}</code> on <code>127.0.0.1:{web.port}</code>" in job_page
        # An order it does not know is the default.
        assert f'href="/jobs/{oldest}"' in rows_of(visitor.get("/live?running=x%00").text)[0]
        with web.client() as admin:
            create(admin, "email/x")
        assert ok(idle.read_reply()).code == 200


def test_nothing_running_and_nobody_waiting_say_so(web):
    page = Visitor(web).get("/live").text
    assert "Nothing is running." in page
    assert "No GetJob is waiting on this server." in page


def test_in_a_browser_the_running_list_shows_a_job_a_real_worker_holds(
    browser: Any, web: ThreadServer, db: Path | str, artifacts: Path, backend: str
) -> None:
    from playwright.sync_api import expect

    from jobserver.web.dashboard import REFRESH_SECONDS

    with web.client() as worker, web.client() as idle:
        oldest, newest = busy(web, db, worker, idle)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.clock.install()
            page.goto(f"http://127.0.0.1:{web.server.http_port}/")
            marked = page.locator("#live table.running tr.oldest")
            expect(marked).to_contain_text(address(worker))
            expect(marked.locator(f'a[href="/jobs/{oldest}"]')).to_have_count(1)
            expect(page.locator("#live table.waiting")).to_contain_text(address(idle))
            if backend == "sqlite":
                page.screenshot(path=str(artifacts / "dashboard-running.png"), full_page=True)
            page.locator("a.running-order").click()
            first = page.locator("#live table.running tbody tr").first
            expect(first.locator(f'a[href="/jobs/{newest}"]')).to_have_count(1)
            # The refresh keeps the chosen order, and shows a new hand-out.
            with web.client() as admin:
                latest = create(admin, "audio/encode")
            get_job(worker, "audio/encode")
            page.clock.run_for(REFRESH_SECONDS * 1000 + 100)
            expect(first.locator(f'a[href="/jobs/{latest}"]')).to_have_count(1)
        finally:
            page.close()
        with web.client() as admin:
            create(admin, "email/x")
        assert ok(idle.read_reply()).code == 200
