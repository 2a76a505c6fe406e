"""The HTTP side (`jobserver serve --http-port`): an ASGI application,
served by Hypercorn inside the server's own trio run.

It speaks through the same dispatcher as the wire protocol, so an HTTP
request is checked, stored and answered exactly as the wire command it
stands for. Routes:

- `POST /queue`: Jobber's contract. `{"type": NAME, "payload": {...}}`
  creates a job named NAME with the payload as its data: `201` with
  `{"job-id": "<jobID>"}`. CreateJob's other parameters may go beside
  them (priority, maxAttempts, retryAfter, unique, key, repeat, ...), and
  `delay`, seconds before it is first due, checked against the OpenAPI
  document as /api's are. A body that is not that gets `400`, and
  nothing is stored.
- `POST /api/<Command>`: any wire command (protocol.md section 5 and 14)
  with its parameters as a JSON object, checked first against the OpenAPI
  document (openapi.py): an unknown parameter, or one of the wrong type or
  range, is `400` saying which. The HTTP status is
  HTTP's own for the wire reply (statuses.py; `Jobserver-Status` holds the
  wire's status line), the body the wire reply's body: JSON, or text for
  Query's list format, or `{"status": ...}` when the wire reply has none.

  Every refusal of both routes has one shape: `{"status": LINE, "error":
  WHY}` (on /api, a wire refusal without a body of its own: `{"status":
  LINE}`), LINE in `Jobserver-Status` too: the wire's status line, or
  HTTP's own (`400 Bad Request`) for what the HTTP side refuses before any
  command runs (access.refusal), the router's `405` for a method other
  than POST included.
- `GET /metrics`: Prometheus' text format (metrics.py).
- `GET /healthz`: `200` when the database answers, `503` otherwise. It
  needs no token, so that a load balancer can ask.
- `GET /openapi.json`: the OpenAPI document of all this (openapi.py), with
  no token: it holds nothing of the queue.
- `GET /` and the pages and forms under it: the dashboard (dashboard.py).

With an auth token, every route but /healthz, /openapi.json and the
dashboard wants `Authorization: Bearer TOKEN` and answers `401` without
it; the dashboard may be looked at without it, but acts only for a person
who gave it. Token or not, every request must name this server in its
Host (else `421`), and the JSON routes refuse what another site's page
could send: a body not declared `application/json` (`415`), an Origin or
Sec-Fetch-Site of another site (`403`). All of that is access.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar

import trio
from jsonschema import Draft202012Validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from jobserver.core.build import Core
from jobserver.core.commands import json_params
from jobserver.core.commands.dispatch import PARSE_IN_THREAD_BYTES
from jobserver.core.commands.json_params import MAX_DATA
from jobserver.core.commands.route import Answer
from jobserver.model import times
from jobserver.web import access, openapi, schema_errors, statuses
from jobserver.web.dashboard import Dashboard
from jobserver.web.incoming import peer, read_body
from jobserver.web.metrics import CONTENT_TYPE, Metrics
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request

_Read = TypeVar("_Read")

LONE_SURROGATE = "a lone surrogate (\\ud800 to \\udfff), which is not text"

# The largest body POST /queue reads: a payload as large as a job's data
# may be, and room for the envelope.
MAX_BODY = MAX_DATA + 64 * 1024


def build(
    core: Core,
    auth_token: str | None,
    secure: bool,
    host_names: Iterable[str],
    session_seconds: float,
) -> Starlette:
    """The application, answering through the core's dispatcher; `secure` when it
    is served over TLS (the dashboard's cookies are then Secure);
    `host_names` the names it answers to besides IP addresses and
    localhost (--http-host); `session_seconds` the dashboard's
    sessions' lifetime (--session-lifetime)."""
    dispatcher = core.dispatcher
    validators = _validators()
    jobber = Draft202012Validator(openapi.queue_schema())

    async def queue(request: HttpRequest) -> JSONResponse:
        refused = access.api_refusal(request, auth_token)
        if refused is not None:
            return refused
        body = await read_body(request, MAX_BODY)
        if body is None:
            return access.refusal(413, f"the body is larger than {MAX_BODY} bytes")
        due_from = dispatcher.services.engine.now()
        job, problem = await read_json(body, partial(_jobber_job, body, jobber, due_from))
        if job is None:
            return access.refusal(400, problem)
        if auth_token is not None:
            job.headers["authtoken"] = auth_token
        answer = await dispatcher.dispatch(job, peer(request))
        status = answer.response.status
        if answer.response.code == 200:
            job_id = json.loads(answer.response.body)["jobID"]
            return JSONResponse({"job-id": str(job_id)}, status_code=201)
        # Jobber's clients read `error`; the line is in `status` too, as /api's.
        return JSONResponse(
            {"status": status, "error": status}, statuses.http_status(status),
            headers={"Jobserver-Status": status},
        )


    async def api(request: HttpRequest) -> Response:
        refused = access.api_refusal(request, auth_token)
        if refused is not None:
            return refused
        body = await read_body(request, MAX_BODY)
        if body is None:
            return access.refusal(413, f"the body is larger than {MAX_BODY} bytes")
        verb = _command_named(request.path_params["command"])
        if verb == "Backup" and auth_token is None:
            # A browser on this machine can send what the server then
            # writes: a file is written only for a holder of the token.
            return access.refusal(403, "Backup over HTTP needs the token: start the server "
                                  "with --auth-token-file, or use the wire port from this machine")
        command, problem = await read_json(
            body, partial(_api_command, verb, body, validators.get(verb))
        )
        if command is None:
            return access.refusal(400, problem)
        if auth_token is not None:
            command.headers["authtoken"] = auth_token
        answer = await dispatcher.dispatch(command, peer(request))
        return _wire_reply(answer)

    async def read_json(body: bytes, read: Callable[[], _Read]) -> _Read:
        """read(), which parses `body`: in a thread when the body is large,
        as a wire command's large JSON is (dispatch.parse_large_json)."""
        if len(body) <= PARSE_IN_THREAD_BYTES:
            return read()
        return await trio.to_thread.run_sync(
            _collection_paused, read, limiter=dispatcher.services.json_parsing
        )

    metrics = Metrics(core, auth_token)

    async def scrape(request: HttpRequest) -> Response:
        if not access.bearer(request, auth_token):
            return access.refusal(401, "missing or wrong bearer token")
        code, text = await metrics.render(peer(request))
        return Response(text, code, media_type=CONTENT_TYPE)

    async def healthz(request: HttpRequest) -> JSONResponse:
        headers = {"authtoken": auth_token} if auth_token is not None else {}
        answer = await dispatcher.dispatch(Request("Status", headers), peer(request))
        if answer.response.code == 200:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": answer.response.status}, status_code=503)

    described = openapi.document()

    async def openapi_json(request: HttpRequest) -> JSONResponse:
        return JSONResponse(described)

    return Starlette(
        routes=[
            Route("/openapi.json", openapi_json, methods=["GET"]),
            Route("/queue", queue, methods=["POST"]),
            Route("/api/{command}", api, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", scrape, methods=["GET"]),
            *Dashboard(core, auth_token, secure, session_seconds).routes(),
        ],
        middleware=[Middleware(access.KnownHostsOnly, names=host_names)],
        exception_handlers={HTTPException: _routing_refusal},
    )


def _routing_refusal(request: HttpRequest, error: Exception) -> Response:
    """A refusal of the router's own (a GET of /api/Ping: 405; /api/a/b:
    404): on /api and /queue, in the shape of every other refusal there;
    elsewhere (the dashboard's pages) as Starlette words it."""
    assert isinstance(error, HTTPException)
    path = request.url.path
    if path == "/queue" or path.startswith("/api/"):
        why = "takes POST alone" if error.status_code == 405 else "names no command"
        refused = access.refusal(error.status_code, f"{path} {why}")
        refused.headers.update(error.headers or {})
        return refused
    return PlainTextResponse(error.detail, error.status_code, headers=error.headers)


def _validators() -> dict[str, Draft202012Validator]:
    return {
        command: Draft202012Validator(openapi.body_schema(command) or {})
        for command in openapi.COMMANDS
    }


# What an /api path that names no command is dispatched as: no verb, so
# that it is answered `430 Unrecognized command` and nothing else of the
# path is read (the wire would read `Backup x` as Backup).
_NO_COMMAND = "?"


def _command_named(given: str) -> str:
    """The command's name as the document spells it (the wire reads verbs
    in any case), or _NO_COMMAND if it is none of them."""
    for command in openapi.COMMANDS:
        if command.lower() == given.lower():
            return command
    return _NO_COMMAND


def _collection_paused(read: Callable[[], _Read]) -> _Read:
    with jsonbody.collection_paused():
        return read()


def _api_command(
    verb: str, body: bytes, validator: Draft202012Validator | None
) -> tuple[Request | None, str]:
    """The wire request an /api body stands for, or (None, what is wrong)."""
    document, problem = _json_object(body)
    if any(name.lower() == "connection" for name in document):
        problem = "Connection: wait is not offered over HTTP: use the wire protocol"
    elif not problem and validator is not None:
        problem = _invalid(validator, document)
    if problem:
        return None, problem
    return _request(verb, document), ""


def _json_object(
    body: bytes, shape: str = "a JSON object of the command's parameters"
) -> tuple[dict[str, Any], str]:
    document, problem = _parse_body(body or b"{}")
    if problem:
        return {}, problem
    if not isinstance(document, dict):
        return {}, f"the body must be {shape}"
    for key, value in document.items():
        # Never echoed: the error message must itself be UTF-8.
        if jsonbody.has_lone_surrogate(key):
            return {}, f"a parameter's name holds {LONE_SURROGATE}"
        if isinstance(value, str) and jsonbody.has_lone_surrogate(value):
            return {}, f"{key}: holds {LONE_SURROGATE}"
    return document, ""


def _parse_body(body: bytes) -> tuple[Any, str]:
    """(the body's JSON value, "") or (None, what is wrong): UTF-8, strict
    JSON, nested at most jsonbody's limit (checked before parsing)."""
    try:
        return jsonbody.parse(body.decode("utf-8")), ""
    except jsonbody.TooDeep as error:
        return None, f"the body is {error}"
    except (ValueError, UnicodeDecodeError):
        return None, "the body is not JSON"


def _invalid(validator: Draft202012Validator, document: dict[str, Any]) -> str:
    """What is wrong with a body, by the OpenAPI document; "" if nothing."""
    return schema_errors.explain(validator.iter_errors(document))


def _request(verb: str, document: dict[str, Any]) -> Request:
    """A JSON object of parameters as a wire request (names lower-cased;
    objects and arrays as compact JSON text, known parsed, booleans as
    true/false, null as absent)."""
    request = Request(verb)
    for name, value in document.items():
        if value is None:
            continue
        if isinstance(value, dict | list):
            # A lone surrogate inside stays escaped. Parsed with the body:
            # the command does not parse it again.
            json_params.with_json_value(request, name.lower(), jsonbody.compact(value), value)
            continue
        text = str(value) if not isinstance(value, bool) else "true" if value else "false"
        request.headers[name.lower()] = text
    return request


def _wire_reply(answer: Answer) -> Response:
    """The wire reply in HTTP's terms: HTTP's status for it (statuses.py),
    the status line in `Jobserver-Status`, the body the wire's, or
    `{"status": ...}` when it has none. A refusal is JSON whatever the
    wire's body: one whose body is text (Query's error) has it in `error`."""
    reply = answer.response
    code = statuses.http_status(reply.status)
    status = {"Jobserver-Status": reply.status}
    if not reply.body:
        return JSONResponse({"status": reply.status}, code, headers=status)
    is_json = reply.body[:1] in (b"{", b"[")
    if code >= 400 and not is_json:
        error = reply.body.decode("utf-8", "replace")
        return JSONResponse({"status": reply.status, "error": error}, code, headers=status)
    kind = "application/json" if is_json else "text/plain; charset=utf-8"
    return Response(reply.body, code, headers=status, media_type=kind)


def _jobber_job(
    body: bytes, validator: Draft202012Validator, due_from: datetime
) -> tuple[Request | None, str]:
    """(the CreateJob a /queue body stands for, "") or (None, what is
    wrong): `type` its name, `payload` its data, CreateJob's other
    parameters as /api's, and `delay` seconds after `due_from` its firstRun."""
    document, problem = _json_object(body, 'a JSON object: {"type": ..., "payload": {...}}')
    if not problem:
        problem = _invalid(validator, document)
    if not problem and document.get("delay") is not None and document.get("firstRun"):
        problem = "delay: give firstRun or delay, not both"
    if problem:
        return None, problem
    parameters = {key: value for key, value in document.items() if key not in _JOBBER_OWN}
    parameters["name"] = document["type"]
    parameters["data"] = document.get("payload") or {}
    delay = document.get("delay")
    if delay is not None:
        parameters["firstRun"] = times.to_seconds(_whole_second_after(due_from, delay))
    return _request("CreateJob", parameters), ""


# What POST /queue reads itself; the rest are CreateJob's.
_JOBBER_OWN = ("type", "payload", "delay")


def _whole_second_after(moment: datetime, seconds: int) -> datetime:
    """`seconds` after `moment`, rounded up to a whole second (a stored time
    has none smaller): never due before the delay has passed."""
    later = moment + timedelta(seconds=seconds)
    if later.microsecond:
        later += timedelta(microseconds=1_000_000 - later.microsecond)
    return later
