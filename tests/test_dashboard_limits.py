"""The dashboard's limits (protocol.md 14.7, 14.23): each shown with its
capacity, rate, per key and fair and what is used of them; the set-limit
form takes all four, refused as the server refuses; a job's page shows its
key. Over real HTTP to a real server on every backend, and once in
headless Chromium."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboard import Visitor, flash_of, start

from harness import ThreadServer
from helpers import create, ok

pytestmark = pytest.mark.backends

XSS = "<script>alert(1)</script>"


@pytest.fixture
def web(db: Path | str) -> Iterator[ThreadServer]:
    running = start(db)
    yield running
    running.stop()


def row_of(page: str, pattern: str) -> str:
    """The limits table's row of `pattern`."""
    table = page.split('<section id="limits">', 1)[1].split("</table>", 1)[0]
    found = re.search(rf"<tr[^>]*>\s*<td>{re.escape(pattern)}.*?</tr>", table, re.S)
    assert found is not None, table
    return found.group(0)


def cells(row: str) -> list[str]:
    """A row's cells as text, tags taken out."""
    found = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    return [re.sub(r"<[^>]+>", "", cell).strip() for cell in found]


def status_limits(server: ThreadServer) -> Any:
    with server.client() as client:
        return ok(client.request("Status")).json["limits"]


def test_limits_show_their_rate_per_key_and_fair_and_what_is_used(web: ThreadServer) -> None:
    with web.client() as client:
        ok(client.request("SetLimit", name="api/*", max=3, rate="2/1h", perKey="true",
                          fair="true"))
        ok(client.request("SetLimit", name="hooks/*", rate="5/1m"))
        ok(client.request("SetLimit", name="thumbs/*", max=1))
        jobs = [{"name": "api/x", "key": key} for key in ("a", "a", "a", "b")]
        ok(client.request("CreateJobs", jobs=json.dumps([*jobs, {"name": "thumbs/x"}])))
        # a's rate is spent at 2; b runs 1: 3 running, of 2 keys.
        assert len(ok(client.request("GetJobs", name="api/*", numResults=10)).json["jobs"]) == 3
        ok(client.request("GetJob", name="thumbs/*"))
    page = Visitor(web).get("/").text
    api = row_of(page, "api/*")
    # A per-key capacity is each key's: no gauge of all keys, never "full".
    assert cells(api) == [
        "api/* rate spent", "3", "3 a key", "", "2/1h a key", "2", "yes: 2 keys running", "yes",
        "Remove",
    ]
    assert "<meter" not in api and 'class="full"' not in api
    assert cells(row_of(page, "hooks/*"))[:8] == [
        "hooks/*", "0", "-", "", "5/1m", "0", "no", "no",
    ]
    thumbs = row_of(page, "thumbs/*")
    assert cells(thumbs)[:8] == ["thumbs/* full", "1", "1", "", "-", "-", "no", "no"]
    assert "<meter" in thumbs and 'class="full"' in thumbs


def test_the_form_sets_a_rate_per_key_and_fair_and_shows_refusals(web: ThreadServer) -> None:
    visitor = Visitor(web)
    assert flash_of(visitor, visitor.act(
        "limit", name="mail/*", max="", rate=" 100/1m ", perKey="true", fair="true", back="/"
    )) == "ok: Limit on mail/* set to rate 100/1m, per key, fair."
    assert flash_of(visitor, visitor.act(
        "limit", name="img/*", max="4", rate="10/1s", back="/"
    )) == "ok: Limit on img/* set to 4, rate 10/1s."
    assert status_limits(web) == {
        "mail/*": {"max": 0, "rate": "100/1m", "perKey": True, "fair": True, "running": 0,
                   "inWindow": 0, "keys": 0},
        "img/*": {"max": 4, "rate": "10/1s", "running": 0, "inWindow": 0},
    }
    refused = "error: The limit on x/* was not set: "
    for fields, status in [
        ({"rate": "5/1w"}, "402 Malformed rate (N/DURATION: 1 to 10000 per 1s to 1d, as 100/1m)"),
        ({"rate": "0/1s"}, "402 Malformed rate (N/DURATION: 1 to 10000 per 1s to 1d, as 100/1m)"),
        ({"max": "1", "perKey": "yes"}, "402 Malformed perKey (true or false)"),
        ({"fair": "1"}, "402 Malformed fair (true or false)"),
        ({"max": ""}, "402 Missing max"),
        ({"perKey": "true"}, "402 Missing max"),
        ({"max": "-1", "rate": "1/1s"}, "402 Malformed max"),
    ]:
        reply = visitor.act("limit", name="x/*", back="/", **fields)
        assert flash_of(visitor, reply) == refused + status, fields
    # Removed with capacity 0 alone, as the Remove button does.
    assert flash_of(visitor, visitor.act("limit", name="mail/*", max="0", back="/")) == (
        "ok: Limit on mail/* removed."
    )
    assert list(status_limits(web)) == ["img/*"]


def test_a_jobs_page_shows_its_key(web: ThreadServer) -> None:
    with web.client() as client:
        keyed = create(client, "mail/x", key=XSS)
        plain = create(client, "mail/y")
    visitor = Visitor(web)
    page = visitor.get(f"/jobs/{keyed}").text
    assert "<th>key</th><td><code>&lt;script&gt;alert(1)&lt;/script&gt;</code>" in page
    assert XSS not in page
    assert "<th>key</th>" not in visitor.get(f"/jobs/{plain}").text


def test_in_a_browser_a_per_key_fair_rate_is_set_with_the_form(
    browser: Any, web: ThreadServer, artifacts: Path, backend: str
) -> None:
    from playwright.sync_api import expect

    with web.client() as client:
        jobs = [{"name": "tenant/job", "key": f"customer-{n % 3}"} for n in range(9)]
        ok(client.request("CreateJobs", jobs=json.dumps(jobs)))
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"http://127.0.0.1:{web.server.http_port}/")
        form = page.locator('#limits form.inline')
        form.get_by_label("limit pattern").fill("tenant/*")
        form.get_by_label("capacity").fill("2")
        form.get_by_label("rate").fill("1/1h")
        form.get_by_label("per key").check()
        form.get_by_label("fair").check()
        form.get_by_role("button", name="Set limit").click()
        expect(page.locator(".flash.ok")).to_have_text(
            "Limit on tenant/* set to 2, rate 1/1h, per key, fair."
        )
        row = page.locator('#limits tbody tr:has(td:text-is("tenant/*"))')
        expect(row.locator("td.rate")).to_have_text("1/1h a key")
        expect(row.locator("td.per-key")).to_have_text("yes: 0 keys running")
        expect(row.locator("td.fair")).to_have_text("yes")
        # Each key's rate lets one job of each go.
        with web.client() as client:
            taken = ok(client.request("GetJobs", name="tenant/*", numResults=9)).json["jobs"]
        assert sorted(job["key"] for job in taken) == [f"customer-{n}" for n in range(3)]
        page.reload()
        expect(row.locator("td.per-key")).to_have_text("yes: 3 keys running")
        expect(row.locator("td").first).to_have_text("tenant/* rate spent")
        page.screenshot(path=str(artifacts / f"dashboard-limits-{backend}.png"), full_page=True)
        # A refusal is a message, as the server words it.
        form.get_by_label("limit pattern").fill("tenant/*")
        form.get_by_label("rate").fill("1/1w")
        form.get_by_role("button", name="Set limit").click()
        expect(page.locator(".flash.error")).to_contain_text(
            "The limit on tenant/* was not set: 402 Malformed rate"
        )
    finally:
        page.close()
    assert status_limits(web)["tenant/*"]["rate"] == "1/1h"
