"""The dashboard's Scheduled and Retries (web/later_pages.py), and a job
waiting for a retry shown as such ("retry 1 of 5 in 40 s") in lists and on
its page: real jobs failed by a real worker, the pages over real HTTP and
in headless Chromium, on every backend; the answer at the count's bound
and past it on SQLite."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, start

from harness import ThreadServer
from helpers import create, ok
from jobserver.storage import sql, sqlite_ready
from jobserver.web.dashboard import PAGE_HEADERS
from jobserver.web.later_pages import COUNTED, SHOWN
from wire import Client

XSS = "<script>alert(1)</script>"


@pytest.fixture
def web(db: Path | str) -> Iterator[ThreadServer]:
    running = start(db)
    yield running
    running.stop()


def later(hours: float) -> str:
    return f"{datetime.now(UTC) + timedelta(hours=hours):%Y-%m-%d %H:%M:%S}"


def failed_once(client: Client, name: str, delay: int = 40) -> int:
    """A job with five attempts, its first failed: QUEUED for its retry in `delay` s."""
    job_id = create(client, name, maxAttempts=5, retryBackoff="fixed", retryDelay=delay)
    assert ok(client.request("GetJob", name=name)).json["jobID"] == job_id
    ok(client.request("FailJob", jobID=job_id, error="boom\nsecond line"))
    return job_id


def rows_of(page: str) -> list[str]:
    table = page.split('<table class="later">', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr>.*?</tr>", table.split("<tbody>", 1)[1], re.S)


@pytest.mark.backends
def test_scheduled_and_retries_list_the_jobs_due_later_soonest_first(web: ThreadServer) -> None:
    visitor = Visitor(web)
    with web.client() as client:
        assert "No job is queued to run later." in visitor.get("/scheduled").text
        assert "No job is waiting for a retry." in visitor.get("/retries").text
        create(client, "now/due")
        two_hours = create(client, f"report/{XSS}", firstRun=later(2))
        one_hour = create(client, "report/soon", firstRun=later(1))
        retrying = failed_once(client, "email/send")
        scheduled = visitor.get("/scheduled")
        assert scheduled.status == 200
        for header, value in PAGE_HEADERS.items():
            assert scheduled.headers[header] == value
        assert '<span class="count">3</span>' in scheduled.text
        rows = rows_of(scheduled.text)
        assert [re.search(r'href="/jobs/(\d+)"', row)[1] for row in rows] == [  # type: ignore[index]
            str(retrying), str(one_hour), str(two_hours)
        ]
        assert re.search(r">retry 1 of 5 in (3\d|40) s<", rows[0]), rows[0]
        assert "boom" in rows[0] and "second line" not in rows[0]
        assert "&lt;script&gt;" in rows[2] and XSS not in scheduled.text
        retries = visitor.get("/retries").text
        assert '<span class="count">1</span>' in retries
        assert [f'href="/jobs/{retrying}"' in row for row in rows_of(retries)] == [True]
        # Its own page, a search and its parent's children say it waits.
        job_page = visitor.get(f"/jobs/{retrying}").text
        assert re.search(r'<h1>.*class="state retry"[^>]*>retry 1 of 5 in', job_page)
        assert 'title="QUEUED: 1 attempt failed of 5, due again ' in job_page
        assert ">retry 1 of 5 in" in visitor.get("/jobs?name=email/*").text
        # A job due now is QUEUED, whatever its attempts.
        ok(client.request("UpdateJob", jobID=retrying, data="{}", nextRun=later(-1)))
        assert ">retry" not in visitor.get(f"/jobs/{retrying}").text
        assert "No job is waiting for a retry." in visitor.get("/retries").text
        # The pages answer only to this server's names, as every page does.
        assert visitor.get("/retries", Host="evil.example").status == 421


def test_the_soonest_are_listed_whatever_waits_before_them(tmp_path: Path) -> None:
    """Twice the count's bound of jobs due later, and as many running under
    a lease due sooner still, do not hide a retry due behind all of them:
    Retries lists it and counts 1 (it was first built to look only among
    the 10,000 due soonest, and answered "No job is waiting for a retry");
    Scheduled lists the soonest 50 queued ones, not the running ones, and
    counts "10000+". Each statement is an index range, never a scan. Rows
    are written straight into the file (CreateJobs would take minutes)."""
    db = tmp_path / "jobs.db"
    web = start(db)
    try:
        with web.client() as client:
            running = create(client, "leased", firstRun=later(0.5))
            scheduled = create(client, "probe", firstRun=later(1))
            retry = failed_once(client, "late/retry", delay=3600)
        web.stop()
        _copy_job(db, running, 2 * COUNTED)
        _copy_job(db, scheduled, 2 * COUNTED)
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE jobs SET state = 'RUNQUEUED' WHERE name = 'leased'")
            conn.execute("UPDATE jobs SET nextRun = ? WHERE jobID = ?", (later(48), retry))
            retries = sql.later_jobs(sql.SQLITE, later(0), True, SHOWN, COUNTED)
            scheduled = sqlite_ready.scheduled(later(0), SHOWN, COUNTED)
            reads = (
                ("jobsRetrying (nextRun>?)", retries),
                ("jobsReadyPriority (priority=? AND nextRun>?)", scheduled),
            )
            for index, read in reads:
                for statement, args in read:
                    explained = conn.execute(f"EXPLAIN QUERY PLAN {statement}", args)
                    plan = " ".join(row[3] for row in explained)
                    assert f"USING INDEX {index}" in plan, plan
                    assert "SCAN jobs" not in plan and "TEMP B-TREE" not in plan, plan
        web = start(db)
        visitor = Visitor(web)
        began = time.monotonic()
        retries = visitor.get("/retries").text
        assert '<span class="count">1</span>' in retries
        assert [f'href="/jobs/{retry}"' in row for row in rows_of(retries)] == [True]
        page = visitor.get("/scheduled").text
        assert f'<span class="count">{COUNTED}+</span>' in page
        assert "the count stops there" in page
        listed = rows_of(page)
        assert len(listed) == SHOWN
        assert all("probe" in row for row in listed), listed[0]
        assert time.monotonic() - began < 10.0  # some 50 ms here
    finally:
        web.stop()


def _copy_job(db: Path, job_id: int, count: int) -> None:
    """`count` copies of a job, due one second after another from its nextRun."""
    with sqlite3.connect(db) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(jobs)")]
        copied = [c for c in columns if c not in ("jobID", "nextRun")]
        conn.execute(
            f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            f"INSERT INTO jobs ({', '.join(copied)}, nextRun) "
            f"SELECT {', '.join(copied)}, datetime(nextRun, '+' || i || ' seconds') "
            f"FROM jobs, n WHERE jobID = ?",
            (count, job_id),
        )


@pytest.mark.backends
def test_in_a_browser_a_retry_shows_how_long_it_waits(
    browser: Any, web: ThreadServer, artifacts: Path, backend: str
) -> None:
    from playwright.sync_api import expect

    with web.client() as client:
        job_id = failed_once(client, "email/send")
        create(client, "report/nightly", firstRun=later(3))
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"http://127.0.0.1:{web.server.http_port}/")
        page.get_by_role("link", name="Retries").click()
        expect(page.locator("h1")).to_have_text("Retries 1")
        row = page.locator("table.later tbody tr")
        expect(row).to_have_count(1)
        expect(row.locator("span.state.retry")).to_have_text(re.compile(r"retry 1 of 5 in \d+ s"))
        page.get_by_role("link", name="Scheduled").click()
        expect(page.locator("h1")).to_have_text("Scheduled 2")
        expect(page.locator("table.later tbody tr")).to_have_count(2)
        if backend == "sqlite":
            page.screenshot(path=str(artifacts / "dashboard-retries.png"), full_page=True)
        page.locator(f'table.later a[href="/jobs/{job_id}"]').click()
        expect(page.locator("h1 span.state.retry")).to_have_text(
            re.compile(r"retry 1 of 5 in \d+ s")
        )
    finally:
        page.close()
