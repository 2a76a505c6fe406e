"""Reading and checking request parameters, with Bedrock's status lines."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jobserver.core.errors import CommandError
from jobserver.model import cron, globmatch, repeat, times, windows
from jobserver.model.jobs import PLAIN, FlowOptions, RetryPolicy
from jobserver.model.limits import MAX_KEY, MAX_RATE, Limit, parse_rate
from jobserver.model.names import has_control
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request
from jobserver.wire.limits import (
    BACKOFFS,
    DEFAULT_BACKOFF,
    DEFAULT_LISTED,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_QUEUES,
    DEFAULT_RETRY_DELAY,
    DEFAULT_WAIT_MS,
    MAX_ATTEMPTS,
    MAX_BULK,
    MAX_CAPACITY,
    MAX_COST,
    MAX_DELAY_DIGITS,
    MAX_JOB_ID,
    MAX_LEASE,
    MAX_LISTED,
    MAX_NAME,
    MAX_QUEUES,
    MAX_RESULTS,
    MAX_WAIT_MS,
    MIN_LEASE,
    PRIORITIES,
)

# Bedrock's limit for a GetJob pattern, which may list many names.
MAX_PATTERN = 12750
# Bedrock's limit for a data value.
MAX_DATA = 1024 * 1024

# Seconds as RetryJob's delay allows them (8 digits), to the millisecond,
# the precision of the nextRun a policy computes.
_SECONDS = re.compile(r"[0-9]{1,8}(?:\.[0-9]{1,3})?")
# An error text is for people reading the dead set: a traceback fits.
MAX_ERROR = 64 * 1024


def present(request: Request, name: str) -> str | None:
    """The value of a parameter, or None when absent or empty."""
    value = request.get(name)
    return None if value is None or value == "" else value


def too_large(parameter: str, limit: int, unit: str = "bytes") -> CommandError:
    """A parameter over its size limit, with the limit. Still a 402, the
    code of Bedrock's own size check (`402 Malformed data`): its clients
    tell errors apart by the code."""
    named = parameter[:1].upper() + parameter[1:]
    return CommandError(f"402 {named} too large ({limit} {unit} at most)")


def require(request: Request, name: str) -> str:
    value = present(request, name)
    if value is None:
        raise CommandError(f"402 Missing {name}")
    return value


def job_id(request: Request, name: str = "jobID") -> int:
    return parse_job_id(require(request, name), name)


def parse_job_id(text: str, name: str = "jobID") -> int:
    # Bedrock's int64 rule: the text must be the canonical decimal form, so
    # `007`, `1.0` and ` 5` are malformed rather than silently read.
    try:
        number = int(text)
    except ValueError:
        raise CommandError(f"402 Malformed {name}") from None
    if str(number) != text or not 0 < number <= MAX_JOB_ID:
        raise CommandError(f"402 Malformed {name}")
    return number


# An integer in canonical decimal form, in or out of a jobID's range.
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_LEASE = re.compile(r"-?[0-9]{1,9}")


def given_job_id(request: Request) -> int | None:
    """The jobID a request names, as a number even if it is out of range;
    None when it names none, or something that is not an integer."""
    text = present(request, "jobID")
    if text is None or not _INTEGER.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than Python converts
        return None


def job_ids(request: Request, name: str = "jobIDs") -> list[int]:
    text = require(request, name)
    ids = [parse_job_id(part.strip(), name) for part in text.split(",") if part.strip()]
    if not ids:
        # `,,` names no job: a client bug, not a request to do nothing.
        raise CommandError(f"402 Malformed {name}")
    return ids


# Unicode's control characters (category Cc): C0, DEL and C1; and lone
# surrogates (from a JSON escape), which have no UTF-8 form at all.
def name(request: Request) -> str:
    """A job's name: 1 to 255 bytes of UTF-8 without control characters,
    which logs, terminals and worker file names cannot show or hold."""
    value = require(request, "name")
    if len(value.encode("utf-8")) > MAX_NAME:
        raise too_large("name", MAX_NAME)
    if has_control(value):
        raise CommandError("402 Malformed name")
    return value


def priority(request: Request, *names: str) -> int | None:
    for header in names:
        value = present(request, header)
        if value is not None:
            try:
                number = int(value)
            except ValueError:
                raise CommandError("402 Invalid priority value") from None
            if number not in PRIORITIES:
                raise CommandError("402 Invalid priority value")
            return number
    return None


# The parameters that hold JSON text: parsed once, whoever reads them first
# (json_value), and before the writer when they are large (dispatch.py).
JSON_PARAMETERS = ("data", "jobs")


def json_value(request: Request, header: str) -> Any:
    """The JSON value of the parameter `header`, which the request has:
    strict and depth-checked (jsonbody.parse), parsed the first time it is
    asked for and kept with the request, as is a ValueError it raises."""
    text = request.headers[header]
    known = request.parsed.get(header)
    if known is None or known[0] is not text:
        try:
            known = (text, jsonbody.parse(text))
        except ValueError as error:
            known = (text, error)
        request.parsed[header] = known
    if isinstance(known[1], ValueError):
        raise known[1]
    return known[1]


def with_json_value(request: Request, header: str, text: str, value: Any) -> None:
    """Set the parameter `header` to `text`, the compact JSON of `value`
    (a value parsed with jsonbody.parse, or a part of one), known parsed."""
    request.headers[header] = text
    request.parsed[header] = (text, value)


def data(request: Request, header: str = "data") -> str | None:
    """A JSON object parameter as compact JSON text, or None when absent."""
    text = request.get(header)
    if text is None:
        return None
    if len(text.encode("utf-8")) > MAX_DATA:
        raise too_large(header, MAX_DATA)
    try:
        value = json_value(request, header)
    except jsonbody.TooDeep as error:
        raise CommandError(f"402 Malformed data: {error}") from None
    except ValueError:
        raise CommandError("402 Data is not a valid JSON Object") from None
    if not isinstance(value, dict):
        raise CommandError("402 Data is not a valid JSON Object")
    # Valid JSON with no white space at all is already compact: keep the
    # client's text rather than spend time writing it out again.
    if _BLANKS.isdisjoint(text):
        return text
    return jsonbody.compact(value)


_BLANKS = frozenset(" \t\r\n")


def time(request: Request, header: str) -> str | None:
    value = present(request, header)
    if value is None or value.strip() == "":
        return None
    try:
        return times.parse_user_time(value)
    except ValueError:
        raise CommandError(f"402 Malformed {header}") from None


def repeat_rule(request: Request) -> str | None:
    """The repeat as stored (upper case), or None when absent or empty."""
    value = present(request, "repeat")
    if value is None or value.strip() == "":
        return None
    if cron.is_cron(value):
        return cron_rule(value)
    try:
        repeat.parse_repeat(value)
    except repeat.MalformedRepeat:
        meant = cron.as_cron(value)
        hint = f': a CRON rule is written "{meant}"' if meant else ""
        raise CommandError(f"402 Malformed repeat{hint}") from None
    return value.strip().upper()


def cron_rule(value: str) -> str:
    """A CRON repeat as stored (protocol.md 6.1)."""
    try:
        return cron.normalise(value)
    except cron.MalformedCron as error:
        raise CommandError(f"402 Malformed repeat: {error}") from None


def retry_after(request: Request) -> str:
    """The retryAfter modifiers as stored, or "" for none."""
    value = present(request, "retryAfter")
    if value is None or value.strip() == "":
        return ""
    try:
        repeat.parse_modifiers(value)
    except repeat.MalformedRepeat:
        raise CommandError("402 Malformed retryAfter") from None
    return value.strip()


def delay_seconds(request: Request) -> int:
    value = present(request, "delay")
    if value is None:
        return 0
    try:
        seconds = int(value)
    except ValueError:
        raise CommandError("402 Malformed delay") from None
    if seconds < 0:
        raise CommandError("402 Must specify a non-negative delay when retrying")
    if len(str(seconds)) > MAX_DELAY_DIGITS:
        raise CommandError("402 Malformed delay")
    return seconds


def lease_seconds(request: Request) -> int:
    """GetJob's and GetJobs' `lease`: the seconds of the lease the worker
    asks for on jobs without retryAfter; 0 (absent or empty) for none."""
    value = present(request, "lease")
    if value is None or value.strip() == "":
        return 0
    # Digits bounded before int(): a pattern's worth of them would be slow.
    if not _LEASE.fullmatch(value.strip()):
        raise CommandError("402 Malformed lease")
    seconds = int(value)
    if not MIN_LEASE <= seconds <= MAX_LEASE:
        raise CommandError(f"402 Lease out of range ({MIN_LEASE} to {MAX_LEASE} seconds)")
    return seconds


def retry_policy(request: Request) -> RetryPolicy | None:
    """CreateJob's retry policy, or None when it asks for none."""
    attempts_text = present(request, "maxAttempts")
    backoff_text = present(request, "retryBackoff")
    delay_text = present(request, "retryDelay")
    max_delay_text = present(request, "retryMaxDelay")
    if attempts_text is None:
        if backoff_text is not None or delay_text is not None or max_delay_text is not None:
            raise CommandError("402 Missing maxAttempts")
        return None
    # Canonical decimal, as a jobID: `03` and `2.0` are malformed too.
    attempts = parse_job_id(attempts_text, "maxAttempts")
    if attempts > MAX_ATTEMPTS:
        raise CommandError("402 Malformed maxAttempts")
    backoff = DEFAULT_BACKOFF if backoff_text is None else backoff_text.strip().lower()
    if backoff not in BACKOFFS:
        raise CommandError("402 Malformed retryBackoff")
    delay = _seconds(delay_text, "retryDelay", DEFAULT_RETRY_DELAY)
    max_delay = _seconds(max_delay_text, "retryMaxDelay", DEFAULT_MAX_RETRY_DELAY)
    return RetryPolicy(attempts, backoff, delay, max_delay)


def _seconds(text: str | None, header: str, default: float) -> float:
    if text is None:
        return default
    if not _SECONDS.fullmatch(text):
        raise CommandError(f"402 Malformed {header}")
    return float(text)


def lease_id(request: Request) -> str | None:
    """The leaseID a report carries, or None when it carries none."""
    return present(request, "leaseID")


def error_text(request: Request, data: str | None) -> str:
    """What FailJob records as the job's last error: the `error` parameter,
    else the `error` key of the data it sends (a string as it is, anything
    else as compact JSON), else nothing. NUL becomes U+FFFD: PostgreSQL's
    text cannot hold it, and the error must read the same on every backend."""
    text = present(request, "error")
    if text is not None:
        if len(text.encode("utf-8")) > MAX_ERROR:
            raise too_large("error", MAX_ERROR)
        return text.replace("\0", "\ufffd")
    # Read only when it may hold an error key: `data` is the request's
    # data, which data() has parsed (an object).
    if data is None or '"error"' not in data:
        return ""
    value = json_value(request, "data").get("error")
    if value is None:
        return ""
    text = value if isinstance(value, str) else jsonbody.compact(value)
    # A lone surrogate (from a `\\ud800` escape) has no UTF-8 form: replaced.
    text = text.encode("utf-8", "replace")[:MAX_ERROR].decode("utf-8", "ignore")
    return text.replace("\0", "\ufffd")


def limit(request: Request) -> int:
    """FailedJobs' `limit`: how many jobs to list."""
    return _count("limit", present(request, "limit"), DEFAULT_LISTED, MAX_LISTED)


def bulk_limit(request: Request) -> int:
    """A bulk action's `limit`: how many jobs to act on (protocol.md 14.19)."""
    return _count("limit", present(request, "limit"), MAX_BULK, MAX_BULK)


def queue_limit(request: Request) -> int:
    """Queues' `limit`: how many queues to list."""
    return _count("limit", present(request, "limit"), DEFAULT_QUEUES, MAX_QUEUES)


def num_results(request: Request) -> int:
    return _count("numResults", require(request, "numResults"), 1, MAX_RESULTS)


def _count(name: str, value: str | None, default: int, most: int) -> int:
    """A count: `default` if absent; below 1 counts as 1, above `most` as `most`."""
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise CommandError(f"402 Malformed {name}") from None
    return min(max(number, 1), most)


def is_true(value: str | None) -> bool:
    """`true` in any case, or a non-zero number, as Bedrock reads flags."""
    if value is None:
        return False
    if value.strip().lower() == "true":
        return True
    try:
        return int(value) != 0
    except ValueError:
        return False


def wait_seconds(request: Request) -> float:
    """The `timeout` of a waiting GetJob, in seconds."""
    value = present(request, "timeout")
    if value is None:
        return DEFAULT_WAIT_MS / 1000
    try:
        millis = int(value)
    except ValueError:
        raise CommandError("402 Malformed timeout") from None
    if millis < 0:
        raise CommandError("402 Malformed timeout")
    return min(millis, MAX_WAIT_MS) / 1000


def from_json(element: Mapping[str, Any], verb: str) -> Request:
    """One element of a batch (CreateJobs, FinishJobs) as the parameters
    of a request `verb` (CreateJob, FinishJob).

    Keys are case-insensitive, as header names are; objects stay JSON text;
    `data: []` is how PHP writes an empty object, so it means `{}`. A key
    or a string value with a lone surrogate is `402 Malformed KEY`: it
    could be neither stored nor compared (inside objects, such as data,
    compact() keeps it escaped).
    """
    request = Request(method_line=verb)
    for key, value in element.items():
        if jsonbody.has_lone_surrogate(key):
            raise CommandError("402 Malformed parameter name: a lone surrogate")
        if isinstance(value, str) and jsonbody.has_lone_surrogate(value):
            raise CommandError(f"402 Malformed {key}")
        if key.lower() == "data" and value == []:
            value = {}
        if isinstance(value, str):
            text = value
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif value is None:
            continue
        elif isinstance(value, (dict, list)):
            # Parsed with the list: not parsed again as the element's own.
            with_json_value(request, key.lower(), jsonbody.compact(value), value)
            continue
        else:
            text = str(value)
        request.headers[key.lower()] = text
    return request


def job_list(request: Request) -> list[dict[str, Any]]:
    """The `jobs` of CreateJobs and FinishJobs: a non-empty JSON array of
    non-empty objects."""
    text = present(request, "jobs")
    try:
        elements = json_value(request, "jobs") if text is not None else None
    except jsonbody.TooDeep as error:
        raise CommandError(f"401 Invalid JSON: {error}") from None
    except ValueError:
        elements = None
    if not isinstance(elements, list) or not elements:
        raise CommandError("401 Invalid JSON")
    if not all(isinstance(e, dict) and e for e in elements):
        raise CommandError("401 Invalid JSON")
    return elements


def flow_options(request: Request) -> FlowOptions:
    """CreateJob's cost, timeWindows and timeZone (protocol.md 14.7, 14.8)."""
    key = job_key(request)
    cost_text = present(request, "cost")
    cost = 1 if cost_text is None else parse_job_id(cost_text, "cost")
    if cost > MAX_COST:
        raise CommandError("402 Malformed cost")
    windows_text = present(request, "timeWindows")
    zone_text = present(request, "timeZone")
    if windows_text is None:
        # A CRON repeat is read in the zone too (protocol.md 6.1).
        if zone_text is None:
            return PLAIN if cost == 1 and not key else FlowOptions(cost=cost, key=key)
        if not cron.is_cron(request.get("repeat") or ""):
            raise CommandError("402 Missing timeWindows")
        return FlowOptions(cost=cost, zone=_zone(zone_text), key=key)
    try:
        parsed = windows.format_windows(windows.parse_windows(windows_text))
    except ValueError:
        raise CommandError("402 Malformed timeWindows") from None
    zone = _zone(zone_text) if zone_text is not None else "UTC"
    return FlowOptions(cost=cost, windows=parsed, zone=zone, key=key)


def time_zone(request: Request) -> str | None:
    """UpdateJob's timeZone, checked as CreateJob's; None when absent."""
    text = present(request, "timeZone")
    return None if text is None else _zone(text)


def _zone(text: str) -> str:
    zone = text.strip()
    try:
        windows.parse_zone(zone)
    except ValueError:
        raise CommandError("402 Malformed timeZone") from None
    return zone


def capacity(request: Request) -> int:
    """SetLimit's `max`: 0 (none, or remove the limit) or a positive
    capacity; required unless a `rate` or `fair` is given."""
    if not request.has("max") and (request.has("rate") or request.has("fair")):
        return 0
    text = require(request, "max")
    if text == "0":
        return 0
    number = parse_job_id(text, "max")
    if number > MAX_CAPACITY:
        raise CommandError("402 Malformed max")
    return number


def set_limit(request: Request) -> Limit:
    """SetLimit's limit (protocol.md 14.7, 14.23): `max`, `rate`, `perKey`
    and `fair`."""
    rate = None
    text = present(request, "rate")
    if text is not None:
        try:
            rate = parse_rate(text)
        except ValueError:
            raise CommandError(
                f"402 Malformed rate (N/DURATION: 1 to {MAX_RATE} per 1s to 1d, as 100/1m)"
            ) from None
    return Limit(
        max=capacity(request),
        rate=rate,
        per_key=flag(request, "perKey"),
        fair=flag(request, "fair"),
    )


def flag(request: Request, name: str) -> bool:
    """A `true`/`false` switch of our own (Bedrock's flags are is_true's)."""
    text = present(request, name)
    if text is None:
        return False
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise CommandError(f"402 Malformed {name} (true or false)")
    return value == "true"


def job_key(request: Request) -> str:
    """CreateJob's `key` (protocol.md 14.23): whose job it is, for per-key
    and fair limits; "" for none."""
    text = present(request, "key")
    if text is None:
        return ""
    if len(text.encode("utf-8")) > MAX_KEY:
        raise too_large("key", MAX_KEY)
    if has_control(text):
        raise CommandError("402 Malformed key")
    return text


def pattern(request: Request) -> str:
    """The one GLOB pattern of SetLimit, PauseJobs and ResumeJobs."""
    return checked_pattern(require(request, "name"))


def checked_pattern(value: str) -> str:
    """A pattern of a limit or a pause, as SetLimit and `--limit` take it."""
    if len(value.encode("utf-8")) > MAX_NAME:
        raise too_large("name", MAX_NAME)
    if has_control(value):
        raise CommandError("402 Malformed name")
    check_wildcards(value)
    return value


def check_wildcards(pattern: str) -> None:
    """A GLOB pattern holds at most MAX_WILDCARDS wildcards, each costing
    every match of the pattern a search, and MAX_SET_CHARACTERS in its
    sets, each read at every place a set is tried (globmatch.py)."""
    if globmatch.too_many_wildcards(pattern):
        raise CommandError(f"402 Name too complex ({globmatch.MAX_WILDCARDS} wildcards at most)")
    if globmatch.too_many_set_characters(pattern):
        raise CommandError(
            f"402 Name too complex ({globmatch.MAX_SET_CHARACTERS} characters in sets at most)"
        )
