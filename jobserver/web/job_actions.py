"""The dashboard's actions on one job or one name pattern: a job page's
buttons (requeue, delete, cancel, cancel a run) and the pause, resume and
set-limit forms of `/`.

Apart from dashboard.py, which routes `/actions/{name}` to them after its
guard (access.py): each is one wire command through the dispatcher
(`Dashboard._call`), and what came of it is the one-time message the
page shows (forms.Flash); a refusal is the command's status line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request

from jobserver.web import forms
from jobserver.wire.framing import Response as WireResponse

# The dashboard's way of asking a wire command (Dashboard._call).
Call = Callable[..., Awaitable[WireResponse]]
Action = Callable[[Request, dict[str, str]], Awaitable[forms.Flash]]

# The set-limit form's fields that SetLimit reads (protocol.md 14.7, 14.23),
# and how its message names the switches.
LIMIT_FIELDS = ("max", "rate", "perKey", "fair")
LIMIT_SWITCHES = {"perKey": "per key", "fair": "fair"}


def _limit_set(pattern: str, given: dict[str, str]) -> str:
    """What a SetLimit the server took did: `given` are its fields."""
    shown = [given["max"]] if given.get("max", "0") != "0" else []
    if "rate" in given:
        shown.append(f"rate {given['rate']}")
    shown += [text for name, text in LIMIT_SWITCHES.items() if given.get(name) == "true"]
    if not shown:
        return f"Limit on {pattern} removed."
    return f"Limit on {pattern} set to {', '.join(shown)}."


class JobActions:
    def __init__(self, call: Call) -> None:
        self._call = call

    def actions(self) -> dict[str, Action]:
        """The handlers of `/actions/{name}`, by name."""
        return {
            "requeue": self._requeue,
            "delete": self._delete,
            "cancel": self._cancel,
            "cancel-running": self._cancel_running,
            "pause": self._pause,
            "resume": self._resume,
            "limit": self._set_limit,
        }

    async def _requeue(self, request: Request, form: dict[str, str]) -> forms.Flash:
        job_id = forms.job_id(form)
        reply = await self._call(request, "RequeueJobs", jobIDs=str(job_id))
        if reply.code != 200:
            return forms.Flash("error", f"Job {job_id} was not requeued: {reply.status}")
        # RequeueJobs passes over IDs it does not find: say so.
        found, status = forms.reply_json(await self._call(request, "QueryJob", jobID=str(job_id)))
        if found is None:
            return forms.Flash("error", f"Job {job_id} was not requeued: {status}")
        return forms.Flash("ok", f"Job {job_id} requeued: {found['state']}, due now.")

    async def _delete(self, request: Request, form: dict[str, str]) -> forms.Flash:
        job_id = forms.job_id(form)
        reply = await self._call(request, "DeleteJob", jobID=str(job_id))
        return forms.outcome(reply, f"Job {job_id} deleted.", f"Job {job_id} was not deleted")

    async def _cancel(self, request: Request, form: dict[str, str]) -> forms.Flash:
        job_id = forms.job_id(form)
        reply = await self._call(request, "CancelJob", jobID=str(job_id))
        return forms.outcome(reply, f"Job {job_id} cancelled.", f"Job {job_id} was not cancelled")

    async def _cancel_running(self, request: Request, form: dict[str, str]) -> forms.Flash:
        job_id = forms.job_id(form)
        reply = await self._call(request, "CancelJob", jobID=str(job_id), running="true")
        return forms.outcome(
            reply, f"Job {job_id} will be cancelled: its worker is told at its next report.",
            f"Job {job_id} was not cancelled",
        )

    async def _pause(self, request: Request, form: dict[str, str]) -> forms.Flash:
        pattern = forms.field(form, "name")
        reply = await self._call(request, "PauseJobs", name=pattern)
        return forms.outcome(reply, f"Paused {pattern}.", f"{pattern} was not paused")

    async def _resume(self, request: Request, form: dict[str, str]) -> forms.Flash:
        pattern = forms.field(form, "name")
        reply = await self._call(request, "ResumeJobs", name=pattern)
        return forms.outcome(reply, f"Resumed {pattern}.", f"{pattern} was not resumed")

    async def _set_limit(self, request: Request, form: dict[str, str]) -> forms.Flash:
        pattern = forms.field(form, "name")
        # The fields given, as they are: SetLimit judges them, and its
        # refusal is the message.
        given = {
            name: form[name].strip() for name in LIMIT_FIELDS if form.get(name, "").strip()
        }
        reply = await self._call(request, "SetLimit", name=pattern, **given)
        failed = f"The limit on {pattern} was not set"
        return forms.outcome(reply, _limit_set(pattern, given), failed)
