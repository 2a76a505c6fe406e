"""Which headers each command reads, and the reply's `ignoredHeaders` for
the ones it does not: a typo (`priorty: 1000`) must not pass unnoticed."""

from __future__ import annotations

from collections.abc import Mapping

from jobserver.wire.framing import Request, Response

# Which headers each command reads (lower case, as Request keeps them). A
# header outside its command's set and GENERAL_HEADERS is ignored, as
# Bedrock ignores it, and named in the reply's `ignoredHeaders`: a typo
# (`priorty: 1000`) would otherwise create a job as if it were not there.
_JOB = ("jobid",)
_REPORT = (*_JOB, "leaseid", "data")
_NEW_JOB = (
    "name", "data", "firstrun", "repeat", "jobpriority", "priority", "retryafter",
    "parentjobid", "unique", "overwrite", "maxattempts", "retrybackoff", "retrydelay",
    "retrymaxdelay", "cost", "timewindows", "timezone", "key", "dependson",
    "ondependencyfailure",
)
_BULK = ("name", "queue", "jobids", "limit", "dryrun")
_HAND_OUT = ("name", "jobpriority", "includeleaseid", "lease")
KNOWN_HEADERS: dict[str, frozenset[str]] = {
    verb: frozenset(names)
    for verb, names in {
        "createjob": (*_NEW_JOB, "idempotencykey"),
        "createjobs": ("jobs", "idempotencykey"),
        "getjob": _HAND_OUT,
        "getjobs": (*_HAND_OUT, "numresults"),
        "queryjob": _JOB,
        "updatejob": (
            *_REPORT, "repeat", "jobpriority", "nextrun", "shouldclearrepeat", "timezone"
        ),
        "finishjob": _REPORT,
        "finishjobs": ("jobs",),
        "failjobs": ("jobs",),
        "retryjobs": ("jobs",),
        "retryjob": (*_REPORT, "delay", "ignorerepeat", "jobpriority", "name", "nextrun"),
        "failjob": (
            *_REPORT, "error", "maxattempts", "retrybackoff", "retrydelay", "retrymaxdelay",
        ),
        "canceljob": (*_JOB, "running"),
        "cancelledjobs": ("jobids",),
        "deletejob": _JOB,
        "requeuejobs": ("jobids", "name"),
        "ping": (),
        "status": (),
        "query": ("query", "format"),
        "query:": ("format",),
        "touchjob": (*_JOB, "leaseid", "lease"),
        "failedjobs": ("limit", "name"),
        "requeuefailedjobs": _BULK,
        "deletefailedjobs": _BULK,
        "cancelqueuedjobs": _BULK,
        "setlimit": ("name", "max", "rate", "perkey", "fair"),
        "pausejobs": ("name",),
        "resumejobs": ("name",),
        "awaitreply": (*_REPORT, "key", "timeout"),
        "deliverreply": ("key", "data"),
        "awaitjob": (*_JOB, "timeout"),
        "backup": ("name", "path"),
        "queues": ("limit",),
        "history": ("name", "minutes"),
        "runningjobs": ("limit", "name", "order"),
    }.items()
}
# Headers any command may carry: the framing's and the server's own, and
# those Bedrock's clients send with every command, which jobserver ignores
# on purpose (protocol.md section 12): a Bedrock client's replies stay as
# they were.
GENERAL_HEADERS = frozenset({
    "content-length", "connection", "authtoken", "timeout",
    "commitcount", "requestid", "lastip", "writeconsistency", "mockrequest",
    "getmockedjobs", "logparam", "idempotent", "processtimeout", "commandexecutetime",
    "host",
})
# `ignoredHeaders` names at most this many, each cut to MAX_IGNORED_NAME
# characters, so that a request of long made-up names (100 lines of up to
# 2 MiB each, section 3) cannot make a long reply: under 1 KiB in all.
MAX_IGNORED_LISTED = 10
MAX_IGNORED_NAME = 64


def unread_headers(request: Request) -> list[str]:
    """The headers of a request for a known command that the command does
    not read, in the order sent; [] for an unknown command."""
    known = KNOWN_HEADERS.get(request.verb.lower())
    if known is None:
        return []
    return [n for n in request.headers if n not in known and n not in GENERAL_HEADERS]


def ignored_in_elements(elements: Mapping[int, Request]) -> list[str]:
    """The keys the elements of CreateJobs', FinishJobs', FailJobs' or
    RetryJobs' `jobs` carry (by their position in `jobs`) that their
    command does not read, as `jobs[INDEX].KEY`, in order."""
    return [
        f"jobs[{index}].{name}"
        for index, element in sorted(elements.items())
        for name in unread_headers(element)
    ]


def ignored_headers(request: Request) -> str:
    """The headers of a request for a known command that the command does
    not read, as the reply's `ignoredHeaders` value; "" for none."""
    return describe_ignored(unread_headers(request))


def describe_ignored(ignored: list[str]) -> str:
    """Names for `ignoredHeaders`: at most MAX_IGNORED_LISTED, each cut to
    MAX_IGNORED_NAME characters, then how many more."""
    if not ignored:  # nearly every request, spared the joining
        return ""
    listed = [
        name if len(name) <= MAX_IGNORED_NAME else name[: MAX_IGNORED_NAME - 3] + "..."
        for name in ignored[:MAX_IGNORED_LISTED]
    ]
    more = len(ignored) - len(listed)
    return ", ".join(listed) + (f" and {more} more" if more else "")


def with_ignored_elements(response: Response, elements: Mapping[int, Request]) -> Response:
    """The reply, naming the keys of `jobs` elements (by position) their
    command does not read (`jobs[1].priorty`), as a request's own headers
    are named."""
    ignored = ignored_in_elements(elements)
    if ignored:
        response.headers["ignoredHeaders"] = describe_ignored(ignored)
    return response
