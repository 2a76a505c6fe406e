"""What each of `serve`'s options with a shape of its own reads (argparse
types): a host name for the HTTP side, a database's place, a limit. Each
refuses a wrong value with a line that says what it should be."""

from __future__ import annotations

import argparse

from jobserver.core.commands import params
from jobserver.core.errors import CommandError
from jobserver.model.limits import Limit, parse_spec
from jobserver.storage import sqlite_path
from jobserver.storage.backends import check_db, is_postgres

# A DNS name's bounds (RFC 1035): its length, and each label's.
MAX_HOST_NAME = 253
MAX_HOST_LABEL = 63


def http_host(text: str) -> str:
    """A DNS name (labels of letters, digits and inner `-`), lower-cased,
    without a trailing dot, as the HTTP side compares Host headers."""
    name = text.lower().removesuffix(".")
    valid = 0 < len(name) <= MAX_HOST_NAME and name.isascii() and all(
        0 < len(label) <= MAX_HOST_LABEL
        and label.replace("-", "").isalnum()
        and not label.startswith("-")
        and not label.endswith("-")
        for label in name.split(".")
    )
    if not valid:
        raise argparse.ArgumentTypeError(
            f"must be a host name such as jobs.example.com, not {text!r}"
        )
    return name


def database(text: str) -> str:
    try:
        db = check_db(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    place = None if is_postgres(db) else sqlite_path.missing_place(db)
    if place is not None:
        raise argparse.ArgumentTypeError(f"cannot put a database at {db}: {place}")
    return db


def limit(text: str) -> tuple[str, Limit]:
    pattern, sep, spec = text.rpartition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"not PATTERN=MAX (or rate:N/DURATION ...): {text!r}")
    try:
        limit = parse_spec(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    try:
        # Bounded as SetLimit's: every GetJob tests names against it.
        params.checked_pattern(pattern)
    except CommandError as error:
        raise argparse.ArgumentTypeError(f"a pattern SetLimit refuses: {error.status}") from None
    return pattern, limit
