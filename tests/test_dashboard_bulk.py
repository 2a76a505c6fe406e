"""The dashboard's bulk actions (bulk_pages.py) over real HTTP and in
headless Chromium: a confirmation that counts first and changes nothing,
then one action on many jobs through the wire commands; a queue paused and
resumed from its row; and no bulk action from another site's page."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bulk_jobs import COSTLY, costly_name, create_many, failed_jobs, states
from test_dashboard import TOKEN, Visitor, flash_of, guarded, server, start
from test_security_web import AttackSite, attack_site

from harness import ThreadServer
from helpers import ok
from jobserver.wire.limits import BULK_TEST_BUDGET

__all__ = ["attack_site", "guarded", "server"]  # fixtures, used by name

CROSS_SITE = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}


def confirm(visitor: Visitor, **fields: Any) -> str:
    """The confirmation page of a bulk action, which must change nothing."""
    own = {"Origin": f"http://{visitor.host}"}
    page = visitor.post("/bulk/confirm", fields, **own)
    assert page.status == 200, page.text
    return page.text


def test_requeue_by_pattern_confirms_the_count_then_acts(server: ThreadServer) -> None:
    visitor = Visitor(server)
    with server.client() as client:
        ids = failed_jobs(client, [f"email/{i}" for i in range(7)] + ["sms/1"])
        page = confirm(visitor, command="requeue-failed", name="email/*")
        assert re.search(
            r'Requeue <span class="count">7</span> failed jobs matching email/\*', page
        )
        shown = ",".join(map(str, ids[:7]))
        assert f'name="shown" value="{shown}"' in page
        assert set(states(client, ids).values()) == {"FAILED"}
        # Meanwhile one of them is requeued by someone else, and another job
        # of the pattern fails: the confirmed action acts on the jobs shown
        # alone, and says it passed one over.
        late = failed_jobs(client, ["email/late"])
        ok(client.request("RequeueJobs", jobIDs=ids[1]))
        done = visitor.act("bulk", command="requeue-failed", name="email/*", shown=shown)
        assert flash_of(visitor, done) == (
            "ok: 6 failed jobs matching email/* requeued. "
            "1 had changed since the confirmation: left as it is."
        )
        assert list(states(client, ids).values()) == ["QUEUED"] * 7 + ["FAILED"]
        assert states(client, late) == {late[0]: "FAILED"}


def test_one_job_reads_in_the_singular(server: ThreadServer) -> None:
    visitor = Visitor(server)
    with server.client() as client:
        ids = failed_jobs(client, ["solo/1", "pair/1", "pair/2"])
        page = confirm(visitor, command="requeue-failed", name="solo/*")
        assert 'Requeue <span class="count">1</span> failed job matching solo/*?' in page
        assert "Confirm: requeue 1 failed job</button>" in page
        done = visitor.act("bulk", command="requeue-failed", name="solo/*", shown=str(ids[0]))
        assert flash_of(visitor, done) == "ok: 1 failed job matching solo/* requeued."
        page = confirm(visitor, command="delete-failed", name="pair/*")
        assert 'Delete <span class="count">2</span> failed jobs matching pair/*?' in page
        ok(client.request("RequeueJobs", jobIDs=ids[1]))
        shown = f"{ids[1]},{ids[2]}"
        done = visitor.act("bulk", command="delete-failed", name="pair/*", shown=shown)
        assert flash_of(visitor, done) == (
            "ok: 1 failed job matching pair/* deleted. "
            "1 had changed since the confirmation: left as it is."
        )


def test_delete_a_selection(server: ThreadServer) -> None:
    visitor = Visitor(server)
    with server.client() as client:
        ids = failed_jobs(client, ["a", "b", "c"])
        page = visitor.post(
            "/bulk/confirm",
            [("command", "delete-failed"), ("jobID", ids[0]), ("jobID", ids[2])],  # type: ignore[arg-type]
            Origin=f"http://{visitor.host}",
        )
        assert 'Delete <span class="count">2</span> failed jobs selected' in page.text
        assert f'name="jobIDs" value="{ids[0]},{ids[2]}"' in page.text
        done = visitor.act(
            "bulk", command="delete-failed", jobIDs=f"{ids[0]},{ids[2]}", shown=f"{ids[0]},{ids[2]}"
        )
        assert flash_of(visitor, done) == "ok: 2 failed jobs selected deleted."
        assert states(client, ids) == {ids[0]: "gone", ids[1]: "FAILED", ids[2]: "gone"}


def test_cancel_queued_of_a_queue_and_refusals(server: ThreadServer) -> None:
    visitor = Visitor(server)
    with server.client() as client:
        ids = create_many(client, ["q/a", "q/b", "r"])
        page = confirm(visitor, command="cancel-queued", queue="q")
        assert 'Cancel <span class="count">2</span> queued jobs of queue q' in page
        assert "Nothing to cancel" in confirm(visitor, command="cancel-queued", queue="none")
        for fields in (
            {"command": "explode", "name": "*"},
            {"command": "cancel-queued"},
            {"command": "cancel-queued", "name": "*", "queue": "q"},
            {"command": "cancel-queued", "jobIDs": "1,x"},
        ):
            refused = visitor.post("/bulk/confirm", fields, Origin=f"http://{visitor.host}")
            assert refused.status == 400, fields
        too_many = [("command", "delete-failed")] + [("jobID", i) for i in range(1, 600)]
        refused = visitor.post("/bulk/confirm", too_many, Origin=f"http://{visitor.host}")  # type: ignore[arg-type]
        assert refused.status == 400 and "at most 500 jobs at once" in refused.text
        bad = visitor.act("bulk", command="cancel-queued", queue="q", shown="1,lots")
        assert flash_of(visitor, bad) == (
            "error: Nothing was done: confirm from the confirmation page."
        )
        too_many = ",".join(map(str, range(1, 1002)))
        bad = visitor.act("bulk", command="cancel-queued", queue="q", shown=too_many)
        assert flash_of(visitor, bad) == "error: Nothing was done: at most 1000 jobs at once."
        done = visitor.act("bulk", command="cancel-queued", queue="q", shown=f"{ids[0]},{ids[1]}")
        assert flash_of(visitor, done) == "ok: 2 queued jobs of queue q cancelled."
        assert list(states(client, ids).values()) == ["gone", "gone", "QUEUED"]


def test_a_search_that_stopped_short_says_more_may_match(server: ThreadServer) -> None:
    """A costly pattern examines few jobs (protocol.md 14.19): the page
    says how many, and that more may match, never "no queued job"."""
    pattern, examined = COSTLY
    visitor = Visitor(server)
    with server.client() as client:
        create_many(client, [costly_name(i) for i in range(examined + 5)])
    page = confirm(visitor, command="cancel-queued", name=pattern)
    assert f'Cancel <span class="count">{examined}</span> queued jobs matching n/*xx' in page
    assert f"{examined} of the first {examined} examined match, and more may" in page
    none = confirm(visitor, command="cancel-queued", name=pattern + "x")
    assert "Nothing to cancel" in none
    fewer = BULK_TEST_BUDGET // (1 + 5 * 242)  # a byte more
    assert f"No queued job matching {pattern}x among the first {fewer} examined" in none


def test_a_queue_is_paused_and_resumed_from_its_row(server: ThreadServer) -> None:
    visitor = Visitor(server)
    with server.client() as client:
        create_many(client, ["img*/a", "img*"])
        live = visitor.get("/live").text
        assert "/actions/pause-queue" in live and "/actions/resume-queue" not in live
        done = visitor.act("pause-queue", queue="img*")
        assert flash_of(visitor, done) == "ok: Queue img* paused: img[*] and img[*]/*."
        status = client.request("Status").json
        assert sorted(status["paused"]) == ["img[*]", "img[*]/*"]
        assert client.request("GetJob", name="*").status == "404 No job found"
        assert "/actions/resume-queue" in visitor.get("/live").text
        done = visitor.act("resume-queue", queue="img*")
        assert flash_of(visitor, done) == "ok: Queue img* resumed."
        assert client.request("Status").json["paused"] == []


def test_a_queue_that_cannot_be_paused_whole_is_not_paused_at_all(tmp_path: Path) -> None:
    """Room for one more paused pattern, not two: `plain` is not left
    paused without `plain/*` (a row offering Pause again over a held queue)."""
    server = start(tmp_path / "jobs.db", max_limits=1)
    try:
        visitor = Visitor(server)
        with server.client() as client:
            create_many(client, ["plain"])
            done = visitor.act("pause-queue", queue="plain")
            assert flash_of(visitor, done).startswith("error: Queue plain was not paused: 413")
            assert client.request("Status").json["paused"] == []
            assert client.request("GetJob", name="plain").status == "200 OK"
    finally:
        server.stop()


def test_no_bulk_action_from_another_site_or_without_signing_in(guarded: ThreadServer) -> None:
    visitor = Visitor(guarded)
    token = {"authToken": TOKEN}
    with guarded.client() as client:
        ids = failed_jobs(client, ["a", "b"], token)
        # Not signed in: refused, and the pages offer no bulk buttons.
        shown = ",".join(map(str, ids))
        assert visitor.act("bulk", command="delete-failed", name="*", shown=shown).status == 401
        assert (
            visitor.post(
                "/bulk/confirm",
                {"command": "delete-failed", "name": "*"},
                Origin=f"http://{visitor.host}",
            ).status
            == 401
        )
        assert "/bulk/confirm" not in visitor.get("/").text
        signed_in = visitor.post(
            "/signin", {"token": TOKEN, "back": "/"}, Origin=f"http://{visitor.host}"
        )
        assert signed_in.status == 303
        assert "/bulk/confirm" in visitor.get("/").text
        for path, fields in (
            ("/actions/bulk", {"command": "delete-failed", "name": "*", "shown": shown}),
            ("/bulk/confirm", {"command": "delete-failed", "name": "*"}),
            ("/actions/pause-queue", {"queue": "a"}),
        ):
            refused = visitor.post(path, fields, **CROSS_SITE)
            assert refused.status == 403, (path, refused.text)
        assert set(states(client, ids, token).values()) == {"FAILED"}
        assert client.request("Status", token).json["paused"] == []
        done = visitor.act("bulk", command="delete-failed", name="*", shown=shown)
        assert flash_of(visitor, done) == "ok: 2 failed jobs matching * deleted."


# In headless Chromium.


def test_in_a_browser_a_hundred_failed_jobs_are_requeued_in_one_confirmed_action(
    browser: Any, server: ThreadServer, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    with server.client() as client:
        ids = failed_jobs(client, [f"email/{i}" for i in range(100)] + ["sms/1", "sms/2"])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"http://127.0.0.1:{server.server.http_port}/")
        page.get_by_label("failed jobs pattern").fill("email/*")
        page.get_by_role("button", name="Requeue every match").click()
        expect(page.locator("h1")).to_have_text("Requeue 100 failed jobs matching email/*?")
        page.screenshot(path=str(artifacts / "dashboard-bulk-confirm.png"), full_page=True)
        with server.client() as client:
            assert set(states(client, ids).values()) == {"FAILED"}
        page.get_by_role("button", name="Confirm: requeue 100 failed jobs").click()
        expect(page.locator(".flash.ok")).to_have_text("100 failed jobs matching email/* requeued.")
        # The selection: the two left, checked and deleted.
        for job_id in ids[100:]:
            page.get_by_label(f"select job {job_id}").check()
        page.screenshot(path=str(artifacts / "dashboard-bulk-selected.png"), full_page=True)
        page.get_by_role("button", name="Delete selected").click()
        expect(page.locator("h1")).to_have_text("Delete 2 failed jobs selected?")
        page.get_by_role("button", name="Confirm: delete 2 failed jobs").click()
        expect(page.locator(".flash.ok")).to_have_text("2 failed jobs selected deleted.")
        page.screenshot(path=str(artifacts / "dashboard-bulk-done.png"), full_page=True)
    finally:
        page.close()
    with server.client() as client:
        found = states(client, ids)
    assert [found[i] for i in ids[:100]] == ["QUEUED"] * 100
    assert [found[i] for i in ids[100:]] == ["gone", "gone"]


def test_in_a_browser_a_queue_is_paused_and_resumed_from_its_row(
    browser: Any, server: ThreadServer, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    with server.client() as client:
        create_many(client, ["email/a", "email/b", "thumbs/a"])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"http://127.0.0.1:{server.server.http_port}/")
        row = page.locator('#live tbody tr:has(td > a:text-is("email"))')
        row.get_by_role("button", name="Pause").click()
        expect(page.locator(".flash.ok")).to_have_text("Queue email paused: email and email/*.")
        expect(row.locator(".state.paused").first).to_be_visible()
        page.screenshot(path=str(artifacts / "dashboard-queue-paused.png"), full_page=True)
        with server.client() as client:
            assert client.request("GetJob", name="email/*").status == "404 No job found"
        row.get_by_role("button", name="Resume").click()
        expect(page.locator(".flash.ok")).to_have_text("Queue email resumed.")
        expect(row.get_by_role("button", name="Pause")).to_be_visible()
    finally:
        page.close()
    with server.client() as client:
        assert client.request("GetJob", name="email/*").status == "200 OK"


BULK_ATTACK_PAGE = """<!doctype html>
<iframe name="sink"></iframe>
<form id="bulk" method="post" action="{target}/actions/bulk" target="sink">
<input name="command" value="delete-failed"><input name="name" value="*">
<input name="shown" value="1,2,3"><input name="back" value="/"></form>
<script>
window.attack = async () => {{
  const sink = document.querySelector("iframe");
  const loaded = new Promise((done) => sink.addEventListener("load", done, {{once: true}}));
  document.getElementById("bulk").submit();
  await loaded;
}};
</script>
"""


def test_in_a_browser_another_page_cannot_act_in_bulk_for_a_signed_in_person(
    browser: Any, guarded: ThreadServer, attack_site: AttackSite
) -> None:
    """A page on another port of this host is same-site: the browser sends
    the SameSite=Strict cookie with its form; Origin gives it away."""
    from playwright.sync_api import expect

    with guarded.client() as client:
        ids = failed_jobs(client, ["a", "b"], {"authToken": TOKEN})
    target = f"http://127.0.0.1:{guarded.server.http_port}"
    attack_site.html = BULK_ATTACK_PAGE.format(target=target)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{target}/")
        page.get_by_label("auth token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".flash.ok")).to_have_text("Signed in.")
        attack = context.new_page()
        attack.goto(f"http://127.0.0.1:{attack_site.port}/")
        with attack.expect_response(f"{target}/actions/bulk") as posted:
            attack.evaluate("attack()")
        assert posted.value.status == 403
        assert posted.value.request.header_value("cookie") is not None
    finally:
        context.close()
    with guarded.client() as client:
        assert set(states(client, ids, {"authToken": TOKEN}).values()) == {"FAILED"}


# Over the HTTP API (openapi.py's table).


def test_the_api_runs_the_bulk_commands(server: ThreadServer) -> None:
    from test_http import api

    with server.client() as client:
        ids = failed_jobs(client, ["a/1", "a/2"])
    code, _, body = api(server, "RequeueFailedJobs", {"name": "a/*", "dryRun": True})
    assert (code, json.loads(body)["jobIDs"]) == (200, ids)
    code, _, body = api(server, "DeleteFailedJobs", {"jobIDs": f"{ids[0]}", "limit": 1})
    assert (code, json.loads(body)["acted"]) == (200, 1)
    code, _, body = api(server, "CancelQueuedJobs", {"queue": "a/b"})
    assert code == 400, body
    code, headers, _ = api(server, "RequeueFailedJobs", {})
    assert (code, headers["Jobserver-Status"]) == (400, "402 Missing name, queue or jobIDs")
