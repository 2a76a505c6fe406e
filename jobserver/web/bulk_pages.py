"""The dashboard's bulk actions (protocol.md 14.19): requeue or delete
every failed job of a selection or a name pattern, take every queued job
of a queue out of it, and pause or resume a queue from its row.

A bulk action is asked in two steps. The first form (on `/`) posts to
`/bulk/confirm`, which changes nothing: it runs the command's dry run and
shows how many jobs it would act on, the first of them, and a Confirm
button. That button posts to `/actions/bulk` (Dashboard.act: the same
guard as every action) with the selection and the jobIDs the dry run
found (`shown`, at most 1,000), and the command acts on those jobs alone,
by jobIDs: a job that matched only since the confirmation is left for
another, and one that left the state meanwhile is passed over (the
command's fence) and counted. Both steps go through the dispatcher as the
wire commands do (`Dashboard._call`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response

from jobserver.core.commands import params
from jobserver.core.errors import CommandError
from jobserver.web import forms
from jobserver.web.incoming import read_body
from jobserver.wire.counts import counted, noun_for
from jobserver.wire.limits import MAX_BULK

if TYPE_CHECKING:
    from jobserver.web.dashboard import Dashboard

# A selection of checked failed jobs: at most this many jobIDs, more than
# the failed table shows (dashboard.FAILED_SHOWN), within forms.MAX_FORM
# (20 bytes a jobID, percent-encoded comma included).
MAX_SELECTED = 500
# The confirmation page lists this many of the jobs it would act on.
LISTED = 20


@dataclass(frozen=True)
class Command:
    verb: str
    # What the pages say: "Requeue 12 failed jobs", "1 failed job requeued".
    asked: str
    done: str
    # One of the jobs it acts on, as the pages count them.
    job: str


COMMANDS = {
    "requeue-failed": Command("RequeueFailedJobs", "Requeue", "requeued", "failed job"),
    "delete-failed": Command("DeleteFailedJobs", "Delete", "deleted", "failed job"),
    "cancel-queued": Command("CancelQueuedJobs", "Cancel", "cancelled", "queued job"),
}


def glob_literal(text: str) -> str:
    """`text` as a GLOB pattern that matches exactly it: GLOB has no escape
    character, but a set of one character is that character."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def queue_patterns(queue: str) -> tuple[str, str]:
    """What pausing a queue pauses: its own name, and every name under it."""
    literal = glob_literal(queue)
    return literal, f"{literal}/*"


def queue_paused(queue: str, paused: list[str]) -> bool:
    """Whether a queue's button has paused it (both its patterns)."""
    return all(pattern in paused for pattern in queue_patterns(queue))


class BulkPages:
    def __init__(self, dashboard: Dashboard) -> None:
        self._dashboard = dashboard

    def actions(self) -> dict[str, Any]:
        """The actions Dashboard.act runs, by their /actions/ name."""
        return {
            "bulk": self._act,
            "pause-queue": self._pause_queue,
            "resume-queue": self._resume_queue,
        }

    async def confirm(self, request: Request) -> Response:
        """POST /bulk/confirm: the dry run's count, and a Confirm button."""
        board = self._dashboard
        refusal = board._guard(request)
        if refusal is not None:
            return refusal
        try:
            form = await _read_selection_form(request)
            if form is None:
                return board._message(request, 400, "Not a form", "Nothing was done.")
            command, selection = _asked(form)
        except forms.Refused as error:
            return board._message(request, 400, "Nothing to confirm", str(error))
        reply = await board._call(request, command.verb, dryRun="true", **selection)
        if reply.code != 200:
            return board._message(request, 400, "Nothing to confirm", reply.status)
        found = json.loads(reply.body)
        return board._page(
            request,
            "bulk_confirm.html",
            {
                "command": command,
                "command_name": form["command"],
                "selection": selection,
                "what": _described(selection),
                "found": found,
                "listed": found["jobIDs"][:LISTED],
            },
        )

    async def _act(self, request: Request, form: dict[str, str]) -> forms.Flash:
        command, selection = _asked(form)
        shown = _shown(form)
        reply = await self._dashboard._call(request, command.verb, jobIDs=shown)
        what = _described(selection)
        if reply.code != 200:
            return forms.Flash("error", f"Nothing was {command.done}: {reply.status}")
        found = json.loads(reply.body)
        text = f"{counted(found['acted'], command.job)} {what} {command.done}."
        if found.get("skipped"):
            skipped = found["skipped"]
            left = noun_for(skipped, "it is", "they are")
            text += f" {skipped} had changed since the confirmation: left as {left}."
        return forms.Flash("ok", text)

    async def _pause_queue(self, request: Request, form: dict[str, str]) -> forms.Flash:
        queue = forms.field(form, "queue")
        paused: list[str] = []
        for pattern in queue_patterns(queue):
            reply = await self._dashboard._call(request, "PauseJobs", name=pattern)
            if reply.code != 200:
                # Not half paused (`q` held, `q/*` not) behind a row that
                # offers Pause again: the first pattern is resumed.
                for done in paused:
                    await self._dashboard._call(request, "ResumeJobs", name=done)
                return forms.Flash("error", f"Queue {queue} was not paused: {reply.status}")
            paused.append(pattern)
        return forms.Flash("ok", f"Queue {queue} paused: {' and '.join(paused)}.")

    async def _resume_queue(self, request: Request, form: dict[str, str]) -> forms.Flash:
        queue = forms.field(form, "queue")
        for pattern in queue_patterns(queue):
            reply = await self._dashboard._call(request, "ResumeJobs", name=pattern)
            if reply.code != 200:
                return forms.Flash("error", f"Queue {queue} was not resumed: {reply.status}")
        return forms.Flash("ok", f"Queue {queue} resumed.")


def _asked(form: dict[str, str]) -> tuple[Command, dict[str, str]]:
    """The command a form asks for, and its one selection as the wire
    command's parameters: name, queue or jobIDs."""
    command = COMMANDS.get(form.get("command", ""))
    if command is None:
        raise forms.Refused("Nothing was done: no such bulk action.")
    given = {
        key: form[key].strip() for key in ("name", "queue", "jobIDs") if form.get(key, "").strip()
    }
    if len(given) != 1:
        raise forms.Refused("Nothing was done: check some jobs, or give a pattern.")
    if "jobIDs" in given:
        given["jobIDs"] = ",".join(map(str, _job_ids(given["jobIDs"])))
    return command, given


def _job_ids(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) > MAX_SELECTED:
        raise forms.Refused(f"Nothing was done: at most {MAX_SELECTED} jobs at once.")
    try:
        return [params.parse_job_id(part) for part in parts]
    except CommandError:
        raise forms.Refused("Nothing was done: a selection of jobIDs only.") from None


def _shown(form: dict[str, str]) -> str:
    """The jobIDs the confirmation showed (`shown`), checked: the only jobs
    the action may act on."""
    parts = forms.field(form, "shown").split(",")
    if len(parts) > MAX_BULK:
        raise forms.Refused(f"Nothing was done: at most {MAX_BULK} jobs at once.")
    try:
        return ",".join(str(params.parse_job_id(part.strip())) for part in parts)
    except CommandError:
        raise forms.Refused("Nothing was done: confirm from the confirmation page.") from None


def _described(selection: dict[str, str]) -> str:
    if "name" in selection:
        return f"matching {selection['name']}"
    if "queue" in selection:
        return f"of queue {selection['queue']}"
    return "selected"


async def _read_selection_form(request: Request) -> dict[str, str] | None:
    """A bulk form: as forms.read_form, but the checked `jobID` boxes (up
    to MAX_SELECTED, else Refused) joined into one `jobIDs` field."""
    body = await read_body(request, forms.MAX_FORM)
    if body is None:
        return None
    if body.count(b"&") >= MAX_SELECTED + forms.MAX_FORM_FIELDS:
        raise forms.Refused(f"Nothing was done: at most {MAX_SELECTED} jobs at once.")
    try:
        fields = parse_qs(
            body.decode("ascii"),
            keep_blank_values=True,
            errors="strict",
            max_num_fields=MAX_SELECTED + forms.MAX_FORM_FIELDS,
        )
    except ValueError:
        return None
    form = {name: values[-1] for name, values in fields.items() if name != "jobID"}
    checked = fields.get("jobID", [])
    if checked:
        form["jobIDs"] = ",".join(checked)
    return form
