"""History (protocol.md 14.20): what the queues did, minute by minute,
counted by the server for committed work only. A real server on a loopback
port, on every backend; the ring itself on trio's MockClock, where minutes
pass in no time."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import pytest
import trio
import trio.testing

from conformance_helpers import get_job
from harness import ThreadServer
from helpers import create, ok, until
from jobserver.core.engine import depth, history
from jobserver.core.engine.history import History
from jobserver.storage.sqlite import Store
from wire import Client

SERIES = ("created", "handedOut", "finished", "failed", "retried", "depth")


def read(client: Client, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = ok(client.request("History", **params)).json
    return body


def totals(body: dict[str, Any]) -> dict[str, int]:
    """Each counted series summed over the window (depth is a gauge)."""
    return {name: sum(body["series"][name]) for name in SERIES[:-1]}


@pytest.mark.backends
def test_each_event_is_counted_in_its_queue(client):
    sent = [create(client, "email/send") for _ in range(4)]
    create(client, "report")
    retried = create(client, "email/bounce", maxAttempts=3)
    handed = [get_job(client, "email/send")["jobID"] for _ in range(3)]
    assert handed == sent[:3]
    ok(client.request("FinishJob", jobID=sent[0]))
    ok(client.request("FailJob", jobID=sent[1], error="boom"))
    ok(client.request("RetryJob", jobID=sent[2], delay=0))
    assert get_job(client, "email/bounce")["jobID"] == retried
    # A failed attempt that the retry policy queues again is a retry.
    ok(client.request("FailJob", jobID=retried, error="again"))

    email = read(client, name="email")
    assert totals(email) == {
        "created": 5,
        "handedOut": 4,
        "finished": 1,
        "failed": 1,
        "retried": 2,
    }
    assert email["queue"] == "email" and email["tracked"] is True
    everything = read(client)
    assert totals(everything)["created"] == 6
    assert everything["queues"] == ["email", "report"]
    assert everything["interval"] == 60
    # The whole window by default, each series one value a minute, this
    # minute last.
    assert everything["minutes"] == everything["window"] == history.DEFAULT_MINUTES
    assert all(len(everything["series"][name]) == everything["minutes"] for name in SERIES)
    assert everything["series"]["created"][-1] == 6
    assert everything["start"].endswith(":00Z")
    assert everything["startTime"] % 60 == 0


@pytest.mark.backends
def test_a_refused_request_counts_nothing(client):
    create(client, "kept")
    # Two jobs are stored before the third element is refused: the request
    # is undone, and so are its counts.
    reply = client.request(
        "CreateJobs",
        jobs=json.dumps(
            [{"name": "undone"}, {"name": "undone"}, {"name": "undone", "priority": 7}]
        ),
    )
    assert reply.status == "402 Invalid priority value"
    body = read(client)
    assert totals(body)["created"] == 1
    assert body["queues"] == ["kept"]
    assert read(client, name="undone")["tracked"] is False


@pytest.mark.backends
def test_finishjobs_counts_the_elements_that_finished(client):
    jobs = [create(client, "batch/x") for _ in range(3)]
    for _ in jobs:
        get_job(client, "batch/x")
    # The second element names the first job again: 404, undone alone.
    reply = client.request(
        "FinishJobs", jobs=json.dumps([{"jobID": j} for j in (*jobs[:1], *jobs)])
    )
    assert [e["status"] for e in ok(reply).json["results"]] == [
        "200 OK",
        "404 No job with this jobID",
    ] + ["200 OK"] * 2
    assert totals(read(client, name="batch"))["finished"] == 3


def test_a_repeating_jobs_run_is_finished_and_a_queue_not_seen_reads_as_zeros(client):
    job = create(client, "nightly/backup", repeat="FINISHED, +1 HOUR")
    get_job(client, "nightly/backup")
    ok(client.request("FinishJob", jobID=job))
    assert totals(read(client, name="nightly"))["finished"] == 1
    unseen = read(client, name="nothing", minutes=5)
    assert unseen["tracked"] is False
    assert unseen["series"] == {name: [0] * 5 for name in SERIES}


@pytest.mark.backends
def test_a_burst_of_new_queues_cannot_take_a_busy_queues_series(client):
    """The attack on issue 34's fix: one CreateJobs naming 99 new queues
    filled the series, the same again marked them all at work, and one
    CreateJob in a new queue took the series of the busy `email` (a job
    every 0.5 s), which never got it back while it stayed busy."""
    create(client, "email/send")
    burst = json.dumps([{"name": f"atk{i}/x"} for i in range(history.MAX_TRACKED_QUEUES - 1)])
    ok(client.request("CreateJobs", jobs=burst))
    create(client, "email/send")
    ok(client.request("CreateJobs", jobs=burst))
    create(client, "atknew/x")

    email = read(client, name="email")
    assert email["tracked"] is True and totals(email)["created"] == 2
    # Its series counts from the minute it got it, in the window.
    assert email["start"] < email["trackedSince"]
    newcomer = read(client, name="atknew")
    assert newcomer["tracked"] is False and newcomer["trackedSince"] is None
    everything = read(client)
    assert "email" in everything["queues"] and "atknew" not in everything["queues"]
    assert len(everything["queues"]) == history.MAX_TRACKED_QUEUES and everything["other"] is True
    assert totals(everything)["created"] == 2 * (history.MAX_TRACKED_QUEUES - 1) + 3


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"minutes": "0"}, "402 Malformed minutes: 1 to 1440"),
        ({"minutes": "1441"}, "402 Malformed minutes: 1 to 1440"),
        ({"minutes": "-5"}, "402 Malformed minutes"),
        ({"minutes": "ten"}, "402 Malformed minutes"),
        ({"minutes": "9" * 40}, "402 Malformed minutes"),
        ({"name": "a/b"}, "402 Malformed name: a queue has no '/'"),
        ({"name": "a\x01"}, "402 Malformed name"),
        ({"name": "q" * 256}, "402 Name too large (255 bytes at most)"),
    ],
)
def test_bad_parameters_are_refused(client, params, status):
    assert client.request("History", **params).status == status


def test_minutes_reads_the_last_minutes_and_typos_are_named(client):
    create(client, "q")
    body = read(client, minutes=3)
    assert body["series"]["created"] == [0, 0, 1]
    reply = client.request("History", minuts=3)
    assert reply.headers.get("ignoredHeaders") == "minuts"


def test_counts_are_lost_on_restart_and_depth_is_read_as_the_server_starts(tmp_path):
    first = ThreadServer(tmp_path / "jobs.db")
    try:
        with first.client() as client:
            for _ in range(3):
                create(client, "mail/send")
    finally:
        first.stop()
    second = ThreadServer(tmp_path / "jobs.db")
    try:
        with second.client() as client:
            depth_now = until(
                lambda: read(client, name="mail", minutes=1)["series"]["depth"][0],
                10,
                "the depth read at start",
            )
            assert depth_now == 3
            assert totals(read(client))["created"] == 0
    finally:
        second.stop()


def test_no_history_when_turned_off(start_server, tmp_path):
    server = start_server(tmp_path / "off.db", "--history-minutes", "0")
    with Client(server.port) as client:
        create(client, "q")
        assert client.request("History").status == "404 No history kept (--history-minutes 0)"


@pytest.mark.parametrize("value", ["-1", "10081", "1.5", "day"])
def test_bad_history_minutes_are_refused(value, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobserver",
            "serve",
            "--db",
            str(tmp_path / "x.db"),
            "--history-minutes",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--history-minutes" in run.stderr and "0 to 10080" in run.stderr


def test_history_minutes_is_in_help():
    run = subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--history-minutes N" in run.stdout


# The ring on trio's MockClock.


class TrioClock:
    """The engine's Clock, following trio's (mock) time from a fixed epoch."""

    def __init__(self, epoch: float) -> None:
        self.epoch = epoch

    def now(self) -> Any:
        from datetime import UTC, datetime

        return datetime.fromtimestamp(self.epoch + trio.current_time(), UTC)


def _events(kind: int, name: str, count: int = 1) -> history.Events:
    events = history.new_events()
    events[kind][name] = count
    return events


def _run(test: Any) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def test_events_land_in_the_minute_they_commit_and_the_window_is_bounded():
    async def main() -> None:
        ring = History(5, TrioClock(1_800_000_000.0))
        ring.record([_events(history.CREATED, "a/x", 2)])
        await trio.sleep(60)
        ring.record([_events(history.FINISHED, "a/y"), _events(history.FAILED, "b")])
        window = ring.read("a", 5)
        assert window.series["created"] == [0, 0, 0, 2, 0]
        assert window.series["finished"] == [0, 0, 0, 0, 1]
        assert ring.read(None, 5).series["failed"] == [0, 0, 0, 0, 1]
        # Four minutes later the first minute has left the window of five.
        await trio.sleep(4 * 60)
        assert ring.read("a", 5).series["created"] == [0] * 5
        assert ring.read("a", 5).series["finished"] == [1, 0, 0, 0, 0]
        # A queue silent for a whole window is forgotten.
        await trio.sleep(5 * 60)
        assert ring.read(None, 5).queues == []
        assert ring.read(None, 5).series["finished"] == [0] * 5

    _run(main)


def test_queues_past_the_tracked_many_are_counted_in_the_totals_only():
    async def main() -> None:
        ring = History(3, TrioClock(0.0))
        ring.record(
            [_events(history.CREATED, f"q{i}") for i in range(history.MAX_TRACKED_QUEUES + 7)]
        )
        window = ring.read(None, 3)
        assert len(window.queues) == history.MAX_TRACKED_QUEUES and window.other
        assert window.series["created"][-1] == history.MAX_TRACKED_QUEUES + 7
        assert ring.read(f"q{history.MAX_TRACKED_QUEUES + 1}", 3).tracked is False
        # The memory it costs: 48 bytes a minute for each series kept, the
        # totals' and the tracked queues'.
        assert ring.bytes_per_minute() == (history.MAX_TRACKED_QUEUES + 1) * 6 * 8

    _run(main)


def _commit(ring: History, queues: Iterable[str], kind: int = history.CREATED) -> None:
    """One committed transaction's events: one job in each queue."""
    events = history.new_events()
    for queue in queues:
        events[kind][f"{queue}/x"] = 1
    ring.record([events])


IDLE = history.IDLE_MINUTES * 60


def test_a_newcomer_takes_the_series_of_a_queue_idle_for_the_idle_minutes():
    async def main() -> None:
        most = history.MAX_TRACKED_QUEUES
        ring = History(3 * history.IDLE_MINUTES, TrioClock(0.0))
        _commit(ring, (f"q{i}" for i in range(most)))
        await trio.sleep(IDLE // 2)
        _commit(ring, (f"q{i}" for i in range(1, most)), history.FINISHED)
        # No queue has been idle long enough: the newcomer is in the totals.
        _commit(ring, ["early"])
        assert ring.read("early", 1).tracked is False and ring.read(None, 1).other
        await trio.sleep(IDLE // 2 - 60)
        _commit(ring, ["early"])
        assert ring.read("early", 1).tracked is False
        # A minute later q0 has gone the idle minutes without an event.
        await trio.sleep(60)
        _commit(ring, ["new"])
        queues = ring.read(None, 1).queues
        assert "new" in queues and "q0" not in queues and len(queues) == most
        assert ring.read("q0", 1).tracked is False
        assert ring.read("new", 1).since == history.IDLE_MINUTES
        # The next newcomer finds q1..q99 idle for half of that only.
        _commit(ring, ["newer"])
        assert "newer" not in ring.read(None, 1).queues

    _run(main)


def test_a_busy_queue_in_the_totals_takes_a_series_as_soon_as_one_is_idle_long_enough():
    async def main() -> None:
        most = history.MAX_TRACKED_QUEUES
        window = 3 * history.IDLE_MINUTES
        ring = History(window, TrioClock(0.0))
        held = [f"t{i}" for i in range(most)]
        _commit(ring, held)
        # `busy` has a job every minute; t1..t99 too, t0 none after the first.
        for _ in range(history.IDLE_MINUTES):
            _commit(ring, ["busy", *held[1:]])
            assert ring.read("busy", 1).tracked is False
            await trio.sleep(60)
        _commit(ring, ["busy"])
        busy = ring.read("busy", window)
        assert busy.tracked and "t0" not in busy.queues and len(busy.queues) == most
        # What the totals counted of it before is not in its series, and
        # the reply says from which minute the series counts.
        assert busy.since == history.IDLE_MINUTES
        assert sum(busy.series["created"]) == 1
        assert sum(ring.read(None, window).series["created"]) == most + 61 * 1 + 60 * (most - 1)

    _run(main)


def test_a_burst_of_new_queues_takes_no_series_from_queues_at_work_and_the_bound_holds():
    async def main() -> None:
        most = history.MAX_TRACKED_QUEUES
        ring = History(history.DEFAULT_MINUTES, TrioClock(0.0))
        _commit(ring, ["email"])
        attackers = [f"atk{i}" for i in range(most - 1)]
        _commit(ring, attackers)
        _commit(ring, ["email"])
        _commit(ring, attackers)
        # Each minute for two hours, email has a job and so do the 99; a
        # thousand new queues a minute find none idle long enough.
        for minute in range(2 * history.IDLE_MINUTES):
            _commit(ring, (f"new{minute}-{i}" for i in range(1000)))
            _commit(ring, ["email", *attackers])
            window = ring.read("email", 1)
            assert window.tracked and window.since == 0
            assert len(window.queues) == most and window.other
            assert ring.bytes_per_minute() == (most + 1) * 6 * 8
            await trio.sleep(60)
        # The attackers stop: after the idle minutes, a new queue takes one
        # of their series, never email's.
        for _ in range(history.IDLE_MINUTES):
            _commit(ring, ["email"])
            await trio.sleep(60)
        _commit(ring, ["late"])
        queues = ring.read(None, 1).queues
        assert "late" in queues and "email" in queues and len(queues) == most

    _run(main)


def test_in_a_window_shorter_than_the_idle_minutes_a_queue_idle_for_the_window_gives_way():
    async def main() -> None:
        most, window = history.MAX_TRACKED_QUEUES, 5
        assert window < history.IDLE_MINUTES
        ring = History(window, TrioClock(0.0))
        _commit(ring, (f"q{i}" for i in range(most)))
        # q0 still holds jobs (its depth keeps it from being forgotten),
        # but has had no event in the window: nothing of it to graph.
        for _ in range(window):
            await trio.sleep(60)
            ring.sample_depth({"q0": 1})
            _commit(ring, (f"q{i}" for i in range(1, most)))
        _commit(ring, ["new"])
        queues = ring.read(None, 1).queues
        assert "new" in queues and "q0" not in queues

    _run(main)


def test_a_queue_that_only_holds_jobs_takes_no_series_and_gives_its_own_up_first():
    async def main() -> None:
        most = history.MAX_TRACKED_QUEUES
        ring = History(10, TrioClock(0.0))
        _commit(ring, ["worked"])
        await trio.sleep(60)
        held = {f"d{i}": 1 for i in range(most - 1)}
        ring.sample_depth(held)
        # Full: a queue seen only in a depth sample is counted in the totals.
        ring.sample_depth({**held, "deep": 5})
        window = ring.read(None, 1)
        assert "deep" not in window.queues and window.other
        assert window.series["depth"] == [most - 1 + 5]
        # A queue with an event takes a series from one that only has
        # depth, though the last event of `worked` is older.
        _commit(ring, ["new"])
        queues = ring.read(None, 1).queues
        assert "new" in queues and "worked" in queues and len(queues) == most

    _run(main)


def test_queues_that_only_hold_jobs_give_their_series_up_after_the_idle_minutes(tmp_path):
    """Issue 34: one request made a job due in 2099 in each of 100 queues,
    and while those jobs sat, every queue after them went untracked. The
    real commands, engine and store, on trio's MockClock."""

    async def main() -> None:
        from jobserver.core.build import build_core
        from jobserver.core.engine.context import Settings
        from jobserver.wire.framing import Request

        clock = TrioClock(1_800_000_000.0)
        store = Store(str(tmp_path / "jobs.db"), "NORMAL")
        core = build_core(store, clock, Settings(), threaded=False)
        core.engine.start()

        async def call(command: str, **params: str) -> Any:
            answer = await core.dispatcher.dispatch(Request(command, params), "t")
            assert answer.response.code == 200, answer.response
            return json.loads(answer.response.body) if answer.response.body else None

        try:
            most = history.MAX_TRACKED_QUEUES
            due = "2099-01-01 00:00:00"
            sitting = [{"name": f"sit{i}/x", "firstRun": due} for i in range(most)]
            await call("CreateJobs", jobs=json.dumps(sitting))
            await call("CreateJob", name="live/x")
            assert (await call("History", name="live"))["tracked"] is False
            # An hour of depth samples: the jobs sit, no event in their queues.
            for _ in range(history.IDLE_MINUTES * 4):
                await depth.sample_once(store, core.engine.history, clock)
                await trio.sleep(15)
            await call("CreateJob", name="live/x")
            live = await call("History", name="live", minutes="2")
            assert live["tracked"] is True and live["series"]["created"] == [0, 1]
            assert live["trackedSince"] == history.utc_text(live["startTime"] // 60 + 1)
            everything = await call("History")
            assert "live" in everything["queues"] and len(everything["queues"]) == most
            assert everything["other"] is True
        finally:
            await core.engine.stop()
            store.close()

    _run(main)


def test_depth_is_sampled_from_the_store(tmp_path):
    async def main() -> None:
        from jobserver.core.build import build_core
        from jobserver.core.engine.context import Settings

        clock = TrioClock(1_800_000_000.0)
        store = Store(str(tmp_path / "jobs.db"), "NORMAL")
        core = build_core(store, clock, Settings(), threaded=False, history_minutes=10)
        core.engine.start()
        try:
            from jobserver.wire.framing import Request

            for name in ("a/1", "a/2", "b", "b"):
                answer = await core.dispatcher.dispatch(Request("CreateJob", {"name": name}), "t")
                assert answer.response.code == 200
            await depth.sample_once(store, core.engine.history, clock)
            assert core.engine.history.read("a", 1).series["depth"] == [2]
            assert core.engine.history.read(None, 1).series["depth"] == [4]
            assert core.engine.history.read(None, 1).series["created"] == [4]
        finally:
            await core.engine.stop()
            store.close()

    _run(main)


def test_a_minute_not_yet_sampled_holds_the_last_depth_not_zero():
    # The graph read [38, 38, 0] two seconds into a minute and [38, 38, 38]
    # at seventeen: the new minute's depth was 0 until its first sample.
    async def main() -> None:
        clock = TrioClock(1_800_000_000.0)  # a whole minute
        ring = History(10, clock)
        depths = {"a": 38, "b": 2}

        async def sampler() -> None:
            """run_sampler's schedule (13, 28, 43, 58 s), without its thread,
            which trio's MockClock would jump past."""
            while True:
                ring.sample_depth(depths)
                await trio.sleep(depth.seconds_to_next_sample(clock.now().timestamp(), False))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            await trio.sleep(2 * 60 + 2)  # two seconds into the third minute
            assert ring.read(None, 3).series["depth"] == [40, 40, 40]
            assert ring.read("a", 3).series["depth"] == [38, 38, 38]
            await trio.sleep(15)
            assert ring.read("a", 3).series["depth"] == [38, 38, 38]
            depths = {"a": 5}
            await trio.sleep(60)  # 17 s into the fourth minute
            # The third minute keeps its last sample, at 58 s.
            assert ring.read("a", 3).series["depth"] == [38, 5, 5]
            assert ring.read("b", 3).series["depth"] == [2, 0, 0]
            nursery.cancel_scope.cancel()
        # Minutes without a sample of their own (the sampler stopped, or a
        # slow read skipped them) hold the last one, in a window of any length.
        await trio.sleep(3 * 60)
        assert ring.read("a", 4).series["depth"] == [5, 5, 5, 5]
        await trio.sleep(20 * 60)
        assert ring.read(None, 10).series["depth"] == [5] * 10

    _run(main)


@pytest.mark.parametrize(
    ("into_minute", "slow", "wait"),
    [
        (0.0, False, 13.0), (12.5, False, 0.5), (13.0, False, 15.0), (20.0, False, 8.0),
        (57.9, False, 0.1), (58.0, False, 15.0), (59.0, False, 14.0),
        (0.0, True, 58.0), (13.0, True, 45.0), (58.0, True, 60.0), (59.5, True, 58.5),
    ],
)
def test_the_depth_is_sampled_four_times_a_minute_or_once_after_a_slow_read(
    into_minute: float, slow: bool, wait: float
) -> None:
    """At 13, 28, 43 and 58 seconds into each minute, the last just before
    the minute ends; at 58 alone while a read takes long (a huge queue)."""
    minute = 1_800_000_000.0  # a whole minute since 1970
    assert minute % 60 == 0
    assert depth.seconds_to_next_sample(minute + into_minute, slow) == pytest.approx(wait)


@pytest.mark.parametrize("window", [1, 2, 5, 60])
def test_a_read_of_the_ring_is_its_last_minutes_oldest_first_across_the_wrap(window: int) -> None:
    """The slices a read takes agree with reading slot by slot, for every
    head position and length, the ring's end crossed or not."""
    from array import array

    values = array("q", range(100, 100 + window))
    for minute in range(3 * window):
        for minutes in range(1, window + 1):
            slots = [m % window for m in range(minute - minutes + 1, minute + 1)]
            assert history._last(values, minute, minutes) == [values[s] for s in slots]
