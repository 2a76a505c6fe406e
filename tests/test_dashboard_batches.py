"""A batch over HTTP: made with POST /api/CreateJobs and followed with
/api/QueryJob, and its progress on the dashboard, whose completion job's
page counts the batch's jobs by how they ended (dependencyCounts,
protocol.md 14.25); over real HTTP and once in headless Chromium, on
every backend."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, start
from test_http import api

from harness import ThreadServer
from jobserver.client import Batch, Client

pytestmark = pytest.mark.backends

TIMEOUT = 10.0
XSS = "<script>alert(1)</script>"


@pytest.fixture
def web(db: Path | str) -> Iterator[ThreadServer]:
    running = start(db)
    yield running
    running.stop()


def section(page: str) -> str:
    """The job page's dependencies section."""
    found = re.search(r'<section id="dependencies">(.*?)</section>', page, re.S)
    assert found is not None, "no dependencies section"
    return found.group(1)


def facts(html: str) -> dict[str, str]:
    return dict(re.findall(r"<tr[^>]*><th>([^<]+)</th><td[^>]*>([^<]+)</td></tr>", html))


def half_done(web: ThreadServer) -> Batch:
    """A batch of five: one finished, one failed, one deleted, two pending."""
    with Client(port=web.port, timeout=TIMEOUT) as jobs:
        batch = jobs.create_batch(
            [{"name": f"shots/{XSS}", "data": {"i": i}} for i in range(5)],
            then={"name": f"shots/report{XSS}"},
        )
        first, second = jobs.get_jobs("shots/*", 2)
        jobs.finish_job(first["jobID"], {"ok": 1}, first["leaseID"])
        jobs.fail_job(second["jobID"], None, second["leaseID"], error="bad pixel")
        jobs.delete_job(batch.job_ids[4])
    return batch


def test_a_completion_jobs_page_shows_how_far_its_batch_has_come(web):
    batch = half_done(web)
    visitor = Visitor(web)
    page = visitor.get(f"/jobs/{batch.then_id}").text
    shown = section(page)
    assert "3 of 5 jobs it depends on have ended" in shown
    assert '<meter min="0" max="5" value="3"' in shown
    assert facts(shown) == {
        "finished": "1", "failed": "1", "cancelled": "0", "deleted": "1", "pending": "2",
        "when one does not finish": "run all the same",
    }
    assert "BLOCKED" in page
    # The batch's job names are anyone's text: escaped.
    assert XSS not in page
    # A job of the batch depends on nothing: no such section.
    assert 'id="dependencies"' not in visitor.get(f"/jobs/{batch.job_ids[2]}").text


def test_a_completion_job_whose_batch_has_ended_is_queued_and_says_so(web):
    batch = half_done(web)
    with Client(port=web.port, timeout=TIMEOUT) as jobs:
        for job in jobs.get_jobs("shots/*", 5):
            assert job["jobID"] != batch.then_id
            jobs.finish_job(job["jobID"], None, job["leaseID"])
    shown = section(Visitor(web).get(f"/jobs/{batch.then_id}").text)
    assert "5 of 5 jobs it depends on have ended" in shown
    assert facts(shown)["finished"] == "3" and facts(shown)["pending"] == "0"


def test_a_batch_is_made_and_followed_through_the_http_api(web):
    parts = [{"name": "http/part", "data": {"i": i}} for i in range(3)]
    then = {"name": "http/done", "dependsOn": ["#0", "#1", "#2"], "onDependencyFailure": "run"}
    code, _, body = api(web, "CreateJobs", {"jobs": [*parts, then]})
    assert code == 200, body
    *job_ids, then_id = json.loads(body)["jobIDs"]
    with Client(port=web.port, timeout=TIMEOUT) as jobs:
        first = jobs.get_job("http/part")
        assert first is not None
        jobs.fail_job(first["jobID"], None, first["leaseID"], error="no")
    code, _, body = api(web, "QueryJob", {"jobID": then_id})
    assert code == 200, body
    shown = json.loads(body)
    assert (shown["state"], shown["onDependencyFailure"]) == ("BLOCKED", "run")
    assert shown["dependencyCounts"] == {
        "total": 3, "pending": 2, "finished": 0, "failed": 1, "cancelled": 0, "deleted": 0
    }
    page = section(Visitor(web).get(f"/jobs/{then_id}").text)
    assert "1 of 3 jobs it depends on has ended" in page
    assert len(job_ids) == 3


def test_in_a_browser_a_batch_progresses_on_its_completion_jobs_page(
    browser: Any, web: ThreadServer, artifacts: Path, backend: str
) -> None:
    from playwright.sync_api import expect

    batch = half_done(web)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        url = f"http://127.0.0.1:{web.server.http_port}/jobs/{batch.then_id}"
        page.goto(url)
        shown = page.locator("#dependencies")
        expect(shown).to_contain_text("3 of 5 jobs it depends on have ended")
        assert shown.locator("meter").evaluate("m => [m.value, m.max]") == [3, 5]
        expect(shown.locator("tr.failed td")).to_have_text("1")
        expect(page.locator("h1 .state")).to_have_text("BLOCKED")
        if backend == "sqlite":
            page.screenshot(path=str(artifacts / "dashboard-batch.png"), full_page=True)
        with Client(port=web.port, timeout=TIMEOUT) as jobs:
            for job in jobs.get_jobs("shots/*", 5):
                jobs.finish_job(job["jobID"], None, job["leaseID"])
        page.reload()
        expect(shown).to_contain_text("5 of 5 jobs it depends on have ended")
        expect(page.locator("h1 .state")).to_have_text("QUEUED")
        assert page.locator("script").count() == 1  # the dashboard's own
    finally:
        page.close()
