"""GET /metrics: the queue in Prometheus' text format, written by
prometheus_client.

Everything is read when Prometheus scrapes, not counted as requests pass:
Status (through the dispatcher, like any client) for the server's figures,
and the store's queue statistics, which read every job, on a connection of
their own in a thread, so that a scrape never holds up the writer.

A queue is a job name up to its first `/` (`email/send` is in `email`). The
MAX_QUEUES largest queues get a label of their own; the rest are summed
under `other`, so a name per customer cannot make the series unbounded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jobserver.core.build import Core
from jobserver.core.commands import queues
from jobserver.core.engine.histogram import Histogram
from jobserver.model import times
from jobserver.model.limits import parse_rate
from jobserver.wire.framing import Request

MAX_QUEUES = 50
OTHER = "other"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Snapshot(Collector):
    """The figures of one scrape, as metric families."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.oldest_seconds: dict[str, float] = {}
        self.paused_jobs: dict[str, int] = {}
        self.answered: dict[tuple[str, int], int] = {}
        # (name, help, histogram) of the writer's work.
        self.histograms: list[tuple[str, str, Histogram]] = []

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "jobserver_jobs", "Jobs by queue (name up to its first /) and state",
            labels=["queue", "state"],
        )
        for (queue, state), count in sorted(self.counts.items()):
            jobs.add_metric([queue, state], count)
        yield jobs
        oldest = GaugeMetricFamily(
            "jobserver_queue_oldest_age_seconds",
            "How long the oldest job ready to run in each queue has waited "
            "(jobs a paused pattern holds are not ready)",
            labels=["queue"],
        )
        for queue, seconds in sorted(self.oldest_seconds.items()):
            oldest.add_metric([queue], seconds)
        yield oldest
        paused_jobs = GaugeMetricFamily(
            "jobserver_queue_paused_jobs",
            "Jobs due now in each queue that a paused pattern holds",
            labels=["queue"],
        )
        for queue, count in sorted(self.paused_jobs.items()):
            paused_jobs.add_metric([queue], count)
        yield paused_jobs
        status = self.status
        yield GaugeMetricFamily(
            "jobserver_waiting_getjobs", "GetJob requests waiting for a job",
            value=status.get("waitingGetJobs", 0),
        )
        yield GaugeMetricFamily(
            "jobserver_connections", "Open client connections",
            value=status.get("connections", 0),
        )
        yield from _limits(status.get("limits", {}))
        requests = CounterMetricFamily(
            "jobserver_requests",
            "Requests answered, by command and status code (0: a GetJob that waited)",
            labels=["command", "code"],
        )
        for (command, code), count in sorted(self.answered.items()):
            requests.add_metric([command, str(code)], count)
        yield requests
        paused = GaugeMetricFamily(
            "jobserver_paused", "Paused name patterns (1 each)", labels=["pattern"]
        )
        for pattern in status.get("paused", []):
            paused.add_metric([pattern], 1)
        yield paused
        replies = GaugeMetricFamily(
            "jobserver_replies", "Jobs waiting for a reply, and replies kept before their job",
            labels=["kind"],
        )
        for kind, count in sorted(status.get("replies", {}).items()):
            replies.add_metric([kind], count)
        yield replies
        for name, text, histogram in self.histograms:
            yield _histogram(name, text, histogram)


def _histogram(name: str, text: str, histogram: Histogram) -> Metric:
    buckets = histogram.cumulative()
    return HistogramMetricFamily(
        name, text,
        buckets=[(floatToGoString(bound), count) for bound, count in buckets],
        sum_value=histogram.sum,
    )


def _limits(limits: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each limit's figures by pattern, as Status shows them: never by key,
    so a key per customer adds no series."""
    used = GaugeMetricFamily(
        "jobserver_limit_running", "Cost of running jobs under each concurrency limit",
        labels=["pattern"],
    )
    capacity = GaugeMetricFamily(
        "jobserver_limit_capacity", "Capacity of each concurrency limit (0: none)",
        labels=["pattern"],
    )
    keys = GaugeMetricFamily(
        "jobserver_limit_keys_running", "Keys with jobs running under each per-key limit",
        labels=["pattern"],
    )
    for pattern, figures in sorted(limits.items()):
        used.add_metric([pattern], figures["running"])
        capacity.add_metric([pattern], figures["max"])
        if "keys" in figures:
            keys.add_metric([pattern], figures["keys"])
    yield used
    yield capacity
    yield keys
    yield from _rates(limits)


def _rates(limits: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Each rate as its count and window, so that `in_window / rate` is how
    spent its window is."""
    rate = GaugeMetricFamily(
        "jobserver_limit_rate", "Hand-outs each rate limit allows in a window",
        labels=["pattern"],
    )
    window = GaugeMetricFamily(
        "jobserver_limit_rate_window_seconds", "The window of each rate limit",
        labels=["pattern"],
    )
    handed = GaugeMetricFamily(
        "jobserver_limit_in_window",
        "Hand-outs in each rate limit's window now (of its busiest key, for a per-key rate)",
        labels=["pattern"],
    )
    for pattern, figures in sorted(limits.items()):
        if "rate" not in figures:
            continue
        allowed = parse_rate(figures["rate"])
        rate.add_metric([pattern], allowed.count)
        window.add_metric([pattern], allowed.window_ms / 1000)
        handed.add_metric([pattern], figures["inWindow"])
    yield rate
    yield window
    yield handed


class Metrics:
    def __init__(self, core: Core, auth_token: str | None) -> None:
        self._core = core
        self._auth_token = auth_token
        self._snapshot = Snapshot()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._snapshot)
        # One scrape at a time: each reads every job once.
        self._lock = trio.Lock()

    async def render(self, peer: str) -> tuple[int, bytes]:
        """(HTTP status, the exposition text)."""
        async with self._lock:
            headers = {"authtoken": self._auth_token} if self._auth_token else {}
            answer = await self._core.dispatcher.dispatch(Request("Status", headers), peer)
            if answer.response.code != 200:
                return 503, answer.response.status.encode()
            now = times.utcnow()
            store = self._core.store
            try:
                stats = await trio.to_thread.run_sync(
                    store.queue_stats, times.to_millis(now)
                )
            except store.errors as error:
                # A database that cannot be read now (or a memory one, which
                # no second connection can open): no figures, and why.
                return 503, f"cannot read the jobs: {error}".encode()
            snapshot = self._snapshot
            snapshot.status = json.loads(answer.response.body)
            snapshot.answered = dict(self._core.dispatcher.answered)
            engine = self._core.engine
            snapshot.histograms = [
                ("jobserver_batch_requests", "Requests per transaction (group commit)",
                 engine.batch_sizes),
                ("jobserver_commit_seconds", "Seconds from a transaction's start to its commit",
                 engine.commit_seconds),
                ("jobserver_sync_seconds", "Seconds each sync of the log to disk took (SQLite)",
                 engine.sync_seconds),
            ]
            labelled = _labelled(queues.summarize(stats, now))
            snapshot.counts, snapshot.oldest_seconds, snapshot.paused_jobs = labelled
            return 200, generate_latest(self._registry)


def _labelled(
    listed: list[queues.Queue],
) -> tuple[dict[tuple[str, str], int], dict[str, float], dict[str, int]]:
    """Jobs by (queue label, state), each label's oldest ready age and its
    jobs held by a pause: the MAX_QUEUES largest queues under their own
    names, the rest under OTHER."""
    counts: dict[tuple[str, str], int] = {}
    ages: dict[str, float] = {}
    paused: dict[str, int] = {}
    for rank, queue in enumerate(listed):
        label = queue.name if rank < MAX_QUEUES else OTHER
        for state, count in queue.jobs.items():
            counts[label, state] = counts.get((label, state), 0) + count
        if queue.oldest_ready_age is not None:
            ages[label] = max(ages.get(label, 0.0), queue.oldest_ready_age)
        if queue.paused:
            paused[label] = paused.get(label, 0) + queue.paused
    return counts, ages, paused
