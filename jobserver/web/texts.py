"""How the dashboard shows values to a person: durations, stored times
and how far they are from now, a job's data as indented JSON, a last error
as lines, a CRON job's next runs, a rate's N."""

from __future__ import annotations

import json

from markupsafe import Markup, escape

from jobserver.core.rules import schedule
from jobserver.model import cron, times
from jobserver.model.jobs import Job, State
from jobserver.model.limits import parse_rate
from jobserver.wire import jsonbody, last_error


def rate_count(rate: str) -> int:
    """A rate's N as Status shows the rate (`100/1m`: 100): its window is
    spent when its hand-outs reach it."""
    return parse_rate(rate).count


def pretty(data: str) -> str:
    try:
        value = jsonbody.parse(data)
    except ValueError:  # stored by hand through SQL: shown as it is
        return data
    text = json.dumps(value, indent=2, ensure_ascii=False)
    # A lone surrogate (stored as a `\ud800` escape) has no UTF-8 form: the
    # page shows it escaped, as it is stored.
    return json.dumps(value, indent=2) if jsonbody.has_lone_surrogate(text) else text


def error_lines(text: str, tail: int | None = None) -> list[str]:
    """A last error as lines of text; of its output, the last `tail` lines."""
    return last_error.describe(text).lines(tail)


def age_text(seconds: float | None) -> str:
    """A duration a person reads at a glance: 0.4 s, 12 s, 5 min, 3.2 h, 6.0 d."""
    if seconds is None:
        return "—"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def next_runs(job: Job) -> list[tuple[str, str]]:
    """A CRON job's next runs, each on its zone's wall clock and in UTC."""
    if not cron.is_cron(job.repeat):
        return []
    runs = schedule.cron_upcoming(times.utcnow(), job)
    return [(f"{cron.in_zone(run, job.timeZone):%a %Y-%m-%d %H:%M %Z}", run) for run in runs]


def time_html(stored: str | None) -> Markup:
    """A stored time (UTC) as a `<time>` element: its text the UTC value,
    which the page's script shows in the viewer's own zone, keeping the UTC
    value on hover. Text that is not a time is shown as it is."""
    if not stored:
        return Markup("never")
    try:
        moment = times.parse_stored(stored)
    except ValueError:
        return escape(stored)
    machine = moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return Markup('<time datetime="{}" title="{} UTC">{}</time>').format(machine, stored, stored)


def since_text(stored: str | None) -> Markup:
    """A stored time (UTC) and how far it is from now: `... (5 min ago)`."""
    shown = time_html(stored)
    if not stored or "<time" not in shown:
        return shown
    seconds = (times.utcnow() - times.parse_stored(stored)).total_seconds()
    if abs(seconds) < 1:
        return shown + " (now)"
    relative = f"{age_text(seconds)} ago" if seconds > 0 else f"in {age_text(-seconds)}"
    return shown + f" ({relative})"


def retry_text(job: Job) -> str:
    """How a job waiting for a retry reads in place of QUEUED: `retry 2 of
    5 in 40 s` (its attempts, of its maxAttempts, and the time to its
    nextRun); "" for any other job."""
    if job.state != State.QUEUED or job.attempts <= 0:
        return ""
    try:
        seconds = (times.parse_stored(job.nextRun) - times.utcnow()).total_seconds()
    except ValueError:
        return ""
    if seconds <= 0:
        return ""
    of = f" of {job.maxAttempts}" if job.maxAttempts else ""
    return f"retry {job.attempts}{of} in {age_text(seconds)}"
