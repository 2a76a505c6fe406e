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

from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.model import cron, repeat, times, windows
from jobserver.model.jobs import Job, State
from jobserver.model.sqlite_functions import datetime_after
from jobserver.wire import jsonbody

# Exponential backoff adds up to this fraction of the delay, so jobs that
# failed together do not all come back in the same instant.
JITTER = 0.1
# 2^64 times any allowed base is far beyond any cap: larger exponents only
# risk overflowing a float.
MAX_EXPONENT = 64


class RepeatStalled(Exception):
    """A repeat rule gave the very moment the job's current run was due:
    queued again, the job would run twice for one moment."""

    def __init__(self, base: str, computed: str) -> None:
        # As the job's lastError.
        super().__init__(
            f"repeat rule gave {computed} from {base}, the moment this run was due: "
            "it would run again for the same moment"
        )
        # As a status line's detail.
        self.reason = f"gives {computed} from {base}, the moment this run was due"


class RepeatLoops(RepeatStalled):
    """A rule of fixed offsets alone (seconds to days) that gives a moment
    not later than the one it counts from (`SCHEDULED, -1 HOUR`, `STARTED,
    +0 SECONDS`): it shifts every moment by that much, so queued again,
    the job would be due at once after this run and after every run."""

    def __init__(self, rule: str, base: str, computed: str) -> None:
        Exception.__init__(
            self,
            f"repeat rule {rule!r} gave {computed} from {base}, not later than the run "
            "it follows: the job would be due again at once after every run",
        )
        self.reason = f"gives {computed} from {base}, not later than the run it follows"


class CronStalled(RepeatStalled):
    """A CRON rule that gives no next run: cronsim finds no moment of the
    rule within its 50 years."""

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


def lease_end(ctx: Context, job: Job, due: str | None, seconds: int = 0) -> str | None:
    """now + retryAfter (in whole seconds, as DATETIME() computes), or now +
    `seconds` to the millisecond for a lease its taker asked for, or the
    next repeat if that comes first; None when the job's stored times cannot
    be computed with. `due` is the moment the job's run is due (None: not
    known), which the repeat must not give again: a lease ending then would
    hand the job out again and again. Raises RepeatStalled."""
    try:
        if seconds:
            end: str | None = retry_time(ctx, seconds)
        else:
            end = datetime_after(ctx.now_s, repeat.parse_modifiers(job.retryAfter))
        if end is not None and job.repeat:
            started = replace(job, lastRun=ctx.now_s)
            end = min(end, next_run_after_run(ctx, started, due))
    except (CommandError, ValueError):
        return None
    return end


def next_run_after_run(ctx: Context, job: Job, due: str | None) -> str:
    """When a job runs next per its repeat, after its run due at `due`
    (None: not known). Raises RepeatStalled when that is the moment the run
    was due: Bedrock accepts any rule, so one that truncates (`FINISHED,
    START OF DAY`) may give it again, and the job must not run twice for
    it; and RepeatLoops when a rule of fixed offsets alone gives a moment
    not later than its base, which it would do after every run (a truncating
    rule is due at once once, then gives the same moment again). A
    SCHEDULED rule's base is that moment (for a leased job, the
    originalNextRun its data keeps), whatever `due` says. A CRON rule's
    next run is after now, so never a moment already due."""
    if cron.is_cron(job.repeat):
        return cron_run(ctx, job.repeat, job.timeZone)
    rule = repeat.parse_repeat(job.repeat)
    computed = next_run_from_repeat(ctx, job, job.repeat)
    base = _base(ctx, job, rule)
    moment = base if rule.base == "SCHEDULED" else due
    if moment is not None and computed == datetime_after(moment[:19], ()):
        raise RepeatStalled(base, computed)
    if rule.only_fixed_offsets and computed <= base:
        raise RepeatLoops(job.repeat, base, computed)
    return computed


def due_moment(job: Job) -> str | None:
    """The moment a handed-out job's run was due: its nextRun; None for a
    RUNQUEUED job, whose nextRun is its lease's end."""
    return None if job.state == State.RUNQUEUED else job.nextRun


def _original_next_run(job: Job) -> str | None:
    if not (job.retryAfter or job.lease) or "originalNextRun" not in job.data:
        return None
    original = jsonbody.parse_object(job.data, stored=True).get("originalNextRun")
    return original if isinstance(original, str) else None


def _base(ctx: Context, job: Job, rule: repeat.Repeat) -> str:
    """The moment a rule counts from, as DATETIME() writes it (a base from
    the data may be written otherwise)."""
    if rule.base == "SCHEDULED":
        # Whole seconds, like every time DATETIME() computes: a base with
        # milliseconds would make each interval a fraction short.
        base = (_original_next_run(job) or job.nextRun)[:19]
    elif rule.base == "STARTED":
        base = job.lastRun or ctx.now_s
    else:
        base = ctx.now_s
    return datetime_after(base, ()) or base


def next_run_from_repeat(ctx: Context, job: Job, rule_text: str) -> str:
    """When a job with this repeat runs next, counted from its base.
    Raises CommandError when SQLite cannot compute that time, CronStalled
    when a CRON rule has no next run."""
    if cron.is_cron(rule_text):
        return cron_run(ctx, rule_text, job.timeZone)
    rule = repeat.parse_repeat(rule_text)
    base = _base(ctx, job, rule)
    computed = datetime_after(base, rule.modifiers)
    if computed is None:
        raise CommandError("502 Failed to compute nextRun")
    if rule.base == "SCHEDULED" and rule.only_offsets:
        try:
            last = times.parse_stored(base)
        except ValueError:
            raise CommandError("502 Failed to compute nextRun") from None
        computed = times.to_seconds(repeat.reanchor(last, times.parse_stored(computed), ctx.now))
    return computed


def cron_run(ctx: Context, rule_text: str, zone: str) -> str:
    """The first moment of a CRON rule strictly after now, in whole
    seconds as DATETIME() writes them: a job that missed several moments
    (the server was down) runs once for all of them, then keeps to the
    rule. Raises CronStalled when there is none."""
    found = cron.next_run(rule_text, zone, ctx.now)
    if found is None:
        raise CronStalled(f"no moment of {rule_text} within 50 years")
    return times.to_seconds(found)


def cron_upcoming(now: datetime, job: Job) -> list[str]:
    """A CRON job's next runs as its rule places them: from the later of
    now and its nextRun, that included."""
    try:
        start = max(now, times.parse_stored(job.nextRun))
    except ValueError:
        start = now
    return [times.to_seconds(moment) for moment in cron.upcoming(job.repeat, job.timeZone, start)]
