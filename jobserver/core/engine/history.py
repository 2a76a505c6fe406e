"""What the queues did, minute by minute, for a bounded window (History).

Kept in memory by each node for the jobs it moved, and lost on restart: a
graph of the last day is for watching a queue, not an audit log (the jobs
table is that), and a table of counts written with every batch would cost
the hot path a write per minute per queue on each node.

Counted, per queue (a job name up to its first `/`, queues.queue_of) and
for all queues together, per minute:

- created: jobs stored by CreateJob(s);
- handedOut: jobs handed out by GetJob(s) (a give-back does not undo it);
- finished: runs that ended well (FinishJob, a repeating job's finish);
- failed: runs that ended FAILED (FailJob, a lease or reply timing out, the
  stale-job net, with no attempt left);
- retried: runs that ended to run again (RetryJob, a failed attempt that a
  retry policy queues again);
- depth: the jobs QUEUED or RUNQUEUED (due or not) when the minute was
  last sampled (`sample_depth`, every 15 seconds, off the writer); a
  level, not a count, so a minute not sampled yet (the first 13 seconds of
  each, or a minute a slow read skipped) holds the last sample before it,
  not 0 (the graph dropped to 0 at the start of every minute).

Events are noted on a request's Context as its moves are made
(lifecycle.py), gathered by the writer from the requests that succeeded,
and added here by the engine only once their transaction committed: a
request undone, or a batch rolled back, counts nothing.

Memory is bounded twice: a ring of `minutes` slots (--history-minutes),
and at most MAX_TRACKED_QUEUES queues with series of their own; the rest
are counted in the totals only, and the ring keeps just the last minute
it counted one (the reply's `other`). Each series is an array of 8-byte
counts: 6 x 8 = 48 bytes per minute of window for each queue tracked and
for the total (`bytes_per_minute`).

The series go to the queues at work, and stay with them. When none is
free, a queue with an event takes the series of the tracked queue that
has gone longest without one (a queue seen only in depth samples first),
only if that queue has had none for IDLE_MINUTES; otherwise it is counted
in the totals only, and takes a series at its next event that finds one
idle that long, or free. So one request naming a hundred new queues
cannot take the series of a queue at work (an attack took a busy queue's
with two CreateJobs, and it never came back while the queue stayed busy),
and a busy queue counted in the totals only gets one back as soon as a
tracked queue has been idle that long. A series taken by a queue already
counted in the window lacks those counts (the totals have them): the
reply's `trackedSince` says from which minute it counts. A series is
taken from another queue at most once per IDLE_MINUTES, the queue that
took it having just had an event. A queue seen only in a depth sample
takes a free series, never another's. A tracked queue with no event and
no depth for a whole window is forgotten, leaving its series free.

The tracked queues are kept in the order of their last event, the
idlest first, so that an event's look for a series to take is one look
at the front, whatever the number of queues a commit names.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime

from jobserver.core.engine.clock import Clock, SystemClock

# A day of minutes: the graph an operator opens during an incident reaches
# back to yesterday's same hour.
DEFAULT_MINUTES = 1440
# A week: at 48 bytes per series-minute that is 480 KiB per queue.
MAX_MINUTES = 7 * 1440
INTERVAL_SECONDS = 60
# Queues with series of their own; the rest are counted in the totals
# only. A hundred queues is more than a dashboard can show, and 100 x 48
# bytes x a day of minutes is 6.6 MiB at the most.
MAX_TRACKED_QUEUES = 100
# A tracked queue keeps its series until it has gone this many minutes
# without an event (or the window, if shorter): the dashboard's graphs show
# the last hour, so a queue with work in them keeps its series, and a burst
# of new queues waits in the totals instead.
IDLE_MINUTES = 60
# The kinds of events, indexes into a Context's `events`, in the order of
# SERIES.
CREATED, HANDED_OUT, FINISHED, FAILED, RETRIED = range(5)
EVENT_KINDS = 5
# What the History command calls each series; depth is sampled, not counted.
SERIES = ("created", "handedOut", "finished", "failed", "retried", "depth")
DEPTH = 5
_COUNT_BYTES = 8

# What a Context notes: for each kind, counts by job name.
Events = list[dict[str, int]]


def new_events() -> Events:
    return [{} for _ in range(EVENT_KINDS)]


def add_events(into: Events, events: Events) -> None:
    for kind, counts in enumerate(events):
        target = into[kind]
        for name, count in counts.items():
            target[name] = target.get(name, 0) + count


def queue_of(name: str) -> str:
    """A job's queue: its name up to the first `/`, as Queues says."""
    return name.partition("/")[0]


def minute_of(moment: datetime) -> int:
    """Minutes since the epoch (UTC)."""
    return int(moment.timestamp()) // INTERVAL_SECONDS


@dataclass
class Track:
    """One queue's series, a ring of `minutes` slots each."""

    series: list[array[int]]
    # The minute it got its series: what the totals counted of it before
    # is not in them.
    since: int
    # The last minute it had an event or a depth: forgotten a window later.
    seen: int
    # The last minute it had an event; None for none, only depth (it
    # gives its series up first).
    worked: int | None = None

    @classmethod
    def empty(cls, minutes: int, since: int) -> Track:
        return cls(_zeros(minutes), since, since)


@dataclass
class Window:
    """What History.read gives: `minutes` values of each series, the
    oldest first, from `start` (minutes since the epoch)."""

    start: int
    series: dict[str, list[int]]
    tracked: bool
    # The minute a queue's series counts from; None for none, or all queues.
    since: int | None = None
    queues: list[str] = field(default_factory=list)
    other: bool = False


class History:
    """The ring of minutes (see the module's docstring). Used on the event
    loop only: the engine adds committed events, the sampler depths, and
    History reads; none of them waits, so no lock is needed."""

    def __init__(self, minutes: int = DEFAULT_MINUTES, clock: Clock | None = None) -> None:
        self.minutes = minutes
        # The engine's: minutes pass as its clock says (trio's MockClock in tests).
        self._clock = clock or SystemClock()
        self._idle = min(IDLE_MINUTES, minutes)
        self._total = Track.empty(minutes, 0)
        # The last minute a queue without series was counted (in the totals
        # only); None when none was in the window. Its own series would be
        # read by no one.
        self._other: int | None = None
        # By their last event, the idlest first, those seen only in depth
        # samples before them (ordered: a dict's first key, after many
        # taken from its front, is a walk over their holes).
        self._queues: OrderedDict[str, Track] = OrderedDict()
        # The newest minute the ring holds; None before the first event.
        self._head: int | None = None

    @property
    def enabled(self) -> bool:
        return self.minutes > 0

    def bytes_per_minute(self) -> int:
        """What one minute of window costs now, for every series kept."""
        return (1 + len(self._queues)) * len(SERIES) * _COUNT_BYTES

    def record(self, batches: list[Events]) -> None:
        """Add the events of a committed transaction's requests."""
        if not self.minutes:
            return
        minute = self._advance(minute_of(self._clock.now()))
        slot = minute % self.minutes
        total = self._total.series
        for events in batches:
            for kind, counts in enumerate(events):
                for name, count in counts.items():
                    track = self._counted(queue_of(name), minute)
                    if track is not None:
                        track.series[kind][slot] += count
                    total[kind][slot] += count

    def sample_depth(self, depths: dict[str, int]) -> None:
        """The jobs waiting in each queue now: this minute's depth."""
        if not self.minutes:
            return
        minute = self._advance(minute_of(self._clock.now()))
        slot = minute % self.minutes
        # A second sample in one minute replaces the first.
        for track in self._queues.values():
            track.series[DEPTH][slot] = 0
        for queue, depth in depths.items():
            into = self._sampled(queue, minute) if depth else None
            if into is not None:
                into.series[DEPTH][slot] = depth
        self._total.series[DEPTH][slot] = sum(depths.values())

    def read(self, queue: str | None, minutes: int) -> Window:
        """The last `minutes` minutes (to this one) of one queue's series,
        or of all queues' (`queue` None)."""
        now = minute_of(self._clock.now())
        minute = self._advance(now) if self.minutes else now
        start = minute - minutes + 1
        track = self._total if queue is None else self._queues.get(queue)
        series = {
            name: _last(values, minute, minutes) if track is not None else [0] * minutes
            for name, values in zip(SERIES, (track or self._total).series, strict=True)
        }
        since = None if track is None or queue is None else track.since
        return Window(
            start, series, track is not None, since, sorted(self._queues), self._other is not None
        )

    def _counted(self, queue: str, minute: int) -> Track | None:
        """The series an event of `queue` adds to; None: the totals only."""
        track = self._queues.get(queue)
        if track is not None:
            self._queues.move_to_end(queue)
        elif (track := self._new_series(queue, minute, worked=True)) is None:
            self._other = minute
            return None
        track.seen = track.worked = minute
        return track

    def _sampled(self, queue: str, minute: int) -> Track | None:
        """The series a depth of `queue` goes in; None: the totals only."""
        track = self._queues.get(queue) or self._new_series(queue, minute, worked=False)
        if track is None:
            self._other = minute
            return None
        track.seen = minute
        return track

    def _new_series(self, queue: str, minute: int, worked: bool) -> Track | None:
        """A series for a queue without one: a free one or, for a queue
        with an event (`worked`), that of a queue idle for IDLE_MINUTES;
        None if there is neither."""
        if len(self._queues) >= MAX_TRACKED_QUEUES and not (worked and self._free_idlest(minute)):
            return None
        track = self._queues[queue] = Track.empty(self.minutes, minute)
        if not worked:
            # Only depth: it gives its series up before any queue at work.
            self._queues.move_to_end(queue, last=False)
        return track

    def _free_idlest(self, minute: int) -> bool:
        """Forget the queue at the front, if it has had no event for
        IDLE_MINUTES (its counts are in the totals only from now)."""
        idlest, track = next(iter(self._queues.items()))
        if track.worked is not None and track.worked > minute - self._idle:
            return False
        del self._queues[idlest]
        self._other = minute
        return True

    def _advance(self, minute: int) -> int:
        """Move the ring's head to `minute`, clearing the minutes it passes
        and forgetting queues silent for a whole window; the minute to
        write in (the head, should the clock step back)."""
        head = self._head
        if head is not None and minute <= head:
            return head
        self._head = minute
        if head is None:
            return minute
        oldest = minute - self.minutes
        for queue in [q for q, track in self._queues.items() if track.seen <= oldest]:
            del self._queues[queue]
        if self._other is not None and self._other <= oldest:
            self._other = None
        passed = range(max(head + 1, minute - self.minutes + 1), minute + 1)
        for track in (self._total, *self._queues.values()):
            depth = track.series[DEPTH][head % self.minutes]
            if len(passed) == self.minutes:
                # Silent for a whole window: one new array a series.
                track.series = _zeros(self.minutes)
                track.series[DEPTH] = array("q", [depth]) * self.minutes
                continue
            for kind, values in enumerate(track.series):
                # The last depth sampled until a sample of their own.
                now = depth if kind == DEPTH else 0
                for m in passed:
                    values[m % self.minutes] = now
        return minute


def _zeros(minutes: int) -> list[array[int]]:
    return [array("q", bytes(_COUNT_BYTES * minutes)) for _ in SERIES]


def _last(values: array[int], minute: int, minutes: int) -> list[int]:
    """The `minutes` values of a ring up to `minute`'s slot, oldest first:
    one or two slices (a request may ask for a week: a loop per value on the
    event loop took milliseconds)."""
    if not values:
        return []
    end = minute % len(values) + 1
    first = end - minutes
    if first >= 0:
        return values[first:end].tolist()
    return values[first:].tolist() + values[:end].tolist()


def utc_text(minute: int) -> str:
    """A minute as the History command names it: ISO 8601, UTC."""
    return datetime.fromtimestamp(minute * INTERVAL_SECONDS, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
