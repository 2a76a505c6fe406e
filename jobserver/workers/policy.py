"""Policies by job name, the handler's side of a job's retry policy,
timeout and lease: the Python worker's `@worker.handler(pattern,
max_attempts=..., ...)` and the worker manager's `--policy
'PATTERN:max_attempts=5,backoff=exponential,...'`. They apply to the jobs
that carry none of their own: a job's own retry policy and retryAfter win.

A retry policy is sent with a job's failure (FailJob's maxAttempts,
retryBackoff, retryDelay, retryMaxDelay, protocol.md 14.1), which the job
then keeps; a lease with its first renewal (TouchJob's `lease`, 14.4)."""

from __future__ import annotations

import argparse
import difflib
import math
from dataclasses import dataclass, field, replace
from typing import Any

from jobserver.model.globmatch import glob_match
from jobserver.wire.limits import (
    BACKOFFS,
    DEFAULT_BACKOFF,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_RETRY_DELAY,
    MAX_ATTEMPTS,
    MAX_DELAY,
    MAX_LEASE,
    MAX_TIMEOUT,
    MIN_LEASE,
)
from jobserver.workers.contract import NO_POLICY, Outcome

RETRY_KEYS = ("max_attempts", "backoff", "retry_delay", "retry_max_delay")
KEYS = (*RETRY_KEYS, "timeout", "lease")
POLICY_HELP = (
    "for the jobs whose name matches PATTERN (a GLOB pattern; the first --policy that "
    "matches) and that carry none of their own: KEY=VALUE,... of max_attempts (1 to "
    f"{MAX_ATTEMPTS}), backoff ({' or '.join(BACKOFFS)}; else {DEFAULT_BACKOFF}), "
    f"retry_delay and retry_max_delay (seconds, 0 to {MAX_DELAY}; else "
    f"{DEFAULT_RETRY_DELAY:g} and {DEFAULT_MAX_RETRY_DELAY:g}), sent with a failure; "
    "timeout (seconds, instead of --worker-timeout); lease (seconds, 1 to "
    f"{MAX_LEASE}, instead of --lease); seconds may end in s. Repeatable, e.g. "
    "'email/*:max_attempts=5,backoff=exponential,retry_delay=10s,timeout=60s' "
    "(default: none)"
)


@dataclass(frozen=True)
class Policy:
    """What applies to the jobs a pattern matches."""

    pattern: str
    # FailJob's policy as fail_job's keywords; {} for none.
    retry: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None  # None: --worker-timeout
    lease: int | None = None  # None: --lease


def retry_policy(
    max_attempts: int | None,
    backoff: str = DEFAULT_BACKOFF,
    delay: float = DEFAULT_RETRY_DELAY,
    max_delay: float = DEFAULT_MAX_RETRY_DELAY,
) -> dict[str, Any]:
    """A retry policy as fail_job's keywords ({} without max_attempts);
    ValueError out of CreateJob's bounds (protocol.md 14.1)."""
    if max_attempts is None:
        return {}
    if not (type(max_attempts) is int and 1 <= max_attempts <= MAX_ATTEMPTS):
        raise ValueError(f"max_attempts must be 1 to {MAX_ATTEMPTS}, not {max_attempts!r}")
    if backoff not in BACKOFFS:
        raise ValueError(f"backoff must be one of {', '.join(BACKOFFS)}, not {backoff!r}")
    for name, seconds in (("retry_delay", delay), ("retry_max_delay", max_delay)):
        if not (isinstance(seconds, int | float) and 0 <= seconds <= MAX_DELAY):
            raise ValueError(f"{name} must be seconds from 0 to {MAX_DELAY}, not {seconds!r}")
    return {
        "max_attempts": max_attempts, "retry_backoff": backoff,
        "retry_delay": round(delay, 3), "retry_max_delay": round(max_delay, 3),
    }


def check_lease(lease: int | None) -> None:
    """A policy's lease: whole seconds GetJob's `lease` takes, or None."""
    if lease is not None and not (type(lease) is int and MIN_LEASE <= lease <= MAX_LEASE):
        raise ValueError(f"lease must be whole seconds from {MIN_LEASE} to {MAX_LEASE}, "
                         f"not {lease!r}")


def parse_policy(text: str) -> Policy:
    """--policy's value, PATTERN:KEY=VALUE,...; argparse.ArgumentTypeError
    saying what is wrong (exit status 2)."""
    pattern, colon, options = text.rpartition(":")
    if not colon or not pattern.strip() or "," in pattern:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PATTERN:KEY=VALUE,... (a pattern without commas, e.g. "
            "'email/*:max_attempts=5')"
        )
    values = _options(options)
    try:
        return _policy(pattern.strip(), values)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def _options(options: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for item in options.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not value:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not KEY=VALUE")
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; one of {', '.join(KEYS)}"
            raise argparse.ArgumentTypeError(f"unknown policy key {key!r}{hint}")
        if key in values:
            raise argparse.ArgumentTypeError(f"policy key {key} given twice")
        values[key] = value
    return values


def _policy(pattern: str, values: dict[str, str]) -> Policy:
    """The Policy of --policy's KEY=VALUE pairs; ValueError out of bounds."""
    if "max_attempts" not in values and any(k in values for k in RETRY_KEYS):
        raise ValueError("backoff, retry_delay and retry_max_delay need max_attempts")
    retry: dict[str, Any] = {}
    if "max_attempts" in values:
        retry = retry_policy(
            _number(values, "max_attempts", int),
            values.get("backoff", DEFAULT_BACKOFF),
            _number(values, "retry_delay", float, DEFAULT_RETRY_DELAY),
            _number(values, "retry_max_delay", float, DEFAULT_MAX_RETRY_DELAY),
        )
    timeout = _number(values, "timeout", float, None)
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be seconds above 0 and at most {MAX_TIMEOUT:g}")
    lease = _number(values, "lease", int, None)
    check_lease(lease)
    return Policy(pattern, retry, timeout, lease)


def _number(values: dict[str, str], key: str, kind: type, default: Any = None) -> Any:
    """values[key] as `kind`, or `default` if absent; seconds may end in "s"."""
    text = values.get(key)
    if text is None:
        return default
    digits = text if key == "max_attempts" else text.removesuffix("s")
    try:
        # ASCII alone: int() and float() also read '٣' and '1_0'.
        if not (digits.isascii() and "_" not in digits):
            raise ValueError(digits)
        number = kind(digits)
    except ValueError:
        what = "a whole number" if kind is int else "a number of seconds"
        raise ValueError(f"{key} must be {what}, not {text!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{key} must be a finite number, not {text!r}")
    return number


class Policies:
    """The worker manager's --policy options, in the order given."""

    def __init__(self, policies: list[Policy] | None = None) -> None:
        self.policies = policies or []

    def for_job(self, name: str) -> Policy | None:
        """The first policy whose pattern matches the job's name."""
        return next((p for p in self.policies if glob_match(p.pattern, name)), None)

    def lease_for(self, name: str) -> int | None:
        """The lease of the job's policy, if it has one (leases.py)."""
        policy = self.for_job(name)
        return None if policy is None else policy.lease

    def timeout(self, name: str, default: float) -> float:
        """How long the job's worker may run: its policy's, else `default`."""
        policy = self.for_job(name)
        return default if policy is None or policy.timeout is None else policy.timeout

    def reported(self, job: dict[str, Any], result: Outcome) -> Outcome:
        """The outcome with the retry policy of the job's --policy sent with
        a failure, when the job was created without one (protocol.md 14.1)."""
        if result.report.verb != "fail" or job.get("maxAttempts") is not None:
            return result
        policy = self.for_job(job["name"])
        if policy is None or not policy.retry:
            return result
        attempts = policy.retry["max_attempts"]
        report = replace(result.report, params={**result.report.params, **policy.retry})
        text = result.text.replace(NO_POLICY, f"; the --policy for {policy.pattern!r} decides "
                                   f"({attempts} attempts)")
        return replace(result, report=report, text=text)
