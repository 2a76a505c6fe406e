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
  sampled (`sample_depth`, every 15 seconds, off the writer).

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

The series go to the queues at work, not to the first seen: jobs due in
2099 created in 100 queues would hold them all while they sat. When none
is free, a queue with an event takes the series of the tracked queue
that has gone longest without one (a queue seen only in depth samples
first), if that queue had none in the same commit: a commit naming
thousands of queues does not pass series around among them, each a new
allocation. A queue seen only in a depth sample takes a free series, never
another's. A queue counted in the totals only, or that gave its series
up, stays there until a window has passed without it being counted
(MAX_OTHER_QUEUES such queues remembered): a series it took would lack
what the totals counted of it, and queues past the hundred do not take
turns, each turn wiping a queue's day. A tracked queue with no event and
no depth for a whole window is forgotten, leaving its series free.
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
# Queues counted in the totals only that the ring remembers, so that none
# takes a series that would lack what the totals counted of it: ten times
# the tracked, a few hundred bytes each (a name is 255 bytes at most).
# Past it, the one counted there longest ago is forgotten first (a series
# it takes then leaves those counts out).
MAX_OTHER_QUEUES = 1000
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
    # The last minute it had an event or a depth: forgotten a window later.
    seen: int = 0
    # The commit (History's count of them) that last counted an event of
    # it; 0 for none, only depth. The queue with the least gives its
    # series up first.
    active: int = 0

    @classmethod
    def empty(cls, minutes: int) -> Track:
        return cls([array("q", bytes(_COUNT_BYTES * minutes)) for _ in SERIES])


@dataclass
class Window:
    """What History.read gives: `minutes` values of each series, the
    oldest first, from `start` (minutes since the epoch)."""

    start: int
    series: dict[str, list[int]]
    tracked: bool
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
        self._total = Track.empty(minutes)
        # The last minute a queue without series was counted (in the totals
        # only); None when none was in the window. Its own series would be
        # read by no one.
        self._other: int | None = None
        self._queues: dict[str, Track] = {}
        # Queues counted in the totals only, by the last minute they were,
        # that one longest ago first (ordered: a dict's first key, after
        # many taken from its front, is a walk over their holes).
        self._in_other: OrderedDict[str, int] = OrderedDict()
        # Commits recorded, and the last one in which every tracked queue
        # had an event (no series to take: one look per commit).
        self._commits = 0
        self._all_active = 0
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
        self._commits += 1
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
        tracked = track is not None
        series = {
            name: _last(values, minute, minutes) if track is not None else [0] * minutes
            for name, values in zip(SERIES, (track or self._total).series, strict=True)
        }
        return Window(start, series, tracked, sorted(self._queues), self._other is not None)

    def _counted(self, queue: str, minute: int) -> Track | None:
        """The series an event of `queue` adds to; None: the totals only."""
        track = self._queues.get(queue) or self._new_series(queue, minute, take=True)
        if track is None:
            self._count_in_other(queue, minute)
            return None
        track.seen = minute
        track.active = self._commits
        return track

    def _sampled(self, queue: str, minute: int) -> Track | None:
        """The series a depth of `queue` goes in; None: the totals only."""
        track = self._queues.get(queue) or self._new_series(queue, minute, take=False)
        if track is None:
            self._other = minute
            return None
        track.seen = minute
        return track

    def _new_series(self, queue: str, minute: int, take: bool) -> Track | None:
        """A series for a queue without one: a free one or, if it may
        `take` one (it has an event), the idlest queue's; None for a queue
        the totals counted in the window."""
        if queue in self._in_other:
            return None
        if len(self._queues) >= MAX_TRACKED_QUEUES:
            idlest = self._idlest() if take else None
            if idlest is None:
                return None
            del self._queues[idlest]
            self._count_in_other(idlest, minute)
        track = self._queues[queue] = Track.empty(self.minutes)
        return track

    def _idlest(self) -> str | None:
        """The tracked queue that has gone longest without an event, if
        it had none in this commit."""
        if self._all_active == self._commits:
            return None
        queues = self._queues
        idlest = min(queues, key=lambda queue: queues[queue].active)
        if queues[idlest].active < self._commits:
            return idlest
        self._all_active = self._commits
        return None

    def _count_in_other(self, queue: str, minute: int) -> None:
        """Note `queue` as counted in the totals only, this minute."""
        self._other = minute
        in_other = self._in_other
        in_other[queue] = minute
        in_other.move_to_end(queue)
        if len(in_other) > MAX_OTHER_QUEUES:
            in_other.popitem(last=False)

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
        in_other = self._in_other
        while in_other and next(iter(in_other.values())) <= oldest:
            in_other.popitem(last=False)
        passed = range(max(head + 1, minute - self.minutes + 1), minute + 1)
        for track in (self._total, *self._queues.values()):
            if len(passed) == self.minutes:
                # Silent for a whole window: one new array a series.
                track.series = Track.empty(self.minutes).series
                continue
            for values in track.series:
                for m in passed:
                    values[m % self.minutes] = 0
        return minute


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
