"""Command-line options shared by the client commands and the worker manager:
TLS, and value types that check their range, so that a value out of range is
a usage error (exit status 2) naming the option, before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from jobserver.client import TLS, parse_address
from jobserver.core.times import duration_text, parse_duration
from jobserver.wire.limits import DEFAULT_HOST, DEFAULT_PORT, MAX_JOB_ID

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


def server_address(text: str) -> tuple[str, int]:
    """--server: HOST:PORT, HOST or [IPV6]:PORT, the port 1 to 65535."""
    try:
        return parse_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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


def tls_option(args: argparse.Namespace) -> TLS:
    """A client's `tls` argument from --tls and --tls-ca."""
    return args.tls_ca or args.tls


# What $JOBSERVER_AUTH_TOKEN is, wherever --auth-token-file is offered.
AUTH_TOKEN_HELP = (
    "send the token in FILE with each request (default: $JOBSERVER_AUTH_TOKEN, which "
    "holds the token itself, not a file name; else no token)"
)
