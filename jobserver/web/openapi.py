"""GET /openapi.json: the HTTP side described as OpenAPI 3.1.

Each wire command is an operation `POST /api/<Command>` whose body is its
parameters (protocol.md has what each means). The table below is the one
place they are listed for HTTP, and the API checks each body against it
(app.py): a parameter it does not list, or of the wrong type or range, is
refused with 400 before the command runs. tests/test_openapi.py runs
schemathesis against the document and a real server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobserver import __version__
from jobserver.model.limits import MAX_KEY, MAX_RATE
from jobserver.web import statuses
from jobserver.wire.limits import (
    MAX_BULK,
    MAX_DEPENDENCIES,
    MAX_FINISH_JOBS,
    MAX_IDEMPOTENCY_KEY,
    MAX_JOB_ID,
    MAX_LEASE,
    MIN_LEASE,
    PRIORITIES,
)

Schema = dict[str, Any]

NAME: Schema = {"type": "string", "minLength": 1, "maxLength": 255}
PATTERN: Schema = {"type": "string", "minLength": 1, "maxLength": 12750}
JOB_ID: Schema = {"type": "integer", "minimum": 1, "maximum": MAX_JOB_ID}
OBJECT: Schema = {"type": "object"}
TIME: Schema = {"type": "string", "examples": ["2030-01-01 04:00:00"]}
RULE: Schema = {"type": "string", "examples": ["FINISHED, +1 HOUR"]}
LEASE: Schema = {"type": "string", "examples": ["+5 MINUTES"]}
LEASE_ID: Schema = {"type": "string"}
FLAG: Schema = {"type": "boolean"}
PRIORITY: Schema = {"type": "integer", "enum": sorted(PRIORITIES)}
SECONDS: Schema = {"type": "number", "minimum": 0, "maximum": 99_999_999}
TEXT: Schema = {"type": "string"}


@dataclass(frozen=True)
class Param:
    name: str
    schema: Schema
    text: str
    required: bool = False


def _object_of(params: list[Param]) -> Schema:
    """A JSON object of these parameters (a request's body, or an element
    of CreateJobs' and FinishJobs' lists). `null` is a parameter left out."""
    return {
        "type": "object",
        "properties": {
            p.name: {"anyOf": [p.schema, {"type": "null"}], "description": p.text}
            for p in params
        },
        "required": [p.name for p in params if p.required],
        "additionalProperties": False,
    }


# The bulk actions' parameters (protocol.md 14.19): one of name, queue, jobIDs.
_BULK = [
    Param("name", PATTERN, "a GLOB pattern, or a comma list of exact names"),
    Param("queue", {**NAME, "pattern": "^[^/]*$"}, "a queue: its name, and names under it and /"),
    Param("jobIDs", {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$", "examples": ["12,13"]},
          f"comma-separated jobIDs, at most {MAX_BULK}"),
    Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_BULK},
          "act on at most this many jobs"),
    Param("dryRun", FLAG, "act on none: count them and list those it would act on"),
]


def _job_id(text: str = "the job") -> Param:
    return Param("jobID", JOB_ID, text, required=True)


_LEASE_ID = Param("leaseID", LEASE_ID, "the lease token the job was handed out with (14.3)")
_RETRY_POLICY = [
    Param("maxAttempts", {"type": "integer", "minimum": 1, "maximum": 10_000},
          "attempts before the job fails for good (14.1)"),
    Param("retryBackoff", {"type": "string", "enum": ["fixed", "exponential"]},
          "how the delay between attempts grows"),
    Param("retryDelay", SECONDS, "seconds before the second attempt"),
    Param("retryMaxDelay", SECONDS, "the longest delay between attempts"),
]
_NEW_JOB = [
    Param("name", NAME, "the job's name", required=True),
    Param("data", OBJECT, "the job's data"),
    Param("firstRun", TIME, "when the job is first due (4.3)"),
    Param("repeat", RULE, "run again after each run: Bedrock's rules, or CRON and five "
          "fields (section 6)"),
    Param("jobPriority", PRIORITY, "higher runs first"),
    Param("priority", PRIORITY, "the same as jobPriority"),
    Param("retryAfter", LEASE, "a lease: handed out again if not reported by then (7)"),
    Param("parentJobID", {"type": "integer", "minimum": 0, "maximum": MAX_JOB_ID},
          "the parent job, 0 for none (8)"),
    Param("unique", FLAG, "reuse a queued job of the same name instead of creating one"),
    Param("overwrite", FLAG, "with unique: replace that job's data"),
    *_RETRY_POLICY,
    Param("cost", {"type": "integer", "minimum": 1, "maximum": 1_000_000},
          "what the job counts against concurrency limits (14.7)"),
    # maxLength counts characters; the server counts the key's bytes.
    Param("key", {"type": "string", "maxLength": MAX_KEY, "examples": ["customer-17"]},
          f"whose job it is, at most {MAX_KEY} bytes, for per-key and fair limits (14.23)"),
    Param("timeWindows", {"type": "string", "examples": ["22:00-06:00"]},
          "when the job may run, HH:MM-HH:MM, comma-separated (14.8)"),
    Param("timeZone", {"type": "string", "examples": ["Europe/Paris"]},
          "the zone of the time windows and of a CRON repeat (6.1, 14.8)"),
    Param("dependsOn", {
        "type": "array", "maxItems": MAX_DEPENDENCIES,
        "items": {"oneOf": [
            {"type": "integer", "minimum": 1, "maximum": MAX_JOB_ID},
            {"type": "string", "pattern": "^#(0|[1-9][0-9]{0,8})$"},
        ]},
        "examples": [[12, 13], ["#0", "#1"]],
    }, "the jobs this one waits for: jobIDs, and in CreateJobs \"#N\" for element N of "
       "the same request (14.25)"),
    Param("onDependencyFailure", {"type": "string", "enum": ["fail", "cancel", "run"]},
          "when a dependency fails, is cancelled or deleted: fail (the default), cancel, or "
          "run anyway (14.25)"),
]
_IDEMPOTENCY_KEY = Param(
    "idempotencyKey", {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY},
    "sent again with this key, the request creates nothing and gets the first one's reply "
    "(14.22)",
)
_FINISH = [_job_id(), Param("data", OBJECT, "replace the job's data"), _LEASE_ID]
_RETRY = [
    _job_id(),
    Param("data", OBJECT, "replace the job's data"),
    Param("name", NAME, "rename the job"),
    Param("jobPriority", PRIORITY, "a new priority"),
    Param("nextRun", TIME, "when it is due again"),
    Param("delay", {"type": "integer", "minimum": 0, "maximum": 99_999_999},
          "seconds from now before it is due again"),
    Param("ignoreRepeat", FLAG, "do not use the repeat rule for the next run"),
    _LEASE_ID,
]
_FAIL = [
    _job_id(),
    Param("data", OBJECT, "replace the job's data"),
    Param("error", TEXT, "why it failed: the job's last error"),
    _LEASE_ID,
    # Used only when the job has no policy of its own (14.1).
    *_RETRY_POLICY,
]


def _reports_of(params: list[Param], command: str) -> Param:
    """The `jobs` of FinishJobs, FailJobs or RetryJobs: `command`'s
    parameters for each job."""
    return Param(
        "jobs",
        {"type": "array", "items": _object_of(params), "minItems": 1,
         "maxItems": MAX_FINISH_JOBS},
        f"{command}'s parameters for each job", required=True,
    )

_TAKE = [
    Param("name", PATTERN, "GLOB patterns or exact names, comma-separated", required=True),
    Param("jobPriority", PRIORITY, "only jobs of this priority"),
    Param("includeLeaseID", FLAG, "show the lease token in the reply"),
    Param("lease", {"type": "integer", "minimum": MIN_LEASE, "maximum": MAX_LEASE},
          "seconds the worker holds each job: due again when they end unless TouchJob "
          "renews them or the job is reported (14.24)"),
]

# Command -> (summary, protocol.md section, parameters).
COMMANDS: dict[str, tuple[str, str, list[Param]]] = {
    "CreateJob": ("Create a job", "5.1", [*_NEW_JOB, _IDEMPOTENCY_KEY]),
    "CreateJobs": ("Create several jobs in one transaction", "5.2", [
        Param("jobs", {"type": "array", "items": _object_of(_NEW_JOB), "minItems": 1},
              "CreateJob's parameters for each job", required=True),
        _IDEMPOTENCY_KEY,
    ]),
    "GetJob": ("Take the next due job (never waits over HTTP)", "5.3", _TAKE),
    "GetJobs": ("Take up to numResults due jobs", "5.4", [
        *_TAKE,
        Param("numResults", {"type": "integer", "minimum": 1, "maximum": 1000},
              "how many jobs at most", required=True),
    ]),
    "QueryJob": ("Show a job and its state", "5.5", [_job_id()]),
    "UpdateJob": ("Change a job's data, repeat, priority or next run", "5.6", [
        _job_id(),
        Param("data", OBJECT, "the new data", required=True),
        Param("repeat", RULE, "a new repeat rule"),
        Param("jobPriority", PRIORITY, "a new priority"),
        Param("nextRun", TIME, "when it is next due"),
        Param("shouldClearRepeat", FLAG, "remove its repeat rule"),
        Param("timeZone", {"type": "string", "examples": ["Europe/Paris"]},
              "a new zone for its time windows and CRON repeat (6.1, 14.8)"),
        _LEASE_ID,
    ]),
    "FinishJob": ("Report a job done", "5.7", _FINISH),
    "FinishJobs": ("Report many jobs done in one request", "14.15", [
        _reports_of(_FINISH, "FinishJob"),
    ]),
    "RetryJob": ("Put a job that was handed out back in the queue", "5.8", _RETRY),
    "RetryJobs": ("Put many jobs that were handed out back in the queue", "14.15", [
        _reports_of(_RETRY, "RetryJob"),
    ]),
    "FailJob": ("Report a job failed", "5.9", _FAIL),
    "FailJobs": ("Report many jobs failed in one request", "14.15", [
        _reports_of(_FAIL, "FailJob"),
    ]),
    "CancelJob": ("Cancel a queued child job, or with running any running job", "5.10", [
        _job_id(),
        Param("running", FLAG,
              "also a RUNNING or RUNQUEUED job: its worker's next report is answered "
              "410 Job cancelled and it ends CANCELLED (14.26)"),
    ]),
    "CancelledJobs": ("Which of these running jobs have a cancel pending", "14.26", [
        Param("jobIDs", {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$",
                         "examples": ["12,13"]},
              "comma-separated jobIDs, at most 1,000", required=True),
    ]),
    "DeleteJob": ("Delete a job that is not running", "5.11", [_job_id()]),
    "RequeueJobs": ("Put jobs back in the queue whatever their state", "5.12", [
        Param("jobIDs", {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$",
                         "examples": ["12,13"]},
              "comma-separated jobIDs", required=True),
        Param("name", NAME, "rename every listed job"),
    ]),
    "Ping": ("Check that the server answers", "5.13", []),
    "Status": ("The server's figures", "5.14", []),
    "Query": ("Run read-only SQL (loopback peers only, unless allowed)", "5.15", [
        Param("query", TEXT, "one SQL statement that reads", required=True),
        Param("format", {"type": "string", "enum": ["json"]}, "json: rows as JSON"),
    ]),
    "TouchJob": ("Renew a running job's lease", "14.4", [
        _job_id(), _LEASE_ID,
        Param("lease", {"type": "integer", "minimum": MIN_LEASE, "maximum": MAX_LEASE},
              "seconds a lease is renewed by from now on; needs leaseID (14.4)"),
    ]),
    "FailedJobs": ("List the dead set with last errors", "14.5", [
        Param("name", PATTERN, "which jobs"),
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, "at most this many"),
    ]),
    "RequeueFailedJobs": ("Requeue FAILED jobs by pattern, queue or jobIDs", "14.19", _BULK),
    "DeleteFailedJobs": ("Delete FAILED jobs by pattern, queue or jobIDs", "14.19", _BULK),
    "CancelQueuedJobs": ("Cancel QUEUED jobs by pattern, queue or jobIDs", "14.19", _BULK),
    "SetLimit": ("Set, change or remove a limit: capacity, rate, per key, fair", "14.7", [
        Param("name", NAME, "the GLOB pattern the limit holds for", required=True),
        Param("max", {"type": "integer", "minimum": 0, "maximum": 1_000_000_000},
              "the capacity; required unless rate or fair is given; 0 alone removes the "
              "limit"),
        # The grammar; the server checks the bounds (402 Malformed rate).
        Param("rate", {"type": "string", "pattern": "^[0-9]{1,5}/[0-9]{1,5}[smhd]$",
                       "examples": ["100/1m"]},
              f"at most N hand-outs in any window of DURATION: N/DURATION, N 1 to {MAX_RATE}, "
              "DURATION 1s to 1d (14.23)"),
        Param("perKey", FLAG, "max and rate count each job key apart (14.23)"),
        Param("fair", FLAG, "hand-outs rotate between keys (14.23)"),
    ]),
    "PauseJobs": ("Stop handing out jobs of a pattern", "14.9", [
        Param("name", NAME, "the GLOB pattern to pause", required=True),
    ]),
    "ResumeJobs": ("Hand out jobs of a paused pattern again", "14.9", [
        Param("name", NAME, "the paused pattern", required=True),
    ]),
    "AwaitReply": ("Park a running job until a reply on a key", "14.12", [
        _job_id(),
        Param("key", NAME, "the correlation key", required=True),
        Param("timeout", {"type": "integer", "minimum": 1, "maximum": 2_592_000},
              "seconds to wait for the reply"),
        _LEASE_ID,
        Param("data", OBJECT, "replace the job's data"),
    ]),
    "DeliverReply": ("Deliver a reply to the job waiting on a key", "14.12", [
        Param("key", NAME, "the correlation key", required=True),
        Param("data", OBJECT, "the reply", required=True),
    ]),
    "AwaitJob": ("Wait until a job has ended; its final state, data and lastError", "14.27", [
        _job_id(),
        Param("timeout", {"type": "integer", "minimum": 0},
              "milliseconds to wait, at most 3,600,000 (default 110,000); past it, 202 "
              "Job not ended yet"),
    ]),
    "Backup": ("Copy the SQLite database into a new file while serving", "14.18", [
        Param("name", {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
              "the new file's name in the server's backup directory (--backup-dir); "
              "never overwritten; needs the token", required=True),
    ]),
    "Queues": ("Each queue's jobs by state and oldest ready age", "14.17", [
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000},
              "list at most this many queues"),
    ]),
    "History": ("What the queues did, minute by minute (kept in memory)", "14.20", [
        Param("name", {**NAME, "pattern": "^[^/]+$"}, "one queue; all together if absent"),
        Param("minutes", {"type": "integer", "minimum": 1, "maximum": 10_080},
              "the last this many minutes, at most the server's --history-minutes"),
    ]),
    "RunningJobs": ("The jobs handed out now, the longest running first, with their workers",
                    "14.21", [
        Param("name", PATTERN, "only jobs whose name matches this GLOB pattern"),
        Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000},
              "list at most this many jobs (default 100)"),
        Param("order", {"type": "string", "enum": ["oldest", "newest"]},
              "the longest running first (default), or the last handed out first"),
    ]),
}

_WIRE_LINE = {
    "description": "the wire reply's status line, e.g. `430 Unrecognized command`; for "
    "a refusal of the HTTP side's own, before any command runs, HTTP's status and "
    "reason phrase, e.g. `400 Bad Request`",
    "schema": TEXT,
}
_WIRE_STATUS = {"Jobserver-Status": {**_WIRE_LINE, "required": True}}
# A refusal of the HTTP side's own (access.refusal): `status` its line,
# `error` why.
_JSON_ERROR: Schema = {
    "type": "object",
    "properties": {"status": TEXT, "error": TEXT},
    "required": ["status", "error"],
}
# A refusal: the wire's (`status`, its line; POST /queue adds `error`, the
# same line, for Jobber's clients) or the HTTP side's own (both).
_REFUSED: Schema = {
    "type": "object",
    "properties": {"status": TEXT, "error": TEXT},
    "anyOf": [{"required": ["status"]}, {"required": ["error"]}],
}
# What the HTTP side itself answers with some of the wire's statuses,
# before a command runs (access.refusal).
_OWN_REFUSALS = {
    400: "; or, before any command runs, a body that is not a JSON object of the "
    "command's parameters, or a parameter the document does not allow: `error` says "
    "which, `status` is `400 Bad Request`",
    401: "; over HTTP, `Authorization: Bearer TOKEN` (else `401 Unauthorized`)",
    413: "; or a body over the HTTP side's limit (`status` 413 and HTTP's reason phrase)",
}
# What the HTTP side refuses before any command runs (web/access.py).
_REFUSALS: Schema = {
    code: {
        "description": text,
        "headers": _WIRE_STATUS,
        "content": {"application/json": {"schema": _JSON_ERROR}},
    }
    for code, text in (
        ("403", "sent from another site's page: an Origin other than this server, or "
         "Sec-Fetch-Site cross-site or same-site"),
        ("415", "the body is not declared Content-Type: application/json"),
        ("421", "the Host header names none of this server's names (--http-host)"),
    )
}


# POST /queue's body: Jobber's `type` and `payload`, and CreateJob's other
# parameters for a producer that wants them, `delay` besides.
MAX_DELAY = 99_999_999
QUEUE_PARAMS = [
    Param("type", NAME, "the job's name", required=True),
    Param("payload", OBJECT, "the job's data"),
    Param("delay", {"type": "integer", "minimum": 0, "maximum": MAX_DELAY},
          "seconds from now before the job is first due (instead of firstRun)"),
    *(p for p in COMMANDS["CreateJob"][2] if p.name not in ("name", "data")),
]


def queue_schema() -> Schema:
    """What the body of POST /queue must be."""
    return _object_of(QUEUE_PARAMS)


def body_schema(command: str) -> Schema | None:
    """What the body of POST /api/<command> must be; None for a command
    that is not in the table (the wire answers it: 430 Unrecognized)."""
    found = COMMANDS.get(command)
    return None if found is None else _object_of(found[2])


def document() -> Schema:
    """The OpenAPI document of the HTTP side."""
    paths: dict[str, Any] = {f"/api/{name}": {"post": _operation(name)} for name in COMMANDS}
    paths["/queue"] = {"post": _queue_operation()}
    paths["/healthz"] = {"get": _simple(
        "healthz", "200 when the database answers, else 503",
        {"200": "application/json", "421": "application/json", "503": "application/json"},
        secured=False,
    )}
    paths["/metrics"] = {"get": _simple(
        "metrics", "Prometheus' text format",
        {"200": "text/plain", "401": "application/json", "421": "application/json",
         "503": "text/plain"},
    )}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "jobserver",
            "version": __version__,
            "description": "Every wire command as `POST /api/<Command>` with its parameters "
            "as a JSON object. The HTTP status is HTTP's own for the wire reply (400 for a "
            "malformed request, 404 for a missing job or command, 409 for a state that "
            "refuses it, ...); the wire's status line is in the Jobserver-Status header, "
            "and in the body as `status` when the wire reply has no body of its own. "
            "protocol.md says what each command does.",
        },
        "paths": paths,
        "components": {"securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{"token": []}],
    }


def _operation(command: str) -> Schema:
    summary, section, params = COMMANDS[command]
    body = _object_of(params)
    wire = {
        "headers": _WIRE_STATUS,
        "content": {
            "application/json": {"schema": {"type": ["object", "array"]}},
            "text/plain": {"schema": TEXT},
        },
    }
    return {
        "operationId": command,
        "summary": summary,
        "description": f"protocol.md section {section}.",
        "requestBody": {
            "required": any(p.required for p in params),
            "content": {"application/json": {"schema": body}},
        },
        "responses": {
            "2XX": {"description": "done: the wire reply's body (202: DeliverReply kept "
                    "a reply for a job to come)", **wire},
            **_wire_refusals(),
            **_REFUSALS,
        },
    }


def _wire_refusals() -> Schema:
    """Each HTTP status a wire refusal is answered with (web/statuses.py),
    the wire's line in Jobserver-Status and the body."""
    return {
        str(int(status)): {
            "description": statuses.MEANINGS[status] + _OWN_REFUSALS.get(status, ""),
            "headers": _WIRE_STATUS,
            "content": {"application/json": {"schema": _REFUSED}},
        }
        for status in sorted(statuses.refusals())
    }


def _queue_operation() -> Schema:
    job = queue_schema()
    created = {"type": "object", "properties": {"job-id": TEXT}, "required": ["job-id"]}
    return {
        "operationId": "queue",
        "summary": "Create a job as Jobber's clients do, with CreateJob's options",
        "description": "`type` is the job's name, `payload` its data; the other "
        "parameters are CreateJob's (protocol.md 5.1), and `delay` is firstRun as "
        "seconds from now.",
        "requestBody": {"required": True, "content": {"application/json": {"schema": job}}},
        "responses": {
            "201": {"description": "created",
                    "content": {"application/json": {"schema": created}}},
            **_wire_refusals(),
            **_REFUSALS,
        },
    }


def _simple(name: str, text: str, media: dict[str, str], secured: bool = True) -> Schema:
    """A GET whose answers are told apart by status code and media type."""
    operation: Schema = {
        "operationId": name,
        "summary": text,
        "responses": {
            code: {"description": text, "content": {kind: {}}} for code, kind in media.items()
        },
    }
    if not secured:
        operation["security"] = []
    return operation
