"""`jobserver top`: a live view of the queues in a terminal.

Each frame is three read-only requests on one kept connection, Status (the
headline: connections, waiting GetJobs, jobs by state; the idle workers:
waiting GetJobs by name), Queues (each queue's jobs by state, total and
oldest ready age) and RunningJobs (the jobs running longest, with their
workers), and a QueryJob for each batch watched (--batch: its completion
job's dependencyCounts), drawn as plain text.
On a terminal every frame clears the screen first; anywhere else (a pipe,
a file) frames follow one another, a blank line between, without escape
codes. A server that cannot be reached or refuses is shown in the frame and
asked again at the next interval: a live view outlasts a restart. With
--once, one frame is printed and a failure ends top with the exit status of
the client commands.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, TextIO

from jobserver.cli import top_batches
from jobserver.cli.client_command import (
    EXIT_CONNECTION,
    add_check,
    add_client_parser,
    failed,
)
from jobserver.cli.options import job_id, number
from jobserver.client import Client, ConnectionFailed, JobServerError
from jobserver.wire.counts import counted
from jobserver.wire.limits import MAX_QUEUES

DEFAULT_INTERVAL = 1.0
# Each frame reads every job (Queues): ten a second is plenty for a person
# and little for the server; an hour is the longest a "live" view can mean.
MIN_INTERVAL = 0.1
MAX_INTERVAL = 3600.0
# A terminal's worth of queues; the rest are counted.
DEFAULT_LIMIT = 20
# Cursor home, then erase the screen.
CLEAR_SCREEN = "\x1b[H\x1b[2J"
# Longer queue names are cut, so that the counts stay on the line.
NAME_WIDTH = 32
# The jobs running longest, and the names most waited for, shown: the
# frame stays on one screen; the rest are counted.
RUNNING_ROWS = 10
WAITING_ROWS = 5
# A server older than RunningJobs answers it so.
UNRECOGNIZED = 430
# Batches watched at most (--batch), each a QueryJob a frame.
MAX_BATCHES = 20

# States in the order of a job's life; states a newer server may add follow, by name.
STATE_ORDER = (
    "BLOCKED", "QUEUED", "RUNQUEUED", "RUNNING", "WAITING", "PAUSED", "FAILED", "FINISHED",
    "CANCELLED",
)

TOP_EXIT_HELP = f"""\
exit status of top:
  0  stopped with Ctrl-C; with --once, the frame was printed
  1-4  with --once: the server refused Status or Queues, as for the client commands
  {EXIT_CONNECTION}  with --once: cannot connect, or the connection broke
Without --once, a server that cannot be reached, or refuses, is shown in the
frame and asked again every interval until Ctrl-C."""


def add_parser(sub: Any) -> None:
    top = add_client_parser(
        sub,
        "top",
        watch,
        "a live view of the queues, refreshed every second",
        "Show the server's headline (version, uptime, connections, waiting GetJobs, "
        "jobs by state, paused patterns, and limits with their use: running of the "
        "capacity, hand-outs in the rate's window, keys running, fair) and its queues "
        "(a job name up to its first '/'), the largest first, each with its jobs by "
        "state, total and how long its oldest ready job has waited; the jobs running "
        "longest, with their workers and last reports; and the idle workers, by the "
        "name they wait for; redrawn every --interval until Ctrl-C. On a terminal each "
        "frame replaces the last; otherwise frames are printed one after another, a "
        "blank line between, without escape codes.",
        epilog=TOP_EXIT_HELP,
    )
    add_check(top, _batches_bounded)
    top.add_argument(
        "--interval",
        type=number(float, MIN_INTERVAL, MAX_INTERVAL),
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"time between frames, {MIN_INTERVAL:g} to {MAX_INTERVAL:g}; each frame "
        f"reads every job (default: {DEFAULT_INTERVAL:g})",
    )
    top.add_argument(
        "--limit",
        type=number(int, 1, MAX_QUEUES),
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"show at most N queues, the largest, 1 to {MAX_QUEUES}; the rest are counted "
        f"(default: {DEFAULT_LIMIT})",
    )
    top.add_argument(
        "--batch",
        type=job_id,
        action="append",
        default=[],
        metavar="ID",
        help="also show the progress of the batch whose completion job is ID (create "
        "--then's thenJobID): how many of its jobs ended, finished, failed, were cancelled "
        f"or deleted; repeat for more, up to {MAX_BATCHES} (default: none)",
    )
    top.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit, for scripts (default: redraw until Ctrl-C)",
    )


def watch(client: Client, args: argparse.Namespace) -> int:
    """top's session: frames until Ctrl-C, or one with --once."""
    server = f"{client.host}:{client.port}"
    try:
        if args.once:
            return _once(client, server, args.limit, args.batch)
        _live(client, server, args.limit, args.batch, args.interval, sys.stdout)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (`jobserver top | head`): stop quietly, and
        # keep Python from complaining as it flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _once(client: Client, server: str, limit: int, batches: list[int]) -> int:
    try:
        status, queues, running = _read(client, limit)
        watched = top_batches.read(client, batches)
    except (JobServerError, ConnectionFailed) as error:
        return failed(error)
    print(render(server, _now(), status, queues, running, watched), end="", flush=True)
    return 0


def _live(
    client: Client, server: str, limit: int, batches: list[int], interval: float, out: TextIO
) -> None:
    terminal = out.isatty()
    first = True
    while True:
        try:
            status, queues, running = _read(client, limit)
            watched = top_batches.read(client, batches)
            frame = render(server, _now(), status, queues, running, watched)
        except (JobServerError, ConnectionFailed) as error:
            frame = render_failure(server, _now(), error, interval)
        if terminal:
            out.write(CLEAR_SCREEN)
        elif not first:
            out.write("\n")
        out.write(frame)
        out.flush()
        first = False
        time.sleep(interval)


def _read(
    client: Client, limit: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    return client.status(), client.queues(limit), _running(client)


def _running(client: Client) -> dict[str, Any] | None:
    """The jobs running longest; None from a server without RunningJobs."""
    try:
        body: dict[str, Any] = client.request("RunningJobs", {"limit": RUNNING_ROWS}).json()
    except JobServerError as error:
        if error.code == UNRECOGNIZED:
            return None
        raise
    return body


def _now() -> datetime:
    return datetime.now(UTC)


def _batches_bounded(args: argparse.Namespace) -> str | None:
    if len(args.batch) > MAX_BATCHES:
        return f"--batch watches at most {MAX_BATCHES} batches, not {len(args.batch)}"
    return None


# Drawing: pure functions of what the server said.


def render(
    server: str,
    now: datetime,
    status: dict[str, Any],
    queues: dict[str, Any],
    running: dict[str, Any] | None = None,
    batches: list[top_batches.Watched] | None = None,
) -> str:
    """One frame: the headline, the table of queues, then what runs (from
    a server that has RunningJobs), who waits, and the batches watched."""
    lines = [_title(server, now, status), _counts(status)]
    lines.extend(_flow_control(status))
    lines.append("")
    lines.extend(_queue_table(queues))
    # From a server that has them (an older one has neither).
    if running is not None:
        lines.append("")
        lines.extend(_running_table(running))
    if "waitingByName" in status:
        lines.extend(_idle_workers(status))
    if batches:
        lines.append("")
        lines.extend(top_batches.table(batches, _clean, _cut))
    return "\n".join(lines) + "\n"


def render_failure(server: str, now: datetime, error: Exception, interval: float) -> str:
    """The frame for a server that cannot be reached or refused."""
    return (
        f"jobserver top: {_clean(server)}  {now:%Y-%m-%d %H:%M:%S} UTC\n"
        f"no answer: {_clean(str(error))}\n"
        f"asking again every {interval:g}s; Ctrl-C to stop\n"
    )


def _title(server: str, now: datetime, status: dict[str, Any]) -> str:
    version = _clean(str(status.get("version", "?")))
    uptime = _age(status.get("uptime"))
    return f"jobserver {version} at {_clean(server)}, up {uptime}  {now:%Y-%m-%d %H:%M:%S} UTC"


def _counts(status: dict[str, Any]) -> str:
    jobs: dict[str, int] = status.get("jobs", {})
    by_state = ", ".join(f"{state} {jobs[state]}" for state in _ordered(jobs)) or "none"
    return (
        f"connections {status.get('connections', '?')}  "
        f"waiting GetJobs {status.get('waitingGetJobs', '?')}  "
        f"jobs {sum(jobs.values())}: {by_state}"
    )


def _flow_control(status: dict[str, Any]) -> list[str]:
    lines = []
    paused = status.get("paused") or []
    if paused:
        lines.append("paused: " + ", ".join(_clean(p) for p in paused))
    limits: dict[str, dict[str, Any]] = status.get("limits") or {}
    if limits:
        lines.append(
            "limits: " + "; ".join(_limit(pattern, use) for pattern, use in sorted(limits.items()))
        )
    return lines


def _limit(pattern: str, use: dict[str, Any]) -> str:
    """One limit and its use: `report/* 1/4` (running of its capacity), or
    `api/* 3 running (2 keys; 2 a key), rate 2 of 2/1h a key, fair`: a
    per-key capacity is each key's, so all keys' running is not set
    against it."""
    running, most = use.get("running", 0), use.get("max", "?")
    if use.get("perKey"):
        each = f"; {most} a key" if most else ""
        keys = use.get("keys")
        counted_keys = counted(keys, "key") if isinstance(keys, int) else "? keys"
        shown = f"{running} running ({counted_keys}{each})"
    elif most:
        shown = f"{running}/{most}"
    else:
        shown = f"{running} running"
    parts = [f"{_clean(pattern)} {shown}"]
    if "rate" in use:
        # The hand-outs in the window now, of the busiest key if per key.
        a_key = " a key" if use.get("perKey") else ""
        parts.append(f"rate {use.get('inWindow', '?')} of {_clean(str(use['rate']))}{a_key}")
    if use.get("fair"):
        parts.append("fair")
    return ", ".join(parts)


def _queue_table(body: dict[str, Any]) -> list[str]:
    queues: list[dict[str, Any]] = body.get("queues", [])
    if not queues:
        return ["no jobs"]
    states = _ordered(state for queue in queues for state in queue["jobs"])
    # Jobs due that a paused pattern holds (not ready, so not in the age);
    # a column only when a queue has some.
    paused = any(queue.get("paused") for queue in queues)
    header = ["QUEUE", *states, "TOTAL", "OLDEST READY", *(["PAUSED"] if paused else [])]
    rows = [
        [
            _cut(_clean(queue["queue"])),
            *(str(queue["jobs"].get(state, 0)) for state in states),
            str(queue["total"]),
            _age(queue["oldestReadyAge"]),
            *([str(queue.get("paused", 0))] if paused else []),
        ]
        for queue in queues
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [_line(header, widths), *(_line(row, widths) for row in rows)]
    more = body.get("more", 0)
    if more:
        lines.append(f"... and {more} more queue{'s' if more != 1 else ''} (--limit)")
    return lines


def _running_table(body: dict[str, Any]) -> list[str]:
    """The jobs running longest, with who runs them and when they last
    reported (ages by the server's clock, as it answered)."""
    jobs: list[dict[str, Any]] = body.get("jobs", [])
    total = body.get("total", len(jobs))
    if not jobs:
        return ["running: none"]
    server_now = _parse(body.get("now"))
    header = ["JOB", "NAME", "WORKER", "RUNNING FOR", "LAST REPORT"]
    rows = [
        [
            str(job.get("jobID", "?")),
            _cut(_clean(str(job.get("name", "")))),
            _clean(str(job.get("worker") or "?")),
            _age(job.get("runningSeconds")),
            _ago(server_now, _parse(job.get("lastReport"))),
        ]
        for job in jobs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"running: {len(jobs)} of {total}, the longest first"]
    lines += [_text_line(header, widths), *(_text_line(row, widths) for row in rows)]
    return lines


def _idle_workers(status: dict[str, Any]) -> list[str]:
    """The waiting GetJobs by the name they wait for: idle workers."""
    names: list[dict[str, Any]] = status.get("waitingByName") or []
    if not names:
        return ["idle workers: none waiting"]
    shown = ", ".join(
        f"{_cut(_clean(str(entry.get('name', ''))))} {entry.get('waiting', '?')}"
        for entry in names[:WAITING_ROWS]
    )
    more = len(names) - WAITING_ROWS
    if more > 0:
        shown += f" (+{more} more)"
    return [f"idle workers (waiting GetJobs by name): {shown}"]


def _text_line(cells: list[str], widths: list[int]) -> str:
    """Every cell left-aligned but the first (a number), two spaces apart."""
    first = cells[0].rjust(widths[0])
    rest = (cell.ljust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
    return "  ".join([first, *rest]).rstrip()


def _parse(text: object) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC)
    except ValueError:
        return None


def _ago(now: datetime | None, then: datetime | None) -> str:
    if now is None or then is None:
        return "-"
    return _age(max(0.0, (now - then).total_seconds())) + " ago"


def _line(cells: list[str], widths: list[int]) -> str:
    """The name left-aligned, the numbers right-aligned, two spaces apart."""
    first = cells[0].ljust(widths[0])
    rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
    return "  ".join([first, *rest]).rstrip()


def _ordered(states: Iterable[str]) -> list[str]:
    present = set(states)
    known = [state for state in STATE_ORDER if state in present]
    return known + sorted(present - set(STATE_ORDER))


def _age(seconds: float | None) -> str:
    """12.5s, 3m04s, 1h02m, 2d03h; '-' for none."""
    if seconds is None:
        return "-"
    if round(seconds, 1) < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


# Control characters, escape included: names cannot hold them, but a frame
# shows what a server says, and a terminal obeys what it is sent.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _clean(text: str) -> str:
    return _CONTROL.sub("?", text)


def _cut(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."
