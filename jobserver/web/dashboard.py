"""The dashboard: a person's view of the queue, and a place to act during
an incident.

Pages (GET):

- `/`: the server's status and its queues (refreshed every few seconds
  from `/live`), failed jobs with their last errors, limits (capacity,
  rate, per key, fair, and their use) and pauses;
  an error is shown as text (wire/last_error.py: a worker's exit status,
  then the end of its stderr), its raw text one click away;
- `/jobs/{id}`: one job, with its parent and children;
- `/jobs?name=PATTERN`: the newest jobs whose name matches; `/jobs?id=N`
  goes to job N's page;
- `/scheduled` and `/retries`: the queued jobs due later, and those of
  them waiting for a retry (later_pages.py);
- `/queues/{queue}` and the graphs on `/`: history_pages.py.

Bulk actions (bulk_pages.py) show a confirmation first (`POST
/bulk/confirm`, which changes nothing), then act as the other actions do.

Actions are form POSTs to `/actions/{name}` (job_actions.py: those on one
job or one name pattern), answered with a redirect (303) back to the page,
which shows once what came of it (a short-lived cookie carries the
message). A refusal is shown the same way; nothing a
form sends stops the server or gets a 500.

Everything is asked through the dispatcher: the wire commands (Status,
Queues, FailedJobs, RequeueJobs, ...), and reads.py for what no command
shows. Templates escape everything (job names and data come from anyone
who can create a job), and the pages load no script but their own
(Content-Security-Policy). Who may act is access.py's business.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from jobserver.core.build import Core
from jobserver.core.commands import params
from jobserver.core.errors import CommandError
from jobserver.model import globmatch, times
from jobserver.model.jobs import State
from jobserver.web import (
    access,
    bulk_pages,
    dependency_pages,
    forms,
    job_actions,
    later_pages,
    outcome_pages,
    running_pages,
    texts,
)
from jobserver.web.history_pages import GRAPH_MINUTES, GRAPH_REFRESH_SECONDS, HistoryPages
from jobserver.web.incoming import peer
from jobserver.web.reads import Reads
from jobserver.wire.counts import noun_for
from jobserver.wire.framing import Request as WireRequest
from jobserver.wire.framing import Response as WireResponse

HERE = Path(__file__).parent

# How much of each list a page shows: enough to act on, little enough to
# render at once.
QUEUES_SHOWN = 50
FAILED_SHOWN = 100
FOUND_SHOWN = 200
# The last lines of a failed job's output in the table; its page shows all.
ERROR_TAIL = 5
# Seconds between refreshes of the live part of `/`: often enough to watch
# a queue drain; each refresh reads every job (Queues).
REFRESH_SECONDS = 5

# States in the order of a job's life, for the columns of the queues.
STATE_ORDER = (
    State.BLOCKED, State.QUEUED, State.RUNQUEUED, State.RUNNING, State.WAITING, State.PAUSED,
    State.FAILED, State.FINISHED, State.CANCELLED,
)
# Where the job page offers each button (protocol.md 4.2 and 5.10).
DELETABLE = frozenset(
    (
        State.QUEUED, State.RUNQUEUED, State.FINISHED, State.CANCELLED, State.FAILED,
        State.WAITING, State.BLOCKED,
    )
)
CANCELLABLE = frozenset(
    (State.QUEUED, State.RUNQUEUED, State.FAILED, State.WAITING, State.BLOCKED)
)

# Pages show job data, and their buttons act: no other site may frame
# them, and no script but the dashboard's own may run in them.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}

class Dashboard:
    def __init__(
        self,
        core: Core,
        token: str | None,
        secure: bool,
        session_seconds: float,
    ) -> None:
        self._dispatcher = core.dispatcher
        self._store = core.store
        self._token = token
        self._secure = secure
        self._sessions = access.Sessions(session_seconds)
        self._throttle = access.SignInThrottle()
        self._reads = Reads(core)
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        env.filters["age"] = texts.age_text
        env.filters["since"] = texts.since_text
        env.filters["time"] = texts.time_html
        env.filters["error_lines"] = texts.error_lines
        env.filters["rate_count"] = texts.rate_count
        env.filters["retry"] = texts.retry_text
        # `{{ "job"|plural(n) }}`: the noun that reads right for n.
        env.filters["plural"] = lambda noun, count, nouns=None: noun_for(count, noun, nouns)
        env.globals["queue_paused"] = bulk_pages.queue_paused
        self._templates = Jinja2Templates(env=env)
        self._static = {
            path.name: (path.read_bytes(), STATIC_TYPES[path.suffix])
            for path in (HERE / "static").iterdir()
            if path.suffix in STATIC_TYPES
        }
        self._actions: dict[str, job_actions.Action] = job_actions.JobActions(self._call).actions()
        self._bulk = bulk_pages.BulkPages(self)
        self._actions.update(self._bulk.actions())
        self._history = HistoryPages(self._call, self._page, self._message)

    def routes(self) -> list[Route]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/live", self.live, methods=["GET"]),
            Route("/jobs", self.jobs, methods=["GET"]),
            Route("/jobs/{id}", self.job, methods=["GET"]),
            Route("/scheduled", self.later, methods=["GET"]),
            Route("/retries", self.later, methods=["GET"]),
            Route("/actions/{action}", self.act, methods=["POST"]),
            Route("/bulk/confirm", self._bulk.confirm, methods=["POST"]),
            Route("/signin", self.sign_in, methods=["POST"]),
            Route("/signout", self.sign_out, methods=["POST"]),
            Route("/static/{name}", self.static, methods=["GET"]),
            *self._history.routes(),
        ]

    # Pages.

    async def index(self, request: Request) -> Response:
        failed, failed_error = forms.reply_json(
            await self._call(request, "FailedJobs", limit=str(FAILED_SHOWN)), "jobs"
        )
        live = await self._live(request)
        status = live["status"] or {}
        return self._page(request, "index.html", {
            **live,
            "failed": failed or [],
            "failed_error": failed_error,
            "failed_total": status.get("jobs", {}).get(State.FAILED, 0),
            "limits": status.get("limits", {}),
            "paused": status.get("paused", []),
            "refresh_seconds": REFRESH_SECONDS,
            "error_tail": ERROR_TAIL,
            "graph_minutes": GRAPH_MINUTES,
            "graph_refresh": GRAPH_REFRESH_SECONDS,
        })

    async def live(self, request: Request) -> Response:
        """The part of `/` that refreshes itself: a fragment of HTML."""
        context = await self._live(request)
        return self._templates.TemplateResponse(
            request, "_live.html", context, headers=PAGE_HEADERS
        )

    async def _live(self, request: Request) -> dict[str, Any]:
        status, status_error = forms.reply_json(await self._call(request, "Status"))
        listed, queues_error = forms.reply_json(
            await self._call(request, "Queues", limit=str(QUEUES_SHOWN))
        )
        queues = listed["queues"] if listed else []
        present = {state for queue in queues for state in queue["jobs"]}
        return {
            "status": status,
            "status_error": status_error,
            "queues": queues,
            "more_queues": listed["more"] if listed else 0,
            "queues_error": queues_error,
            "states": [state for state in STATE_ORDER if state in present],
            "updated": times.to_seconds(times.utcnow()),
            "can_act": self._may_act(request),
            **await running_pages.running_now(self._call, request, status),
        }

    async def job(self, request: Request) -> Response:
        text = request.path_params["id"]
        try:
            job_id = params.parse_job_id(text)
        except CommandError:
            return self._message(request, 404, "No such job", f"{text!r} is not a jobID.")
        try:
            family = await self._reads.family(job_id)
        except CommandError as error:
            return self._message(request, 503, "The job cannot be read", error.status)
        if family is None:
            return await self._gone(request, job_id)
        job = family.job
        return self._page(request, "job.html", {
            "job": job,
            **await dependency_pages.dependencies(self._call, request, job),
            "parent": family.parent,
            "children": family.children,
            "data": texts.pretty(job.data),
            "next_runs": texts.next_runs(job),
            "deletable": job.state in DELETABLE,
            # A child, or a job waiting for its dependencies (protocol.md 14.25).
            "cancellable": (bool(job.parentJobID) or job.state == State.BLOCKED)
            and job.state in CANCELLABLE,
            # CancelJob with running: true (protocol.md 14.26); a parent
            # with children is refused, as by CancelJob.
            "stoppable": job.state in (State.RUNNING, State.RUNQUEUED)
            and not job.cancelRequested and not family.children,
        })

    async def _gone(self, request: Request, job_id: int) -> Response:
        """A job no longer stored: how it ended, if its outcome is kept."""
        kept = await outcome_pages.kept_outcome(self._call, request, job_id)
        if kept is None:
            return self._message(request, 404, "No such job", f"There is no job {job_id}.")
        return self._page(request, "outcome.html", kept)

    async def jobs(self, request: Request) -> Response:
        """A search: by jobID (to that job's page) or by name pattern."""
        query = request.query_params
        wanted = query.get("id", "").strip()
        if wanted:
            return RedirectResponse(f"/jobs/{quote(wanted, safe='')}", 303)
        pattern = query.get("name", "")
        if not pattern:
            return RedirectResponse("/", 303)
        if (
            len(pattern.encode()) > params.MAX_PATTERN
            or params.has_control(pattern)
            or globmatch.too_many_wildcards(pattern)
            or globmatch.too_many_set_characters(pattern)
        ):
            return self._message(
                request, 400, "Not a name pattern",
                f"A pattern is at most {params.MAX_PATTERN} bytes, without control characters, "
                f"with at most {globmatch.MAX_WILDCARDS} wildcards (*, ? and [...]) "
                f"and {globmatch.MAX_SET_CHARACTERS} characters in its sets.",
            )
        store = self._store
        try:
            found = await self._reads.matching(pattern, FOUND_SHOWN + 1)
        except store.errors as error:
            return self._message(request, 503, "The jobs cannot be searched", str(error))
        return self._page(request, "jobs.html", {
            "pattern": pattern,
            "found": found[:FOUND_SHOWN],
            "more": len(found) > FOUND_SHOWN,
            "shown": FOUND_SHOWN,
        })

    async def later(self, request: Request) -> Response:
        """Scheduled or Retries, by the path (later_pages.py)."""
        view = later_pages.VIEWS[request.url.path]
        try:
            found = await self._reads.later(view.retrying, later_pages.SHOWN, later_pages.COUNTED)
        except self._store.errors as error:
            return self._message(request, 503, "The jobs cannot be read", str(error))
        return self._page(request, "later.html", later_pages.context(view, found))

    async def static(self, request: Request) -> Response:
        found = self._static.get(request.path_params["name"])
        if found is None:
            return Response("not found", 404, media_type="text/plain")
        content, media_type = found
        headers = {"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"}
        return Response(content, media_type=media_type, headers=headers)

    # Actions.

    async def act(self, request: Request) -> Response:
        action = self._actions.get(request.path_params["action"])
        if action is None:
            return self._message(request, 404, "No such action", "Nothing was done.")
        refusal = self._guard(request)
        if refusal is not None:
            return refusal
        form = await forms.read_form(request)
        if form is None:
            return self._message(request, 400, "Not a form", "Nothing was done.")
        try:
            flash = await action(request, form)
        except forms.Refused as error:
            flash = forms.Flash("error", str(error))
        return self._back(form, flash)

    def _guard(self, request: Request) -> Response | None:
        """A page saying why a POST is refused, or None if it may act."""
        refused = self._from_another_site(request)
        if refused is not None:
            return refused
        if not self._may_act(request):
            return self._message(
                request, 401, "Sign in to act",
                "This server has an auth token: paste it in the form above to act.",
            )
        return None

    def _from_another_site(self, request: Request) -> Response | None:
        """A page refusing a form another site's page sent, or None."""
        why = access.cross_site(request)
        if not why:
            return None
        return self._message(request, 403, "Refused", f"Nothing was done: {why}.")

    def _may_act(self, request: Request) -> bool:
        return access.may_act(request, self._token, self._sessions)

    async def sign_in(self, request: Request) -> Response:
        refused = self._from_another_site(request)
        if refused is not None:
            return refused
        form = await forms.read_form(request)
        if form is None:
            return self._message(request, 400, "Not a form", "Nothing was done.")
        if self._token is None:
            nothing = forms.Flash("ok", "This server has no token: nothing to sign in to.")
            return self._back(form, nothing)
        client = peer(request)
        wait = self._throttle.wait(client)
        if wait > 0:
            seconds = math.ceil(wait)
            response = self._message(
                request, 429, "Too many wrong tokens",
                f"Too many wrong tokens from your address: try again in {seconds} s.",
            )
            response.headers["Retry-After"] = str(seconds)
            return response
        if not access.token_matches(form.get("token", "").strip(), self._token):
            self._throttle.failed(client)
            return self._message(request, 401, "Wrong token", "That is not this server's token.")
        self._throttle.succeeded(client)
        # A session the browser brought along is replaced, not kept.
        self._sessions.close(request.cookies.get(access.SESSION_COOKIE, ""))
        response = self._back(form, forms.Flash("ok", "Signed in."))
        access.sign_in(response, self._sessions.open(), self._sessions.lifetime, self._secure)
        return response

    async def sign_out(self, request: Request) -> Response:
        refused = self._from_another_site(request)
        if refused is not None:
            return refused
        form = await forms.read_form(request) or {}
        # Ended here, not only in the browser: a copy of the cookie is dead too.
        self._sessions.close(request.cookies.get(access.SESSION_COOKIE, ""))
        response = self._back(form, forms.Flash("ok", "Signed out."))
        access.sign_out(response, self._secure)
        return response

    # Answers.

    async def _call(self, request: Request, verb: str, **parameters: str) -> WireResponse:
        """A wire command, with the server's token: the dashboard has
        decided already whether this person may ask it."""
        headers = {name.lower(): value for name, value in parameters.items()}
        if self._token is not None:
            headers["authtoken"] = self._token
        answer = await self._dispatcher.dispatch(WireRequest(verb, headers), peer(request))
        return answer.response

    def _page(
        self, request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        flash = forms.flash_of(request)
        response = self._templates.TemplateResponse(
            request, template, {
                **context,
                "flash": flash,
                "here": forms.here(request),
                "needs_token": self._token is not None,
                "can_act": self._may_act(request),
            },
            status_code=status,
            headers=PAGE_HEADERS,
        )
        if flash is not None:
            response.delete_cookie(forms.FLASH_COOKIE, **self._cookie_options())
        return response

    def _message(self, request: Request, status: int, title: str, text: str) -> Response:
        return self._page(request, "message.html", {"title": title, "text": text}, status)

    def _back(self, form: dict[str, str], flash: forms.Flash) -> Response:
        """Back to the page the form was on, carrying `flash` to it."""
        response = RedirectResponse(forms.local(form.get("back", "/")), 303)
        value = quote(f"{flash.kind}:{flash.text[:forms.MAX_FLASH]}", safe="")
        response.set_cookie(forms.FLASH_COOKIE, value, max_age=60, **self._cookie_options())
        return response

    def _cookie_options(self) -> dict[str, Any]:
        return {"httponly": True, "samesite": "strict", "secure": self._secure}


