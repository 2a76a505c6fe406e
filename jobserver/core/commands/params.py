"""Reading and checking request parameters, with Bedrock's status lines.

The parameters that hold JSON (`data`, `jobs`, FailJob's error) are read
in json_params.py, and those of flow control (cost, time windows, key,
SetLimit's limit) in flow_params.py; both build on the readers here."""

from __future__ import annotations

import re

from jobserver.core.errors import CommandError
from jobserver.model import cron, globmatch, repeat, times
from jobserver.model.jobs import RetryPolicy
from jobserver.model.names import has_control
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
# Seconds as RetryJob's delay allows them (8 digits), to the millisecond,
# the precision of the nextRun a policy computes.
_SECONDS = re.compile(r"[0-9]{1,8}(?:\.[0-9]{1,3})?")


def present(request: Request, name: str) -> str | None:
    """The value of a parameter, or None when absent or empty."""
    # The headers themselves, not request.get: a CreateJob asks for
    # fifteen parameters, most of them absent, a CreateJobs for each job.
    return request.headers.get(name.lower()) or None


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






def flag(request: Request, name: str) -> bool:
    """A `true`/`false` switch of our own (Bedrock's flags are is_true's)."""
    text = present(request, name)
    if text is None:
        return False
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise CommandError(f"402 Malformed {name} (true or false)")
    return value == "true"




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
