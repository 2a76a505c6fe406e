"""When a job runs next: repeats, leases, backoff and time windows.

Pure computations on a job and the current moment; they change nothing.
Times are computed with SQLite's date functions (sqlite_functions.py) and
written as the store keeps them: seconds for what DATETIME() computes,
milliseconds for the moments jobserver computes itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from jobserver.core import cron, repeat, times, windows
from jobserver.core.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.jobs import Job
from jobserver.core.sqlite_functions import datetime_after
from jobserver.wire import jsonbody

# Exponential backoff adds up to this fraction of the delay, so jobs that
# failed together do not all come back in the same instant.
JITTER = 0.1
# 2^64 times any allowed base is far beyond any cap: larger exponents only
# risk overflowing a float.
MAX_EXPONENT = 64


class RepeatStalled(Exception):
    """A repeat rule gave a next run that is not later than its base (a
    rule stored before rules were checked, or one whose problem the
    checks' sample moments did not meet)."""

    def __init__(self, base: str, computed: str) -> None:
        # As the job's lastError.
        super().__init__(f"repeat rule did not move forward from {base} (gave {computed})")
        # As a status line's detail, worded like CreateJob's refusal.
        self.reason = f"does not move forward from {base} (gives {computed})"


class CronStalled(RepeatStalled):
    """A CRON rule that gives no next run: cronsim is no longer installed,
    or it finds no moment of the rule within its 50 years."""

    def __init__(self, reason: str) -> None:
        Exception.__init__(self, f"repeat rule gave no next run: {reason}")
        self.reason = reason


def backoff_delay(job: Job, attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds before a job whose `attempt` failed runs again.

    fixed: retryDelay. exponential: retryDelay x 2^(attempt - 1), at most
    retryMaxDelay, plus up to JITTER of that; `rng` gives a number in
    [0, 1), so the result lies in [delay, delay x (1 + JITTER)].
    """
    if job.retryBackoff == "fixed":
        return job.retryDelay
    exponent = min(max(attempt, 1) - 1, MAX_EXPONENT)
    delay = min(job.retryDelay * 2.0**exponent, job.retryMaxDelay)
    return delay * (1 + JITTER * rng())


def retry_time(ctx: Context, delay: float) -> str:
    """now + delay, to the millisecond, as nextRun is stored."""
    return times.to_millis(ctx.now + timedelta(seconds=delay))


def seconds_later(ctx: Context, seconds: int) -> str:
    """now + whole seconds, as DATETIME() writes it (RetryJob's delay)."""
    later = datetime_after(ctx.now_s, [f"+{seconds} SECONDS"])
    assert later is not None
    return later


def in_window(time_windows: str, zone: str, next_run: str) -> str:
    """A nextRun for a job with these windows: `next_run`, or the start of
    the next window if `next_run` falls outside every window."""
    if not time_windows:
        return next_run
    try:
        moment = times.parse_stored(next_run)
    except ValueError:
        return next_run
    start = windows.place(time_windows, zone, moment)
    return next_run if start <= moment else times.to_millis(start)


def window_start(ctx: Context, job: Job) -> str | None:
    """None if the job may run now; else when its next window opens."""
    start = windows.place(job.timeWindows, job.timeZone, ctx.now)
    return None if start <= ctx.now else times.to_millis(start)


def lease_end(ctx: Context, job: Job) -> str | None:
    """now + retryAfter, or the next repeat if that comes first; None when
    the job's stored times cannot be computed with. Raises RepeatStalled."""
    try:
        end = datetime_after(ctx.now_s, repeat.parse_modifiers(job.retryAfter))
        if end is not None and job.repeat:
            started = replace(job, lastRun=ctx.now_s)
            end = min(end, next_run_from_repeat(ctx, started, job.repeat))
    except (CommandError, ValueError):
        return None
    return end


def next_run_from_repeat(ctx: Context, job: Job, rule_text: str) -> str:
    """When a job with this repeat runs next, counted from its base.
    Raises RepeatStalled when that is not later than the base."""
    if cron.is_cron(rule_text):
        return cron_run(ctx, rule_text, job.timeZone)
    rule = repeat.parse_repeat(rule_text)
    scheduled = job.nextRun
    if rule.base == "SCHEDULED" and job.retryAfter:
        original = jsonbody.parse_object(job.data, stored=True).get("originalNextRun")
        if isinstance(original, str):
            scheduled = original
    if rule.base == "SCHEDULED":
        # Whole seconds, like every time DATETIME() computes: a base with
        # milliseconds would make each interval a fraction short.
        scheduled = scheduled[:19]
        base = scheduled
    elif rule.base == "STARTED":
        base = job.lastRun or ctx.now_s
    else:
        base = ctx.now_s
    computed = datetime_after(base, rule.modifiers)
    if computed is None:
        raise CommandError("502 Failed to compute nextRun")
    # A job must never run twice for one base. Compared as SQLite writes
    # both (a base from the data may be written otherwise), text order is
    # time order.
    base = datetime_after(base, ()) or base
    if computed <= base:
        raise RepeatStalled(base, computed)
    if rule.base == "SCHEDULED" and rule.only_offsets:
        try:
            last = times.parse_stored(scheduled)
        except ValueError:
            raise CommandError("502 Failed to compute nextRun") from None
        computed = times.to_seconds(repeat.reanchor(last, times.parse_stored(computed), ctx.now))
    return computed


def cron_run(ctx: Context, rule_text: str, zone: str) -> str:
    """The first moment of a CRON rule strictly after now, in whole
    seconds as DATETIME() writes them: a job that missed several moments
    (the server was down) runs once for all of them, then keeps to the
    rule. Raises CronStalled when there is none."""
    try:
        found = cron.next_run(rule_text, zone, ctx.now)
    except cron.CronUnavailable as error:
        raise CronStalled(str(error)) from None
    if found is None:
        raise CronStalled(f"no moment of {rule_text} within 50 years")
    return times.to_seconds(found)


def cron_upcoming(now: datetime, job: Job) -> list[str]:
    """A CRON job's next runs as its rule places them: from the later of
    now and its nextRun, that included. [] without cronsim."""
    try:
        start = max(now, times.parse_stored(job.nextRun))
    except ValueError:
        start = now
    try:
        found = cron.upcoming(job.repeat, job.timeZone, start)
    except cron.CronUnavailable:
        return []
    return [times.to_seconds(moment) for moment in found]
