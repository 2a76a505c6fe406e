"""Command-line options shared by the client commands, top and the worker
manager: TLS, and value types that check their range, so that a value out of
range is a usage error (exit status 2) naming the option, before anything
runs."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from typing import Any

from jobserver.client import MAX_SERVERS, TLS, parse_servers
from jobserver.client.servers import Address
from jobserver.model import globmatch
from jobserver.model.limits import MAX_KEY, MAX_RATE, parse_rate
from jobserver.model.names import has_control
from jobserver.model.times import duration_text, parse_duration
from jobserver.wire import jsonbody
from jobserver.wire.limits import (
    DEFAULT_CLIENT_MAX_REPLY_BYTES,
    DEFAULT_HOST,
    DEFAULT_PORT,
    MAX_CLIENT_MAX_REPLY_BYTES,
    MAX_DELAY,
    MAX_DELAY_DIGITS,
    MAX_DEPENDENCIES,
    MAX_IDEMPOTENCY_KEY,
    MAX_JOB_ID,
    MAX_NAME,
    MAX_REPLY_KEY,
    MIN_MAX_REPLY_BYTES,
    PRIORITIES,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Where the client commands and the worker manager look without --server
# or $JOBSERVER_SERVER.
DEFAULT_SERVER = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


def number(
    kind: type[int | float],
    low: float,
    high: float | None = None,
    *,
    above: bool = False,
    unit: str = "",
) -> Callable[[str], float]:
    """An argparse type: a finite `kind` (int or float) of at least `low`
    (more than `low` if `above`) and at most `high`; `unit` names what it
    counts in the message ("seconds")."""
    what = "a whole number" if kind is int else "a number"
    if unit:
        what += f" of {unit}"
    if above:
        bounds = f"above {_text(low)}"
        if high is not None:
            bounds += f" and at most {_text(high)}"
    elif high is not None:
        bounds = f"from {_text(low)} to {_text(high)}"
    else:
        bounds = f"of at least {_text(low)}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (
            value is None
            or not math.isfinite(value)
            or value < low
            or (above and value == low)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, not {text!r}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in its messages
    return parse


def duration(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a DURATION (`90`, `90s`, `30m`, `12h`, `7d`) from
    `low` to `high` seconds."""

    def parse(text: str) -> float:
        try:
            value = parse_duration(text)
        except ValueError:
            value = math.nan
        # NaN fails both comparisons.
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a duration from {duration_text(low)} to {duration_text(high)} "
                f"(a number of seconds, or with s, m, h or d: 90s, 30m, 12h, 7d), not {text!r}"
            )
        return value

    return parse


def _text(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


# A jobID argument.
job_id = number(int, 1, MAX_JOB_ID)


def job_ids(text: str) -> list[int]:
    """An argparse type: jobIDs separated by commas, 1 to MAX_DEPENDENCIES
    of them (a job's dependencies, protocol.md 14.25)."""
    listed = [part.strip() for part in text.split(",")]
    if len(listed) > MAX_DEPENDENCIES:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_DEPENDENCIES} jobIDs, not {len(listed)}"
        )
    return [int(job_id(part)) for part in listed]
JOB_ID_HELP = f"a jobID, 1 to {MAX_JOB_ID}"

# Lowest first: argparse lists the choices in this order when one is refused.
PRIORITY_CHOICES = tuple(sorted(PRIORITIES))
PRIORITIES_TEXT = ", ".join(map(str, PRIORITY_CHOICES[:-1])) + f" or {PRIORITY_CHOICES[-1]}"


def add_job_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", type=job_id, metavar="ID", help=JOB_ID_HELP)


def add_priority(parser: argparse.ArgumentParser, help: str) -> None:
    """--priority P, one of the protocol's priorities; `help` ends with the default."""
    parser.add_argument(
        "--priority",
        type=int,
        choices=PRIORITY_CHOICES,
        metavar="P",
        help=f"{PRIORITIES_TEXT}; {help}",
    )

# A lease token as GetJob hands it out (protocol.md 14.3).
_LEASE_ID = re.compile(r"[0-9a-f]{16}")


def lease_id(text: str) -> str:
    """--lease-id: 16 lower-case hex digits. An empty one would turn
    fencing off without a word (the server reads it as absent), so a
    script whose variable came out empty is told instead."""
    if not _LEASE_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be a lease token, 16 lower-case hex digits as GetJob's leaseID, not {text!r}"
        )
    return text


def add_lease_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lease-id",
        type=lease_id,
        metavar="LEASE",
        help="the leaseID the job was handed out with: refused with '409 Lease expired' "
        "(exit 3) if the job has been handed out again since (default: none, whoever "
        "holds the job)",
    )


def json_object(text: str) -> dict[str, Any]:
    """--data and its like: a JSON object."""
    try:
        return jsonbody.parse_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"to\": \"ann\"}}' ({error}): {text!r}"
        ) from error


def pattern(text: str) -> str:
    """The one GLOB pattern of pause, resume and set-limit: 1 to 255 bytes
    of UTF-8 without control characters, as the server takes it."""
    if not text or len(text.encode("utf-8")) > MAX_NAME or has_control(text):
        raise argparse.ArgumentTypeError(
            f"must be a GLOB pattern of 1 to {MAX_NAME} bytes without control "
            f"characters, not {text!r}"
        )
    return text


# PATTERN of failed and the bulk actions.
JOB_NAMES_HELP = "a GLOB pattern such as 'email/*', or a comma-separated list of exact names"
# PATTERN of get, --job-name of the workers.
JOB_PATTERNS_HELP = (
    "a GLOB pattern such as 'email/*', or a comma-separated list of them "
    "('thumb/*,email/*') or of exact names"
)


def job_names(text: str) -> str:
    """Which jobs failed and the bulk actions take: one GLOB pattern, or a
    comma-separated list of exact names, as FailedJobs reads it. A list
    with a wildcard in one of its names is refused: the server matches
    each name of such a list exactly (as Bedrock does, so it accepts the
    list), and `report/*,img/slow` would never take a `report/...` job."""
    names = globmatch.listed_names(text)
    globs = [name for name in names if globmatch.is_glob(name)] if len(names) > 1 else []
    if globs:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a comma-separated list, and the names of a list are matched "
            f"exactly here, so {globs[0]!r} would only take a job named {globs[0]!r} itself: "
            "give one GLOB pattern (one command per pattern) or a list of exact names"
        )
    return text


KEY_HELP = f"the correlation key, 1 to {MAX_REPLY_KEY} bytes"


def reply_key(text: str) -> str:
    """A correlation key of await-reply and deliver: 1 to 255 bytes of UTF-8."""
    if not 1 <= len(text.encode("utf-8")) <= MAX_REPLY_KEY:
        raise argparse.ArgumentTypeError(
            f"must be a key of 1 to {MAX_REPLY_KEY} bytes, not {text!r}"
        )
    return text


def idempotency_key(text: str) -> str:
    """create's --idempotency-key: 1 to 255 bytes of UTF-8 without control
    characters, as the server takes it (protocol.md 14.22)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_IDEMPOTENCY_KEY or has_control(text):
        raise argparse.ArgumentTypeError(
            f"must be 1 to {MAX_IDEMPOTENCY_KEY} bytes without control characters, "
            f"not {text!r}"
        )
    return text


def job_key(text: str) -> str:
    """create's --key: whose job it is, at most 255 bytes of UTF-8 without
    control characters, as the server takes it (protocol.md 14.23)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY or has_control(text):
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_KEY} bytes without control characters, not {text!r}"
        )
    return text


def rate(text: str) -> str:
    """set-limit's --rate: N/DURATION as SetLimit takes it (protocol.md 14.23)."""
    try:
        parse_rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be N/DURATION, N 1 to {MAX_RATE} per 1s to 1d (a number of s, m, h or d), "
            f"such as 100/1m, not {text!r}"
        ) from None
    return text.strip()


# Seconds as the server takes a retry delay: as many digits as RetryJob's
# delay, and milliseconds, the precision of the nextRun a backoff computes.
_SECONDS = re.compile(rf"[0-9]{{1,{MAX_DELAY_DIGITS}}}(?:\.[0-9]{{1,3}})?")


def retry_seconds(text: str) -> float:
    """--retry-delay, --retry-max-delay: 0 to 99999999 seconds, to the millisecond."""
    if not _SECONDS.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_DELAY} with at most 3 decimals, "
            f"not {text!r}"
        )
    return float(text)


def time_windows(text: str) -> str:
    """--time-windows: HH:MM-HH:MM, comma-separated, up to 20."""
    # Here, not at the top: time zones (dateutil) are for this option and
    # --time-zone alone, and cost every command's start-up.
    from jobserver.model import windows

    try:
        return windows.format_windows(windows.parse_windows(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {windows.MAX_WINDOWS} windows HH:MM-HH:MM, comma-separated, "
            f"such as '01:00-05:00,22:00-23:30', not {text!r}"
        ) from None


def time_zone(text: str) -> str:
    """--time-zone: an IANA zone name."""
    from jobserver.model import windows  # as in time_windows

    try:
        windows.parse_zone(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an IANA time zone such as Europe/Paris or UTC, not {text!r}"
        ) from None
    return text.strip()


def server_address(text: str) -> tuple[Address, ...]:
    """--server: HOST:PORT or [IPV6]:PORT, the port 1 to 65535, or several
    separated by commas (the nodes of one queue, up to 16). A bare host is
    refused rather than sent to a default port: the operator who wrote one
    meant some server, and may not be running it on 8888."""
    try:
        return command_line_servers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def chosen_server(given: tuple[Address, ...] | None) -> tuple[Address, ...]:
    """The servers a command talks to: --server if `given`, else
    $JOBSERVER_SERVER, else 127.0.0.1:8888; ValueError naming the variable
    if it holds no HOST:PORT list."""
    if given is not None:
        return given
    try:
        return command_line_servers(os.environ.get("JOBSERVER_SERVER") or DEFAULT_SERVER)
    except ValueError as error:
        raise ValueError(f"$JOBSERVER_SERVER: {error}") from None


def command_line_servers(text: str) -> tuple[Address, ...]:
    """Server addresses as the command line takes them (--server,
    $JOBSERVER_SERVER): each with its port, separated by commas;
    ValueError saying what is wrong."""
    return parse_servers(text, default_port=None)


# What --server takes, wherever it is offered.
SERVER_METAVAR = "HOST:PORT[,...]"
SERVER_HELP = (
    f"the server, PORT 1 to 65535; or the nodes of one queue (several servers on one "
    f"PostgreSQL), up to {MAX_SERVERS} separated by commas, each connection going to one "
    f"and moving to another when it stops answering (default: $JOBSERVER_SERVER, which "
    f"takes the same, else {DEFAULT_SERVER})"
)


def log_level(text: str) -> str:
    """--log-level: any case."""
    return text.upper()


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls and --tls-ca."""
    parser.add_argument(
        "--tls",
        action="store_true",
        help="speak TLS, trusting the system's certificate authorities; the server's "
        "certificate must name the host of --server (default: plain TCP)",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="speak TLS, trusting the CA certificates in FILE (PEM) instead of the "
        "system's; implies --tls (default: none)",
    )


def add_max_reply_bytes(parser: argparse.ArgumentParser) -> None:
    """--max-reply-bytes, for the worker and the worker manager: a bound on
    what a broken or hostile server can make them hold."""
    parser.add_argument(
        "--max-reply-bytes",
        type=number(int, MIN_MAX_REPLY_BYTES, MAX_CLIENT_MAX_REPLY_BYTES),
        default=DEFAULT_CLIENT_MAX_REPLY_BYTES,
        metavar="BYTES",
        help=f"read no reply larger than BYTES, {MIN_MAX_REPLY_BYTES:,} to "
        f"{MAX_CLIENT_MAX_REPLY_BYTES:,}: one announcing more is a broken connection, "
        "closed unread, and the server is tried again after a wait; keep it above the "
        f"server's --max-reply-bytes (default: {DEFAULT_CLIENT_MAX_REPLY_BYTES:,}, 4x the "
        "server's own)",
    )


def tls_option(args: argparse.Namespace) -> TLS:
    """A client's `tls` argument from --tls and --tls-ca."""
    return args.tls_ca or args.tls


# What $JOBSERVER_AUTH_TOKEN is, wherever --auth-token-file is offered.
AUTH_TOKEN_HELP = (
    "send the token in FILE with each request (default: $JOBSERVER_AUTH_TOKEN, which "
    "holds the token itself, not a file name; else no token)"
)
