"""The dashboard's graphs (/history.json, /queues/{queue}) over real HTTP
to a real server, History over POST /api/History, and the graphs drawn
in headless Chromium from jobs created and finished through the wire."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, start

from conformance_helpers import get_job
from harness import ThreadServer
from helpers import chromium, create, ok, until
from jobserver.core.engine import history

TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    """One server for the module, its jobs made once: every check reads."""
    running = start(tmp_path_factory.mktemp("history") / "jobs.db")
    with running.client() as client:
        for name in ("email/send",) * 5 + ("thumbs/make",) * 2:
            create(client, name)
        for _ in range(3):
            ok(client.request("FinishJob", jobID=get_job(client, "email/send")["jobID"]))
        failing = get_job(client, "email/send")["jobID"]
        ok(client.request("FailJob", jobID=failing, error="SMTP 451"))
        create(client, "<b>x</b>")
    yield running
    running.stop()


def history_json(visitor: Visitor, query: str = "", **headers: str) -> tuple[int, Any]:
    page = visitor.get(f"/history.json{query}", **headers)
    assert page.headers["Cache-Control"] == "no-store"
    return page.status, json.loads(page.text)


def test_history_json_is_the_history_command(server):
    visitor = Visitor(server)
    status, body = history_json(visitor, "?minutes=5")
    assert status == 200
    assert body["minutes"] == 5 and body["queues"] == ["<b>x<", "email", "thumbs"]
    assert sum(body["series"]["created"]) == 8
    status, email = history_json(visitor, "?queue=email&minutes=5")
    assert status == 200
    assert [sum(email["series"][k]) for k in ("created", "handedOut", "finished", "failed")] == [
        5,
        4,
        3,
        1,
    ]


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("?minutes=0", "402 Malformed minutes: 1 to 1440"),
        ("?minutes=x", "402 Malformed minutes"),
        ("?queue=a/b", "402 Malformed name: a queue has no '/'"),
        ("?queue=" + "q" * 300, "402 Name too large (255 bytes at most)"),
    ],
)
def test_history_json_refuses_bad_parameters(server, query, error):
    assert history_json(Visitor(server), query) == (400, {"error": error})


def test_history_json_is_not_read_for_another_sites_page(server):
    visitor = Visitor(server)
    assert history_json(visitor, **{"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert history_json(visitor, Origin="http://evil.example")[0] == 403
    # The dashboard's own script (same origin) reads it.
    assert history_json(visitor, **{"Sec-Fetch-Site": "same-origin"})[0] == 200
    # DNS rebinding: a Host that is not this server's is refused first.
    assert visitor.get("/history.json", Host="evil.example").status == 421


def test_history_over_the_json_api(server):
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}/api/History",
        data=json.dumps({"name": "thumbs", "minutes": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["queue"] == "thumbs" and body["series"]["created"][-1] == 2


def test_a_queues_page_shows_its_counts_and_its_graphs(server):
    visitor = Visitor(server)
    page = visitor.get("/queues/email")
    assert page.status == 200
    assert "<dt>QUEUED</dt><dd>1</dd>" in page.text and "<dt>FAILED</dt><dd>1</dd>" in page.text
    assert 'data-queue="email"' in page.text
    assert '<script src="/static/uPlot.iife.min.js" defer></script>' in page.text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    # A name anyone can create is escaped, in the page and in its links.
    odd = visitor.get("/queues/%3Cb%3Ex%3C")
    assert odd.status == 200 and "<b>x<" not in odd.text and "&lt;b&gt;x&lt;" in odd.text
    assert visitor.get("/queues/%01").status == 404
    # Linked from the queues table.
    assert '<a href="/queues/email">email</a>' in visitor.get("/live").text


def test_the_vendored_chart_library_is_served_from_here(server):
    visitor = Visitor(server)
    script = visitor.get("/static/uPlot.iife.min.js")
    assert script.status == 200 and script.text.startswith("/*! https://github.com/leeoniya/uPlot")
    assert visitor.get("/static/uPlot.min.css").status == 200
    assert visitor.get("/static/graphs.js").status == 200
    license_text = Path(__file__).parent.parent / "jobserver/web/static/uPlot.LICENSE"
    assert "MIT License" in license_text.read_text()


def test_in_a_browser_the_graphs_draw_the_counts(server, artifacts):
    from playwright.sync_api import expect

    base = f"http://127.0.0.1:{server.server.http_port}"
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        errors: list[str] = []
        # No script error, and no request refused but the browser's own
        # favicon.ico (the dashboard has none).
        page.on(
            "response",
            lambda r: (
                errors.append(r.url)
                if r.status >= 400 and not r.url.endswith("/favicon.ico")
                else None
            ),
        )
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{base}/")
        graphs = page.locator("section.graphs[data-drawn]")
        expect(graphs).to_have_count(1, timeout=TIMEOUT_MS)
        expect(graphs).to_have_attribute("data-created", "8")
        expect(graphs).to_have_attribute("data-finished", "3")
        expect(graphs).to_have_attribute("data-failed", "1")
        # Two charts, each a canvas with its legend (this minute's values).
        expect(page.locator("section.graphs canvas")).to_have_count(2)
        legend = page.locator("section.graphs .chart.throughput .u-legend")
        for label in ("created", "handed out", "finished", "failed", "retried"):
            expect(legend).to_contain_text(label)
        # Not the pointer's minute: the newest, whose counts the page drew.
        # (Asked again until they agree: a minute may turn in between.)
        created = legend.locator("tr", has_text="created").locator("td")

        def newest_shown() -> bool:
            newest = history_json(Visitor(server), "?minutes=1")[1]["series"]["created"][0]
            return created.inner_text() == str(newest)

        until(newest_shown, TIMEOUT_MS / 1000, "the legend to show the newest minute")
        page.screenshot(path=str(artifacts / "dashboard-history.png"), full_page=True)

        # It updates by itself: a job created now shows up without a reload.
        with server.client() as client:
            create(client, "email/send")
        expect(graphs).to_have_attribute("data-created", "9", timeout=TIMEOUT_MS)

        page.locator('#live a[href="/queues/email"]').click()
        expect(page).to_have_url(f"{base}/queues/email")
        queue_graphs = page.locator('section.graphs[data-queue="email"][data-drawn]')
        expect(queue_graphs).to_have_count(1, timeout=TIMEOUT_MS)
        expect(queue_graphs).to_have_attribute("data-created", "6")
        expect(queue_graphs).to_have_attribute("data-handed-out", "4")
        expect(queue_graphs).to_have_attribute("data-finished", "3")
        page.screenshot(path=str(artifacts / "queue-page.png"), full_page=True)
        assert errors == []
        page.close()


def test_in_a_browser_a_queue_counted_in_the_totals_only_is_not_said_to_have_nothing(
    tmp_path: Path,
):
    """A queue past the 100 with series of their own has no graphs: the
    page says why, not that nothing was counted for it."""
    from playwright.sync_api import expect

    running = start(tmp_path / "jobs.db")
    try:
        with running.client() as client:
            jobs = [{"name": f"q{i}"} for i in range(history.MAX_TRACKED_QUEUES + 1)]
            ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
        base = f"http://127.0.0.1:{running.server.http_port}"
        with chromium() as browser:
            page = browser.new_page()
            page.goto(f"{base}/queues/q{history.MAX_TRACKED_QUEUES}")
            status = page.locator("section.graphs[data-drawn] .graph-status")
            expect(status).to_contain_text("counted in the totals only", timeout=TIMEOUT_MS)
            page.close()
    finally:
        running.stop()
