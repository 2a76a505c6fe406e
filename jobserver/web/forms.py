"""The dashboard's forms: reading one within its bounds, the fields an
action needs, what a command's reply holds, the one-time message that
tells what came of it, and where a redirect may lead (never to another
site)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

from starlette.requests import Request

from jobserver.core.commands import params
from jobserver.core.errors import CommandError
from jobserver.web.incoming import read_body
from jobserver.wire.framing import Response as WireResponse

# A form's body: a 255-byte pattern, percent-encoded, and room to spare.
MAX_FORM = 16 * 1024
MAX_FORM_FIELDS = 16
# The one-time message after an action: long enough for a status line.
FLASH_COOKIE = "jobserver_flash"
MAX_FLASH = 500


@dataclass(frozen=True)
class Flash:
    kind: str  # "ok" or "error"
    text: str


class Refused(Exception):
    """A form asks for something that is not done; its text says why."""


def reply_json(reply: WireResponse, key: str | None = None) -> tuple[Any, str]:
    """(the reply's body, or `key` of it; "") for a 200, (None, status line) otherwise."""
    if reply.code != 200:
        return None, reply.status
    body = json.loads(reply.body)
    return (body if key is None else body[key]), ""


def outcome(reply: WireResponse, done: str, failed: str) -> Flash:
    if reply.code == 200:
        return Flash("ok", done)
    return Flash("error", f"{failed}: {reply.status}")


def field(form: dict[str, str], name: str) -> str:
    value = form.get(name, "")
    if not value:
        raise Refused(f"Nothing was done: {name} is missing.")
    return value


def job_id(form: dict[str, str]) -> int:
    text = field(form, "jobID").strip()
    try:
        return params.parse_job_id(text)
    except CommandError:
        raise Refused(f"Nothing was done: {text!r} is not a jobID.") from None


async def read_form(request: Request) -> dict[str, str] | None:
    """An urlencoded form's fields (the last value of each), or None for a
    body that is too large or not such a form."""
    body = await read_body(request, MAX_FORM)
    if body is None:
        return None
    try:
        fields = parse_qs(
            body.decode("ascii"), keep_blank_values=True, errors="strict",
            max_num_fields=MAX_FORM_FIELDS,
        )
    except ValueError:  # not ASCII, not UTF-8 once decoded, or too many fields
        return None
    return {name: values[-1] for name, values in fields.items()}


def flash_of(request: Request) -> Flash | None:
    kind, _, text = unquote(request.cookies.get(FLASH_COOKIE, "")).partition(":")
    if kind not in ("ok", "error") or not text:
        return None
    return Flash(kind, text[:MAX_FLASH])


def here(request: Request) -> str:
    """Where a sign-in on this page comes back to: the page, if it is one
    a GET shows again."""
    if request.method != "GET":
        return "/"
    query = request.url.query
    return local(request.url.path + (f"?{query}" if query else ""))


def local(path: str) -> str:
    """`path` if it is a path on this server, else `/`: a redirect never
    leads to another site (`//evil.example`, `/\\evil.example`)."""
    if not path.startswith("/") or path.startswith("//"):
        return "/"
    if "\\" in path or any(c.isspace() or not c.isprintable() for c in path):
        return "/"
    return path


